"""Quiet on healthy runs: every detector stays silent on the architectures users actually train."""

from __future__ import annotations

import pytest
import wbdebug
from wbdebug import keys
from models import HEALTHY, train


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_training_raises_no_warning(name):
    setup = HEALTHY[name]()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, wandb=False, console=False,
                       log_every=10, sinks=[memory]) as monitor:
        losses = train(setup, 300)

    assert losses[-1] < losses[0], "the healthy model must actually learn"
    problems = [e for e in monitor.events if e.severity != "info"]
    assert problems == [], problems
    assert monitor.step == 300
    # The monitor really measured: every trainable layer has a gradient norm, frozen ones none.
    last_step, last = memory.rows[-1]
    assert last_step == 299
    trainable = {name for name, module, params in _layers(setup.model) if any(p.requires_grad for p in params)}
    logged = {k.removeprefix(keys.grad_norm("")) for k in last if k.startswith(keys.grad_norm(""))}
    assert logged == trainable
    assert keys.LOSS in last and abs(last[keys.LOSS] - sum(losses[-9:]) / 9) < 1e-4


def _layers(model):
    from wbdebug.probes.gradients import parameterised_layers

    return parameterised_layers(model)
