from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B in offline mode, writing into a temporary directory; no key, no network, no prompt."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield tmp_path
    import wandb

    if wandb.run is not None:
        wandb.run.finish()


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    """No stray WBDEBUG_* settings or .env file from the developer's machine."""
    import os

    for key in list(os.environ):
        if key.startswith("WBDEBUG_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is fastest, and immune to other processes contending for the cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    """The standardised digits split (train x, train y, val x, val y)."""
    from wbdebug.demo import digits_tensors

    return digits_tensors()


def read_run(run_dir: str | Path) -> list[dict]:
    """Every record of an offline run, decoded by wandb's own reader (`wandb leet inspect --json`)."""
    wandb_bin = Path(sys.executable).parent / "wandb"
    out = subprocess.run(
        [str(wandb_bin), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def alerts(records: list[dict]) -> list[dict]:
    return [r["alert"] for r in records if r["type"] == "alert"]
