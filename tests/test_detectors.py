"""Each detector fires on the bug it exists for, within a few steps of onset, and names where."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wbdebug
from wbdebug import EventKind
from wbdebug.detectors.base import jump_threshold
from wbdebug.detectors.gradients import vanishing_layers
from wbdebug.detectors.loss import initial_loss_expected, initial_loss_severity
from models import Setup, digits, mlp, train

QUIET = dict(wandb=False, console=False)


def kinds(monitor, severity=("warning", "error")):
    return [e.kind for e in monitor.events if e.severity in severity]


def first(monitor, kind):
    return next(e for e in monitor.events if e.kind == kind and not e.cleared)


# --- numeric helpers: hand-computed tables -----------------------------------------------------

@pytest.mark.parametrize("family,classes,expected", [
    ("cross_entropy", 10, 2.302585), ("cross_entropy", 1000, 6.907755),
    ("binary_cross_entropy", None, 0.693147), ("cross_entropy", None, None), (None, 10, None),
])
def test_initial_loss_expected(family, classes, expected):
    got = initial_loss_expected(family, classes)
    assert got == pytest.approx(expected, rel=1e-6) if expected else got is None


@pytest.mark.parametrize("measured,severity", [
    (2.30, None), (2.65, None), (3.5, "warning"), (45.0, "error"), (23.0, "error"), (0.01, "warning"),
])
def test_initial_loss_severity_follows_the_seed(measured, severity):
    # The seed: for 10 classes 2.302 is right, 45.0 or 0.01 is a bug; 15 % above is a normal init.
    assert initial_loss_severity(measured, math.log(10), 1.5, 3.0) == severity


def test_jump_threshold_widens_for_heavy_tailed_history():
    steady = [1.0, 1.01, 0.99, 1.02, 0.98] * 10
    noisy = [1.0, 1.0, 1.0, 3.0, 0.5] * 10
    assert jump_threshold(steady, 2.0, 3.0) == pytest.approx(2.0)
    assert jump_threshold(noisy, 2.0, 3.0) > 20.0
    assert jump_threshold([-1.0, -1.1, -0.9] * 5, 2.0, 3.0) > -1.0  # negative losses: linear fallback


def test_vanishing_layers_table():
    norms = {"a": 1e-9, "b": 0.5, "c": 1.0, "d": 0.0}
    assert vanishing_layers(norms, 1e-5, 1e-12) == ["a", "d"]
    assert vanishing_layers({}, 1e-5, 1e-12) == []


# --- bug cases: real training runs ----------------------------------------------------------------

def test_nonfinite_loss_from_a_corrupt_sample_names_the_input():
    setup = mlp()

    def corrupt(step, x, y):
        if step == 40:  # a sampled step (activation_every=10): the input itself is reported
            x = x.clone()
            x[3, 7] = float("nan")
        return x, y

    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 60, corrupt=corrupt)
    event = first(monitor, EventKind.NONFINITE_LOSS)
    assert event.step == 40 and event.severity == "error"
    assert event.layer == "(input)" and "input batch" in event.message
    grad = first(monitor, EventKind.NONFINITE_GRAD)
    assert grad.step == 40 and grad.layer == "0"  # first layer in parameter order
    # once the weights are NaN the condition persists: reported once, not every step
    assert kinds(monitor).count(EventKind.NONFINITE_LOSS) == 1


def test_nonfinite_loss_on_an_unsampled_step_is_reported_at_that_step():
    setup = mlp()
    nan_at = 13

    def corrupt(step, x, y):
        return (x * float("inf"), y) if step == nan_at else (x, y)

    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 20, corrupt=corrupt)
    assert first(monitor, EventKind.NONFINITE_LOSS).step == nan_at


class SqrtNet(nn.Module):
    """The torch.where trap: sqrt of negatives is masked in forward (finite loss) but its NaN gradient is not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h)))


def test_nonfinite_gradient_with_finite_loss_names_the_layer():
    torch.manual_seed(0)
    model = SqrtNet()
    setup = Setup(model, torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss(), digits())
    with wbdebug.watch(model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 5)
    event = first(monitor, EventKind.NONFINITE_GRAD)
    assert event.step == 0 and event.layer == "fc1"  # fc2's own gradient is finite


def test_exploding_gradients_when_the_learning_rate_jumps():
    setup = mlp()
    setup.optimizer = torch.optim.SGD(setup.model.parameters(), 0.05, momentum=0.9)
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 100)
        assert kinds(monitor) == []
        for group in setup.optimizer.param_groups:
            group["lr"] = 20.0  # a schedule bug
        train(setup, 30, start=100)
    event = first(monitor, EventKind.EXPLODING_GRADIENTS)
    assert 100 <= event.step <= 105
    assert "lower" in event.fix and "clip" in event.fix


