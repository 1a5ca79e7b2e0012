"""NaN forensics: the event names where the first non-finite value was made (replay mode) or seen (sampled)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import wbdebug
from wbdebug import EventKind
from models import digits

QUIET = dict(wandb=False, console=False)


class Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x, poison=False):
        h = self.fc(x)
        return torch.log(h - 1e3) if poison else h  # log of a negative number


class Net(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.inp = nn.Linear(64, 32)
        self.block = Child()
        self.out = nn.Linear(32, 10)
        self.poison = False

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = self.block(h, poison=self.poison and self.where == "child")
        if self.poison and self.where == "root":
            h = torch.log(h - 1e3)  # in the root's own forward
        return self.out(h)


class MaskedMSE(nn.Module):
    """A loss that divides by the number of valid targets: zero valid targets = division by zero."""

    def forward(self, pred, target):
        mask = target >= 0
        return ((pred.argmax(1) * 0 + pred[:, 0] - target.float()) ** 2 * mask).sum() / mask.sum()


def run(where, criterion=None, poison_at=7, steps=12, lr=1e-2, **settings):
    torch.manual_seed(0)
    model = Net(where)
    opt = torch.optim.SGD(model.parameters(), lr)
    criterion = criterion or nn.CrossEntropyLoss()
    batch = digits()
    with wbdebug.watch(model, opt, criterion, nan_forensics="replay", **QUIET, **settings) as monitor:
        for step in range(steps):
            x, y = batch(step)
            model.poison = step == poison_at and where in ("child", "root")
            if where == "loss" and step == poison_at:
                y = torch.full_like(y, -1)  # no valid target in this batch
            opt.zero_grad()
            criterion(model(x), y).backward()
            opt.step()
    return monitor


def nan_event(monitor):
    return next(e for e in monitor.events if e.kind == EventKind.NONFINITE_LOSS)


def test_nan_from_log_in_a_child_module_names_the_child_and_the_line():
    event = nan_event(run("child"))
    assert event.step == 7 and event.layer == "block"
    assert "created by log in forward" in event.message and "inside block's own forward" in event.message
    assert "test_forensics.py" in event.message and "torch.log(h - 1e3)" in event.message


def test_nan_created_in_the_roots_own_forward():
    event = nan_event(run("root"))
    assert event.layer == "(root)" and "inside (root)'s own forward" in event.message
    assert "first non-finite module output: out" in event.message


def test_nan_from_a_division_by_zero_in_the_loss():
    event = nan_event(run("loss", criterion=MaskedMSE()))
    assert event.layer == "(loss)" and "div" in event.message and "mask.sum()" in event.message


def test_nan_from_an_exploding_learning_rate_names_a_layer_and_an_op():
    monitor = run("none", lr=1e4, steps=40, poison_at=-1)
    event = next(e for e in monitor.events if e.kind in (EventKind.NONFINITE_LOSS, EventKind.NONFINITE_GRAD))
    assert event.layer is not None and "replay:" in event.message
    assert "created by" in event.message and "did not reproduce" not in event.message


def test_nan_from_the_torch_where_trap_is_a_gradient_event_with_its_origin():
    class Trap(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(64, 32), nn.Linear(32, 10)

        def forward(self, x):
            h = self.fc(x)
            return self.out(torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h)))

    torch.manual_seed(0)
    model = Trap()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    crit = nn.CrossEntropyLoss()
    x, y = digits()(0)
    with wbdebug.watch(model, opt, crit, nan_forensics="replay", **QUIET) as monitor:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    event = next(e for e in monitor.events if e.kind == EventKind.NONFINITE_GRAD)
    assert event.layer == "fc" and "sqrt" in event.message


def test_replay_leaves_the_live_model_and_optimizer_untouched():
    monitor = run("child")
    assert monitor.step == 12
    assert not any(e.kind == EventKind.MONITOR_ERROR for e in monitor.events)


def test_sampled_mode_names_the_input_when_the_batch_is_corrupt():
    torch.manual_seed(0)
    model = Net("none")
    opt = torch.optim.SGD(model.parameters(), 0.01)
    crit = nn.CrossEntropyLoss()
    x, y = digits()(0)
    with wbdebug.watch(model, opt, crit, **QUIET) as monitor:  # default: no replay, no per-step flag
        opt.zero_grad()
        crit(model(x * float("nan")), y).backward()
        opt.step()
    assert nan_event(monitor).layer == "(input)"
