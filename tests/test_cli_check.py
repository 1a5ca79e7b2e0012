"""``wbdebug check`` as a user runs it: a subprocess, an offline W&B run read back, exit codes that gate."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import history, read_run
from wbdebug import CheckSetup
from wbdebug.checks.factory import build_setup, parse_params

REPO = Path(__file__).resolve().parents[1]

FACTORIES = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), 1e-2)


def healthy(width: int = 16):
    model, crit, opt = _parts()
    x, y = torch.randn(200, 8), torch.randint(0, 3, (200,))
    return dict(model=model, criterion=crit, optimizer=opt, train=DataLoader(TensorDataset(x, y), batch_size=20))


def wrong_shape():
    model, crit, opt = _parts()
    return model, crit, opt


def mismatched():
    model, crit, opt = _parts()
    return dict(model=model, criterion=crit, optimizer=opt, train=[(torch.randn(10, 8), torch.randint(0, 3, (12,)))])


def empty():
    model, crit, opt = _parts()
    x, y = torch.randn(0, 8), torch.zeros(0, dtype=torch.long)
    return dict(model=model, criterion=crit, optimizer=opt, train=DataLoader(TensorDataset(x, y), batch_size=4))


def bad_criterion():
    model, _, opt = _parts()
    x, y = torch.randn(40, 8), torch.randn(40, 5)
    return dict(model=model, criterion=nn.MSELoss(), optimizer=opt, train=[(x, y)])


def raises():
    raise RuntimeError("dataset path /data/missing not found")
'''


@pytest.fixture
def env(tmp_path):
    """Environment for a subprocess: offline W&B in a temp dir, no key, no stray settings."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("WBDEBUG_", "WANDB_"))}
    out.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", PYTHONPATH=str(tmp_path))
    (tmp_path / "myfactories.py").write_text(FACTORIES)
    return out


