"""On CUDA, ordinary steps never synchronise the host with the device (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import wbdebug

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_ordinary_steps_do_not_sync():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    crit = nn.CrossEntropyLoss()
    x = torch.randn(128, 64, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")
    memory = wbdebug.MemorySink()
    check_every = 10
    with wbdebug.watch(model, opt, crit, wandb=False, console=False, check_every=check_every,
                       activation_every=1000, log_every=1000, sinks=[memory]) as monitor:
        for _ in range(check_every + 1):  # warm-up: caches, the first read-back, pinned buffers
            opt.zero_grad(); crit(model(x), y).backward(); opt.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(check_every - 2):  # ordinary steps only: no read-back, no activation sample
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert monitor.step == 2 * check_every - 1
    assert [e for e in monitor.events if e.severity != "info"] == []
