"""On CUDA, ordinary steps never synchronise the host with the device (skipped without a GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import wbdebug

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def no_sync(enabled: bool = True):
    """Any host-device synchronisation inside raises (torch.cuda.set_sync_debug_mode)."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("activation_every", [1000, 1], ids=["plain-steps", "activation-sampled-steps"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_ordinary_steps_do_not_sync(activation_every, amp):
    """No step between two read-backs syncs: not a plain one, not an activation-sampled one, not under AMP."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
        nn.Linear(16 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    ).cuda()
    opt, crit = torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss()
    x, y = torch.randn(64, 3, 8, 8, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    check_every = 10

    def step(checked: bool) -> None:
        opt.zero_grad()
        with no_sync(checked):
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = crit(model(x), y)
            scaler.scale(loss).backward()
        if amp:
            scaler.step(opt)  # GradScaler reads its found-inf flag: the user's own sync, left unchecked
            scaler.update()
        else:
            with no_sync(checked):
                opt.step()  # wbdebug's step clock runs in the optimizer's post-hook

    with wbdebug.watch(model, opt, crit, wandb=False, console=False, check_every=check_every, scaler=scaler,
                       activation_every=activation_every, log_every=1000) as monitor:
        for _ in range(check_every + 1):  # warm-up: caches, the first read-back, pinned buffers
            step(checked=False)
        torch.cuda.synchronize()
        for _ in range(check_every - 2):  # the steps between two read-backs
            step(checked=True)
    assert monitor.step == 2 * check_every - 1
    assert [e for e in monitor.events if e.severity != "info"] == []
