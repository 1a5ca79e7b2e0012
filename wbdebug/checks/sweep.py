"""W&B sweeps without a W&B server: validate a sweep config with W&B's own engine (the ``sweeps`` package),
expand its points with ``sweeps.next_run`` as W&B's local controller does, and run each point's command
the way ``wandb agent`` builds it, as an offline W&B run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Report file a ``wbdebug check`` writes when this variable names one (how a local sweep reads results).
REPORT_ENV = "WBDEBUG_CHECK_REPORT"


def _sweeps():
    with warnings.catch_warnings():  # sweeps 0.3 still spells pydantic-v1 config keys
        warnings.simplefilter("ignore")
        import sweeps
    return sweeps


def load_config(path: str | Path) -> dict:
    """The sweep config in a YAML file, as a dict; ValueError naming what is wrong."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep config {str(path)!r} does not exist; expected a W&B sweep YAML file")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a {type(config).__name__}; expected a mapping (method, parameters, ...)")
    return config


def schema_violations(config: dict) -> list[str]:
    """W&B's own schema violations for a sweep config, in its wording (empty when valid)."""
    return list(_sweeps().schema_violations_from_proposed_config(config))


def plain(value: Any) -> Any:
    """numpy scalars and arrays (as ``sweeps`` returns them) to plain Python, recursively."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def agent_command(config: dict, run_config: dict, args_json_file: str) -> list[str]:
    """The command ``wandb agent`` runs for one point, built with wandb's own helpers.

    One deviation: ``${interpreter}`` is this Python (``sys.executable``), where the agent uses ``python``
    from PATH, so a local sweep runs in the same environment as ``wbdebug``.
    """
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    template = list(config.get("command") or sweep_utils.DEFAULT_SWEEP_COMMAND)
    command = sweep_utils.create_sweep_command(template)
    sweep_vars: dict[str, Any] = sweep_utils.create_sweep_command_args({"args": run_config})
    sweep_vars["interpreter"] = [sys.executable]
    sweep_vars["program"] = [config["program"]] if config.get("program") else []
    sweep_vars["args_json_file"] = [args_json_file]
    if os.name != "nt":
        sweep_vars["env"] = ["/usr/bin/env"]
    out: list[str] = []
    for chunk in command:
        chunk = str(chunk)
        if chunk.startswith("${") and chunk.endswith("}"):
            out += [str(v) for v in sweep_vars.get(chunk[2:-1]) or []]
        else:
            out.append(chunk)
    return out


@dataclass
class PointResult:
    """One sweep point: its parameters, the command's exit code, and what its ``wbdebug check`` reported."""

    index: int
    params: dict[str, Any]
    command: list[str]
    returncode: int
    seconds: float
    report: dict | None = None
    run_dir: str | None = None
    output: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return {0: "passed", 1: "failed", 2: "bad input"}.get(self.returncode, f"crashed ({self.returncode})")

    @property
    def event_kinds(self) -> list[str]:
        events = (self.report or {}).get("events", [])
        return sorted({e["kind"] for e in events if e["severity"] != "info"})


def suggestions(config: dict, count: int | None) -> Iterator[tuple[dict, Callable[[dict], None]]]:
    """Each next point's run config (``{name: {"value": v}}``) from ``sweeps.next_run``, with a callback that
    records its finished run's summary metrics (what bayes search learns from)."""
    sweeps = _sweeps()
    method = config.get("method")
    if method in ("random", "bayes") and count is None:
        raise ValueError(f"a {method} sweep never runs out of points; pass --count N")
    runs: list = []
    while count is None or len(runs) < count:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            suggestion = sweeps.next_run(config, runs)
        if suggestion is None:
            return
        run_config = plain(suggestion.config)
        done: dict = {}
        yield run_config, done.update
        runs.append(sweeps.SweepRun(
            name=f"local-{len(runs)}", config=run_config, state=sweeps.RunState.finished,
            summary_metrics=done.get("metrics", {}),
        ))


def run_sweep(
    path: str | Path, *, count: int | None = None, on_point: Callable[[PointResult], None] | None = None,
    workdir: str | Path | None = None,
) -> list[PointResult]:
    """Run a sweep's points locally, one offline W&B run each, grouped under one local sweep id.

    Each point gets what ``wandb agent`` gives it: the parameters in ``WANDB_SWEEP_PARAM_PATH`` (so
    ``wandb.init`` puts them in the run's config) and on the command line it builds.
    """
    from wandb.sdk.lib import config_util

    config = load_config(path)
    violations = schema_violations(config)
    if violations:
        more = f" ({len(violations) - 1} more: wbdebug sweep --validate {path})" if len(violations) > 1 else ""
        raise ValueError(f"{path} is not a valid W&B sweep config: {violations[0]}{more}")
    sweep_id = f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    base = Path(workdir or os.environ.get("WANDB_DIR") or ".") / "wandb" / f"sweep-{sweep_id}"
    base.mkdir(parents=True, exist_ok=True)
    results: list[PointResult] = []
    for index, (run_config, record) in enumerate(suggestions(config, count)):
        params = {k: v["value"] for k, v in run_config.items() if isinstance(v, dict) and "value" in v}
        param_file = base / f"config-{index}.yaml"
        config_util.save_config_file_from_dict(str(param_file), run_config)
        args_json = base / f"config-{index}.json"
        args_json.write_text(json.dumps(params))
        report_file = base / f"report-{index}.json"
        command = agent_command(config, run_config, str(args_json))
        env = dict(os.environ)
        if env.get("WANDB_MODE") != "disabled":
            env["WANDB_MODE"] = "offline"
        env.update({
            "WANDB_SWEEP_PARAM_PATH": str(param_file), "WANDB_RUN_GROUP": sweep_id, REPORT_ENV: str(report_file),
            "WANDB_SILENT": env.get("WANDB_SILENT", "true"),
        })
        start = time.monotonic()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        result = PointResult(
            index=index, params=params, command=command, returncode=proc.returncode,
            seconds=time.monotonic() - start, output=(proc.stdout + proc.stderr)[-4000:],
        )
        if report_file.is_file():
            data = json.loads(report_file.read_text())
            result.report, result.run_dir = data.get("report"), data.get("run_dir")
            result.metrics = data.get("metrics", {})
        record({"metrics": result.metrics})
        results.append(result)
        if on_point is not None:
            on_point(result)
    if not results:
        raise ValueError(f"{path} produced no points to run")
    return results
