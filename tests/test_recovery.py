"""Spike and NaN recovery: roll back to a snapshot, skip the bad batches, cool the LR down, give up in time."""

from __future__ import annotations

import copy

import pytest
import torch

import wbdebug
from wbdebug import EventKind
from wbdebug.recovery import Snapshotter
from models import mlp, train

QUIET = dict(wandb=False, console=False)


def corrupt_at(*steps):
    def corrupt(step, x, y):
        if step in steps:
            return x * 30, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(step))]
        return x, y
    return corrupt


def nan_at(step_):
    return lambda step, x, y: (x * float("nan"), y) if step == step_ else (x, y)


def final(losses, n=30):
    return sum(losses[-n:]) / n


def test_rollback_after_a_corrupted_batch_ends_close_to_the_clean_run():
    clean = mlp()
    with wbdebug.watch(clean.model, clean.optimizer, clean.criterion, **QUIET):
        clean_losses = train(clean, 300)

    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, on_spike="rollback", **QUIET) as monitor:
        losses = train(setup, 300, corrupt=corrupt_at(200))
    rollback = next(e for e in monitor.events if e.kind == EventKind.ROLLBACK)
    assert rollback.data["event_step"] == 200 and rollback.data["restored_step"] == 200
    assert monitor.skipped_steps == list(range(200, rollback.step))
    assert abs(final(losses) - final(clean_losses)) < 0.5 * final(clean_losses) + 0.02


def test_nan_run_recovers_and_finishes_with_a_finite_loss():
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, on_nonfinite="rollback", **QUIET) as monitor:
        losses = train(setup, 250, corrupt=nan_at(150))
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())
    assert torch.isfinite(torch.tensor(losses[-50:])).all()
    rollback = next(e for e in monitor.events if e.kind == EventKind.ROLLBACK)
    assert rollback.data["restored_step"] == 100 and rollback.severity == "warning"
    assert any(e.kind == EventKind.NONFINITE_LOSS and e.cleared for e in monitor.events)


def test_restored_optimizer_state_equals_the_snapshot_exactly():
    setup = mlp()
    train(setup, 5)
    snaps = Snapshotter(setup.model, setup.optimizer, keep=2)
    snap = snaps.take(5)
    reference = {k: v.clone() for k, v in setup.model.state_dict().items()}
    ref_opt = copy.deepcopy(setup.optimizer.state_dict())  # state_dict() aliases the live tensors
    train(setup, 5, start=5)
    snaps.restore(snap)
    for k, v in setup.model.state_dict().items():
        assert torch.equal(v, reference[k])
    now = setup.optimizer.state_dict()
    for pid, state in ref_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(now["state"][pid][key]), torch.as_tensor(value)), key
    assert now["param_groups"] == ref_opt["param_groups"]


def test_snapshots_on_disk_are_a_bounded_ring_without_partial_files(tmp_path):
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, on_spike="rollback", snapshot_every=10,
                       snapshot_keep=2, snapshot_dir=tmp_path, **QUIET) as monitor:
        train(setup, 45)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["wbdebug-snapshot-000000030.pt", "wbdebug-snapshot-000000040.pt"]
    state = monitor.snapshots.ring[-1].load()
    assert set(state) == {"model", "optimizer"}


def test_lr_cooldown_composes_with_the_users_scheduler_and_ends():
    setup = mlp()
    scheduler = torch.optim.lr_scheduler.StepLR(setup.optimizer, step_size=40, gamma=0.5)
    used = []
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, scheduler=scheduler, on_spike="rollback",
                       cooldown_factor=0.1, cooldown_steps=20, **QUIET) as monitor:
        setup.optimizer.register_step_pre_hook(
            lambda opt, a, k: used.append((opt.param_groups[0]["lr"], scheduler.get_last_lr()[0]))
        )
        for step in range(160):
            train(setup, 1, start=step, corrupt=corrupt_at(120))
            scheduler.step()
    rollback = next(e for e in monitor.events if e.kind == EventKind.ROLLBACK)
    start, end = rollback.step, rollback.data["cooldown_until"]
    for step, (lr, scheduled) in enumerate(used):
        expected = scheduled * 0.1 if start <= step < end else scheduled
        assert lr == pytest.approx(expected), step
    assert setup.optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]


def test_a_run_that_spikes_forever_stops_rolling_back():
    setup = mlp()
    spikes = tuple(range(60, 400, 25))
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, on_spike="rollback", snapshot_every=10,
                       max_rollbacks=2, clear_steps=3, **QUIET) as monitor:
        train(setup, 400, corrupt=corrupt_at(*spikes))
    rollbacks = [e for e in monitor.events if e.kind == EventKind.ROLLBACK]
    assert [e.severity for e in rollbacks][:2] == ["warning", "warning"]
    assert rollbacks[2].severity == "error" and "Gave up" in rollbacks[2].message