def test_exploding_gradients_above_the_absolute_limit():
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, exploding_norm=1e3, **QUIET) as monitor:
        train(setup, 5, corrupt=lambda step, x, y: (x * 1e4, y))
    event = first(monitor, EventKind.EXPLODING_GRADIENTS)
    assert event.severity == "error" and event.step == 0 and event.threshold == 1e3


def test_vanishing_gradients_in_a_deep_sigmoid_net():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 32), nn.Sigmoid()]
    for _ in range(14):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(32, 10))
    setup = Setup(model, torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss(), digits())
    with wbdebug.watch(model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 20)
    event = first(monitor, EventKind.VANISHING_GRADIENTS)
    assert event.layer == "0"  # the earliest layer, where the seed says gradients vanish first
    assert event.step == 4  # sustained for vanishing_steps=5 steps
    assert "residual" in event.fix


@pytest.mark.parametrize("functional", [False, True], ids=["nn.ReLU", "F.relu"])
def test_dead_activations_from_negative_biases(functional):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)
            self.act = nn.ReLU()

        def forward(self, x):
            relu = F.relu if functional else self.act
            return self.out(relu(self.fc2(relu(self.fc1(x)))))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc2.bias.fill_(-20.0)
    setup = Setup(model, torch.optim.Adam(model.parameters(), 1e-3), nn.CrossEntropyLoss(), digits())
    with wbdebug.watch(model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 40)
    dead = [e for e in monitor.events if e.kind == EventKind.DEAD_ACTIVATIONS and not e.cleared]
    # with nn.ReLU the module is shared, so its first use (healthy) is what is measured; the input of
    # `out` (the dead layer's output) is measured either way
    assert [e.layer for e in dead] == ["out"]
    assert dead[0].step == 20 and dead[0].value == pytest.approx(1.0)  # third sample: steps 0, 10, 20
    assert "LeakyReLU" in dead[0].fix


def test_loss_spike_from_a_corrupted_batch_then_clears():
    setup = mlp()
    spike_at = 150

    def corrupt(step, x, y):
        if step == spike_at:
            return x * 30, y[torch.randperm(len(y))]
        return x, y

    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 200, corrupt=corrupt)
    spikes = [e for e in monitor.events if e.kind == EventKind.LOSS_SPIKE]
    assert spikes[0].step == spike_at and spikes[0].severity == "warning"
    assert spikes[0].value > spikes[0].threshold
    assert spikes[1].cleared and spikes[1].step > spike_at
    assert len(spikes) == 2


def test_loss_spike_ignores_the_fast_drop_of_early_training():
    setup = mlp()
    setup.optimizer = torch.optim.Adam(setup.model.parameters(), 1e-2)
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, warmup_steps=5, **QUIET) as monitor:
        losses = train(setup, 60)
    assert losses[10] < losses[0] / 2
    assert EventKind.LOSS_SPIKE not in kinds(monitor)


@pytest.mark.parametrize("scale,severity", [(1.0, None), (20.0, "warning"), (60.0, "error")])
def test_initial_loss_against_log_c(scale, severity):
    setup = mlp()
    with torch.no_grad():
        setup.model[4].weight.mul_(scale)
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        losses = train(setup, 3)
    events = [e for e in monitor.events if e.kind == EventKind.INITIAL_LOSS]
    if severity is None:
        assert events == []
    else:
        (event,) = events
        assert event.severity == severity and event.step == 0
        assert event.threshold == pytest.approx(math.log(10))
        assert event.value == pytest.approx(losses[0], rel=1e-5)


def test_initial_loss_for_binary_cross_entropy_uses_log_2():
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    with torch.no_grad():
        model.weight.mul_(100)
    x, y = torch.randn(64, 10), torch.randint(0, 2, (64, 1)).float()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    crit = nn.BCEWithLogitsLoss()
    with wbdebug.watch(model, opt, crit, **QUIET) as monitor:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    event = first(monitor, EventKind.INITIAL_LOSS)
    assert event.threshold == pytest.approx(math.log(2)) and event.severity == "error"


def test_initial_loss_uses_num_classes_when_given():
    setup = mlp()
    # 10 logits, but the user says 1000 classes: the first loss (≈2.3) is far *below* log(10000)
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, num_classes=10000, **QUIET) as monitor:
        train(setup, 2)
    event = first(monitor, EventKind.INITIAL_LOSS)
    assert event.threshold == pytest.approx(math.log(10000))


def test_events_carry_what_where_when_why_and_fix():
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
        train(setup, 3, corrupt=lambda s, x, y: (x * float("nan"), y) if s == 1 else (x, y))
    for event in monitor.events:
        assert isinstance(event, wbdebug.Event)
        assert event.message and event.fix and event.step >= 0
        assert event.severity in ("info", "warning", "error")
