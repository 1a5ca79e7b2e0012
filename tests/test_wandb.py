"""W&B for real: an offline run read back with wandb's own reader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import wandb

import wbdebug
from wbdebug import EventKind, keys
from wbdebug.sinks.wandb import TITLE_LIMIT
from conftest import alerts, history, read_run
from models import mlp, train


def run_dir_of(monitor) -> Path:
    return Path(monitor.run.dir).parent


def test_watch_starts_an_offline_run_and_logs_per_layer_metrics(offline_wandb):
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=20, console=False) as monitor:
        train(setup, 50)
    assert monitor.run.settings.mode == "offline"
    records = read_run(run_dir_of(monitor))
    rows = [r for r in history(records) if keys.STEP in r]
    assert [r[keys.STEP] for r in rows if keys.GRAD_NORM_TOTAL in r] == [0, 20, 40, 49]
    row = rows[1]
    for layer in ("0", "2", "4"):
        assert row[keys.grad_norm(layer)] > 0
    for layer in ("1", "3"):  # the ReLU modules
        assert 0.0 <= row[keys.act_zero_frac(layer)] <= 1.0
        assert 0.0 <= row[keys.dead_unit_frac(layer)] <= 1.0
    assert 0.0 < row[keys.LOSS] < 3.0
    # wbdebug/* is plotted against wbdebug/step, defined once, never with an explicit step=
    metrics = [r["metric"] for r in records if r["type"] == "metric"]
    assert any(m.get("glob_name") == "wbdebug/*" and m.get("step_metric") == keys.STEP for m in metrics)
    # the events table is in the run
    assert any(keys.EVENTS_TABLE + "._type" in r for r in history(records))


def test_users_own_wandb_log_keeps_working(offline_wandb):
    run = wandb.init(project="user-project")
    setup = mlp()
    monitor = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=10, console=False)
    for step in range(30):
        x, y = setup.batch(step)
        setup.optimizer.zero_grad()
        loss = setup.criterion(setup.model(x), y)
        loss.backward()
        setup.optimizer.step()
        run.log({"train/loss": loss.item()}, step=step)  # the user's own explicit steps
    monitor.close()
    assert wandb.run is run, "wbdebug must not finish a run it did not start"
    run.finish()
    rows = history(read_run(Path(run.dir).parent))
    user_rows = [r for r in rows if "train/loss" in r]
    assert len(user_rows) == 30
    assert [r["_step"] for r in user_rows] == list(range(30))
    ours = [r[keys.STEP] for r in rows if keys.GRAD_NORM_TOTAL in r]
    assert ours == [0, 10, 20, 29]


def test_warnings_and_errors_become_alerts_without_repeats(offline_wandb):
    setup = mlp()
    with torch.no_grad():
        setup.model[4].weight.mul_(60)  # initial_loss error

    def corrupt(step, x, y):
        return (x * float("nan"), y) if step >= 20 else (x, y)  # NaN every step from 20 on

    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, console=False) as monitor:
        train(setup, 60, corrupt=corrupt)
    got = alerts(read_run(run_dir_of(monitor)))
    titles = [a["title"] for a in got]
    assert all(len(t) <= TITLE_LIMIT for t in titles)
    assert [a["level"] for a in got if "initial_loss" in a["title"]] == ["ERROR"]
    nan_alerts = [a for a in got if "nonfinite_loss" in a["title"]]
    assert len(nan_alerts) == 1 and nan_alerts[0]["level"] == "ERROR"
    assert "step: 20" in nan_alerts[0]["text"] and "fix:" in nan_alerts[0]["text"]
    expected = {e.kind.value for e in monitor.events if e.severity != "info"}
    assert {t.split(": ")[1].split(" ")[0] for t in titles} == expected


def test_journal_survives_sigkill_right_after_the_event(tmp_path):
    journal = tmp_path / "events.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import wbdebug
        from models import mlp
        setup = mlp()
        monitor = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, check_every=1,
                                journal_path={str(journal)!r}, console=False)
        for step in range(100):
            x, y = setup.batch(step)
            if step == 5:
                x = x * float("nan")
            setup.optimizer.zero_grad()
            setup.criterion(setup.model(x), y).backward()
            setup.optimizer.step()
            if monitor.events:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    events = wbdebug.read_journal(journal)
    assert events and events[0].kind == EventKind.NONFINITE_LOSS and events[0].step == 5


def test_journal_lands_in_the_run_directory_for_wandb_sync(offline_wandb):
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, console=False) as monitor:
        train(setup, 10, corrupt=lambda s, x, y: (x * float("inf"), y) if s == 3 else (x, y))
    journal = Path(monitor.run.dir) / "events.jsonl"
    assert monitor.journal_path == journal
    assert [e.kind for e in wbdebug.read_journal(journal)] == [e.kind for e in monitor.events]


def test_without_credentials_or_mode_wbdebug_chooses_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, console=False) as monitor:
        train(setup, 2)
    assert monitor.run.settings.mode == "offline"
    assert (tmp_path / "wandb").glob("offline-run-*")


def test_an_explicit_run_argument_is_used(offline_wandb):
    run = wandb.init(project="explicit")
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, run=run, console=False) as monitor:
        train(setup, 2)
    assert monitor.run is run
    run.finish()
