"""The demo: healthy shows nothing, each injected bug shows the detector made for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wbdebug import EventKind as K
from wbdebug.demo import run_demo

EXPECTED = {
    None: set(),
    "lr": {K.EXPLODING_GRADIENTS},
    "dead_relu": {K.DEAD_ACTIVATIONS, K.VANISHING_GRADIENTS},
    "init": {K.INITIAL_LOSS},
    "nan": {K.NONFINITE_LOSS, K.NONFINITE_GRAD},
    "spike": {K.LOSS_SPIKE},
}


@pytest.mark.parametrize("bug", list(EXPECTED), ids=lambda b: b or "healthy")
def test_demo_shows_the_right_events(bug, offline_wandb):
    monitor = run_demo(bug, console=False).monitor
    raised = {e.kind for e in monitor.events if e.severity != "info"}
    assert EXPECTED[bug] <= raised
    if bug is None:
        assert raised == set()
    if bug == "nan":
        assert next(e for e in monitor.events if e.kind == K.NONFINITE_LOSS).step == 150
    if bug == "spike":
        assert next(e for e in monitor.events if e.kind == K.LOSS_SPIKE).step == 200


def test_demo_cli_end_to_end(offline_wandb):
    proc = subprocess.run([sys.executable, "-m", "wbdebug.cli", "demo", "--bug", "nan"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "nonfinite_loss" in proc.stderr and "wandb sync" in proc.stdout
    assert "health summary" in proc.stderr


def test_demo_cli_rejects_an_unknown_bug_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "wbdebug.cli", "demo", "--bug", "typo"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "expected one of" in proc.stderr
    assert "Traceback" not in proc.stderr