def wbdebug(*args, env, cwd=REPO, timeout=120):
    return subprocess.run([sys.executable, "-m", "wbdebug.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def run_dir(stdout: str) -> Path:
    line = next(l for l in stdout.splitlines() if l.startswith("W&B run directory:"))
    return Path(line.split(":", 1)[1].strip())


def summary(records) -> dict:
    out: dict = {}
    for r in records:
        if r["type"] == "summary":
            out.update(r["summary"]["update"])
    return out


def test_check_passes_on_the_healthy_example_and_logs_an_offline_run(env):
    start = time.monotonic()
    proc = wbdebug("check", "--factory", "examples.digits:build", env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 30
    out = proc.stdout
    assert "PASSED: 3 check(s)" in out and "overfit" in out and "initial_loss" in out and "data" in out
    assert "overfit one batch" in proc.stderr  # the progress bar
    records = read_run(run_dir(out))
    rows = [r for r in history(records) if "wbdebug/check/overfit_loss" in r]
    assert [r["wbdebug/step"] for r in rows] == list(range(len(rows))) and 10 <= len(rows) < 200
    assert rows[0]["wbdebug/check/overfit_loss"] > 2.0 > 0.12 > rows[-1]["wbdebug/check/overfit_loss"]
    assert any("wbdebug/check/overfit_curve_table._type" in r for r in history(records))
    config = [r["config"]["update"] for r in records if r["type"] == "config"]
    assert any("_wandb.visualize.wbdebug/check/overfit_curve" in c for c in config)  # the line plot panel
    s = summary(records)
    assert s["wbdebug/check/passed"] == 1 and s["wbdebug/check/initial_loss/ratio"] == pytest.approx(1, abs=0.5)
    assert s["wbdebug/event_count"] == 0
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["job_type"] == "preflight" and run["config"]["update"]["factory"] == "examples.digits:build"


def test_check_fails_on_the_buggy_example_with_the_right_events(env):
    proc = wbdebug("check", "--factory", "examples.digits:build_buggy", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FAILED: overfit, data" in out
    assert "error overfit_failed" in out and "levelled off at a floor" in out
    assert "error unnormalized_inputs (train)" in out and "fix: Divide raw pixels by 255" in out
    records = read_run(run_dir(out))
    s = summary(records)
    assert s["wbdebug/check/passed"] == 0 and s["wbdebug/check/overfit/passed"] == 0
    assert s["wbdebug/check/initial_loss/passed"] == 1
    table = next(r for r in history(records) if "wbdebug/events.nrows" in r)
    assert table["wbdebug/events.nrows"] == s["wbdebug/event_count"] >= 3


def test_one_check_with_params_and_agent_style_options(env):
    # --param and the agent's --key=value form both reach the factory; --check picks one check
    proc = wbdebug("check", "--factory", "examples.digits:build", "--check=overfit", "--steps", "30",
                   "--param", "bug=softmax", "--lr=0.002", "--seed=1", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "overfit_failed" in proc.stdout and "initial_loss │" not in proc.stdout
    run = next(r["run"] for r in read_run(run_dir(proc.stdout)) if r["type"] == "run")
    config = run["config"]["update"]
    assert (config["bug"], config["lr"], config["seed"], config["steps"]) == ("softmax", 0.002, 1, 30)


def test_a_factory_next_to_the_users_code_returning_a_dict(env, tmp_path):
    proc = wbdebug("check", "--factory", "myfactories:healthy", "--check", "overfit", "--param", "width=8",
                   env={**env, "PYTHONPATH": "", "WBDEBUG_WANDB": "false"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED: 1 check(s)" in proc.stdout and "W&B run directory" not in proc.stdout
    assert not list(tmp_path.glob("wandb/*run-*")), "WBDEBUG_WANDB=false: no W&B run"


BAD_INPUT = [
    (["--factory", "examples.nope:build"], "cannot import 'examples.nope'"),
    (["--factory", "myfactories:wrong_shape"], "returned a tuple; expected a wbdebug.CheckSetup, or a dict"),
    (["--factory", "myfactories:mismatched"], "inputs have 10 rows but targets have 12"),
    (["--factory", "myfactories:empty"], "train yielded no batches"),
    (["--factory", "myfactories:bad_criterion"], "the criterion MSELoss() does not accept the model output"),
    (["--factory", "myfactories:raises"], "factory myfactories:raises raised RuntimeError: dataset path"),
    (["--factory", "myfactories:healthy", "--param", "depth=3"], "has no parameter 'depth'; it accepts: width"),
    (["--factory", "myfactories:healthy", "--check", "gradients"], "unknown check 'gradients'"),
    (["--factory", "myfactories:healthy", "--steps", "many"], "--steps must be a positive integer, got 'many'"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD_INPUT)])
def test_bad_input_is_one_line_and_exit_code_2(env, args, message):
    proc = wbdebug("check", *args, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "overfit one batch" not in l]
    assert len(lines) == 1 and lines[0].startswith("wbdebug: error: "), proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr


def test_verbose_shows_the_traceback(env):
    proc = wbdebug("check", "--factory", "myfactories:raises", "--verbose", env=env)
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "dataset path /data/missing not found" in proc.stderr


def test_factory_specs_and_params_are_parsed_with_clear_errors(env, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ValueError, match="--factory must look like package.module:function, got 'examples.digits'"):
        build_setup("examples.digits", {})
    with pytest.raises(ValueError, match="module examples.digits has no attribute 'biuld'"):
        build_setup("examples.digits:biuld", {})
    with pytest.raises(ValueError, match="examples.digits:BUGS is a dict, not a function"):
        build_setup("examples.digits:BUGS", {})
    with pytest.raises(ValueError, match=r"parameter width='wide' for factory myfactories:healthy: expected int"):
        build_setup("myfactories:healthy", {"width": "wide"})
    with pytest.raises(ValueError, match="has no value; expected key=value"):
        parse_params(["width"])
    assert parse_params(["lr=0.1", "--seed=2", "--init-scale", "3", "bug=a,b"]) == {
        "lr": "0.1", "seed": "2", "init_scale": "3", "bug": "a,b"}
    setup, params = build_setup("examples.digits:build", parse_params(
        ["lr=0.1", "seed=2", "bug=none", "threads=none", "init_scale=3"]))
    assert params == {"lr": 0.1, "seed": 2, "bug": None, "threads": None, "init_scale": 3.0}
    assert isinstance(setup, CheckSetup) and setup.num_classes == 10
    assert setup.optimizer.param_groups[0]["lr"] == 0.1
