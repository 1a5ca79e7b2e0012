"""The sanity sweep: a real W&B sweep config, checked and expanded by W&B's own sweep engine, run locally."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import history, read_run
from wbdebug.checks.sweep import agent_command, load_config, plain, schema_violations, suggestions

REPO = Path(__file__).resolve().parents[1]
SANITY = REPO / "sweeps" / "sanity.yaml"

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sweeps


@pytest.fixture
def env(tmp_path):
    out = {k: v for k, v in os.environ.items() if not k.startswith(("WBDEBUG_", "WANDB_"))}
    out.update(WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    return out


def wbdebug(*args, env, timeout=180):
    return subprocess.run([sys.executable, "-m", "wbdebug.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout)


def test_sanity_yaml_is_a_valid_grid_over_the_example_factory():
    config = yaml.safe_load(SANITY.read_text())
    assert sweeps.schema_violations_from_proposed_config(config) == []
    assert config["method"] == "grid" and "${args}" in config["command"]
    assert config["command"][config["command"].index("--factory") + 1] == "examples.digits:build"
    sys.path.insert(0, str(REPO))
    from examples.digits import build

    accepted = set(inspect.signature(build).parameters) | {"check"}
    assert set(config["parameters"]) <= accepted
    assert set(config["parameters"]["check"]["values"]) <= {"overfit", "initial_loss", "data"}
    points = sweeps.next_runs(config, [], n=100)
    grid = [p for p in points if p is not None]
    sizes = [len(p["values"]) for p in config["parameters"].values()]
    assert len(grid) == int(np.prod(sizes)) == 8
    assert len({tuple(sorted((k, v["value"]) for k, v in plain(p.config).items())) for p in grid}) == 8


def test_local_points_are_sweeps_next_run_in_plain_python_and_the_agents_command_line():
    config = load_config(SANITY)
    points = [run_config for run_config, _ in suggestions(config, None)]
    assert len(points) == 8
    assert all(type(v["value"]) in (str, int, float) for p in points for v in p.values())
    first = points[0]
    assert agent_command(config, first, "/tmp/args.json") == [
        "/usr/bin/env", sys.executable, "-m", "wbdebug.cli", "check", "--factory", "examples.digits:build",
        *[f"--{k}={v['value']}" for k, v in first.items()],
    ]
    assert plain({"a": np.float64(0.5), "b": [np.int64(2)], "c": np.array([1, 2])}) == {"a": 0.5, "b": [2], "c": [1, 2]}
    assert type(plain(np.float64(0.5))) is float


def test_random_and_bayes_points_come_from_sweeps_and_bayes_learns_from_reported_metrics():
    space = {"lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-1}, "seed": {"values": [0, 1]}}
    random = [c for c, _ in suggestions({"method": "random", "parameters": space}, 3)]
    assert len(random) == 3 and all(type(c["lr"]["value"]) is float and 1e-4 <= c["lr"]["value"] <= 1e-1 for c in random)
    bayes = {"method": "bayes", "metric": {"name": "wbdebug/check/overfit/final_loss", "goal": "minimize"},
             "parameters": space}
    seen = []
    for config, record in suggestions(bayes, 4):
        seen.append(config["lr"]["value"])
        record({"metrics": {"wbdebug/check/overfit/final_loss": abs(np.log10(config["lr"]["value"]) + 2)}})
    assert len(seen) == 4 and len(set(seen)) == 4


def test_validate_prints_violations_in_wandbs_own_words(env, tmp_path):
    proc = wbdebug("sweep", "--validate", str(SANITY), env=env)
    assert proc.returncode == 0 and "valid W&B sweep config" in proc.stdout
    bad = {"method": "gird", "parameters": {"lr": {"min": "low"}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = wbdebug("sweep", "--validate", str(path), env=env)
    assert proc.returncode == 1
    expected = sweeps.schema_violations_from_proposed_config(bad)
    assert expected and schema_violations(bad) == expected
    assert [l.split(": ", 1)[1] for l in proc.stdout.splitlines()[:-1]] == expected
    proc = wbdebug("sweep", str(path), env=env)  # running an invalid sweep is bad input
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a valid W&B sweep config" in proc.stderr


def test_bad_sweep_input_is_one_line(env, tmp_path):
    proc = wbdebug("sweep", str(tmp_path / "missing.yaml"), env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    random = tmp_path / "random.yaml"
    random.write_text(yaml.safe_dump({"method": "random", "command": ["${env}"], "parameters": {"lr": {"values": [1]}}}))
    proc = wbdebug("sweep", str(random), env=env)
    assert proc.returncode == 2 and "pass --count N" in proc.stderr and "Traceback" not in proc.stderr


def test_sweep_runs_one_grid_point_as_an_offline_wandb_run(env, tmp_path):
    proc = wbdebug("sweep", str(SANITY), "--count", "1", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1] check=overfit lr=0.001 seed=0: passed" in proc.stdout
    assert "1 of 1 point(s) passed." in proc.stdout
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = read_run(runs[0])
    run = next(r["run"] for r in records if r["type"] == "run")
    config = run["config"]["update"]
    assert (config["check"], config["lr"], config["seed"]) == ("overfit", 0.001, 0)  # from the sweep's params
    assert run["run_group"].startswith("local-")
    assert any("wbdebug/check/overfit_loss" in r for r in history(records))
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    assert summary["wbdebug/check/passed"] == 1 and "wbdebug/check/data/passed" not in summary
