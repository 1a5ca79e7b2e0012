"""Spike and NaN recovery: snapshots in a bounded ring, roll back, skip the bad batches, cool the LR down.

The recipe is PaLM's (restart ~100 steps before the spike and skip the batches that caused it) and the
seed's ("roll back to a checkpoint, skip or re-weight the corrupt batch, resume with a temporarily
lower learning rate"). The user's data loader is never touched: it simply keeps going, so the batches
seen between the snapshot and the rollback are the ones skipped.
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory (the device copy must not alias live state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class Snapshot:
    """The training state after ``step`` optimizer steps (before step ``step``'s update)."""

    step: int
    state: dict[str, Any] | None = None  # in memory
    path: Path | None = None  # on disk

    def load(self) -> dict[str, Any]:
        if self.state is not None:
            return self.state
        return torch.load(self.path, map_location="cpu", weights_only=False)


class Snapshotter:
    """Keeps the last ``keep`` snapshots of model, optimizer and (when given) scaler and scheduler state."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        keep: int = 3,
        directory: str | os.PathLike | None = None,
        scaler: Any = None,
        scheduler: Any = None,
    ) -> None:
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.keep = keep
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.ring: deque[Snapshot] = deque()

    def state(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return _to_cpu(state)

    def take(self, step: int) -> Snapshot:
        """Snapshot now, as the state after ``step`` steps; the oldest one beyond ``keep`` is dropped."""
        state = self.state()
        if self.directory is None:
            snap = Snapshot(step, state=state)
        else:
            path = self.directory / f"wbdebug-snapshot-{step:09d}.pt"
            _atomic_save(state, path)
            snap = Snapshot(step, path=path)
        self.ring.append(snap)
        while len(self.ring) > self.keep:
            old = self.ring.popleft()
            if old.path is not None:
                old.path.unlink(missing_ok=True)
        return snap

    def newest_at_or_before(self, step: int) -> Snapshot | None:
        for snap in reversed(self.ring):
            if snap.step <= step:
                return snap
        return None

    def restore(self, snap: Snapshot) -> None:
        """Load a snapshot back into the live model, optimizer, scaler and scheduler, in place."""
        state = snap.load()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        # Drop snapshots newer than the one restored: they hold the state being abandoned.
        while self.ring and self.ring[-1].step > snap.step:
            dropped = self.ring.pop()
            if dropped.path is not None:
                dropped.path.unlink(missing_ok=True)


def _atomic_save(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: a crash never leaves half a file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class Cooldown:
    """A temporary LR multiplier applied around each optimizer step, so it composes with any scheduler.

    The factor is applied in the optimizer's pre-step hook and the user's value put back in the
    post-step hook: the optimizer updates with ``lr × factor`` while the scheduler (chainable or not)
    only ever sees and sets its own values, which are therefore exactly the user's after the cool-down.
    """

    factor: float
    until_step: int
    saved: list[Any] = field(default_factory=list)

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        self.saved = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self.saved):
            group["lr"] = lr * self.factor

    def undo(self, optimizer: torch.optim.Optimizer) -> None:
        for group, lr in zip(optimizer.param_groups, self.saved):
            group["lr"] = lr
        self.saved = []


class RollbackBudget:
    """At most ``max_rollbacks`` within ``window`` steps: a run that spikes forever must stop looping."""

    def __init__(self, max_rollbacks: int, window: int) -> None:
        self.max_rollbacks, self.window = max_rollbacks, window
        self.history: deque[int] = deque()

    def allows(self, step: int) -> bool:
        while self.history and step - self.history[0] > self.window:
            self.history.popleft()
        return len(self.history) < self.max_rollbacks

    def spend(self, step: int) -> None:
        self.history.append(step)
