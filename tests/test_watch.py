"""The one-line contract: hooks owned and removed, steps counted, losses found, bad input refused."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wbdebug
from wbdebug import EventKind, keys
from models import mlp, train

QUIET = dict(wandb=False, console=False)


def our_hooks(model, optimizer=None, criterion=None) -> int:
    count = 0
    for module in [*model.modules(), *([criterion] if criterion is not None else [])]:
        count += len(module._forward_hooks) + len(module._forward_pre_hooks) + len(module._backward_hooks)
        count += len(module._backward_pre_hooks)
    for p in model.parameters():
        count += len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {})
    if optimizer is not None:
        count += len(optimizer._optimizer_step_post_hooks) + len(optimizer._optimizer_step_pre_hooks)
    return count


def test_close_removes_every_hook_and_is_idempotent():
    setup = mlp()
    before = our_hooks(setup.model, setup.optimizer, setup.criterion)
    monitor = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET)
    assert our_hooks(setup.model, setup.optimizer, setup.criterion) > before
    train(setup, 10)  # step 10 is sampled: its activation hooks are attached now too
    monitor.close()
    monitor.close()
    assert our_hooks(setup.model, setup.optimizer, setup.criterion) == before == 0
    assert monitor.closed


def test_context_manager_closes_when_the_users_loop_raises():
    setup = mlp()
    with pytest.raises(KeyError):
        with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET) as monitor:
            train(setup, 3)
            raise KeyError("user bug")
    assert monitor.closed and our_hooks(setup.model, setup.optimizer, setup.criterion) == 0


def test_watching_the_same_model_twice_does_not_double_count():
    setup = mlp()
    memory = wbdebug.MemorySink()
    first = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **QUIET)
    with pytest.warns(UserWarning, match="already watched"):
        second = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1, sinks=[memory], **QUIET)
    assert first.closed
    train(setup, 12)
    second.close()
    assert second.step == 12 and first.step == 0
    assert memory.steps() == list(range(12))
    assert our_hooks(setup.model, setup.optimizer, setup.criterion) == 0


def test_step_counting_follows_optimizer_steps_under_gradient_accumulation():
    setup = mlp()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1, sinks=[memory], **QUIET) as monitor:
        for step in range(6):
            setup.optimizer.zero_grad()
            for micro in range(4):
                x, y = setup.batch(step * 4 + micro)
                (setup.criterion(setup.model(x), y) / 4).backward()
            expected = torch.stack([p.grad.norm() for p in setup.model.parameters()]).norm().item()
            setup.optimizer.step()
            assert monitor.step == step + 1
    # the norm reported for the step is the accumulated gradient's, once per optimizer step
    assert memory.series(keys.GRAD_NORM_TOTAL)[5] == pytest.approx(expected, rel=1e-5)
    assert memory.steps() == list(range(6))


def test_gradient_norms_match_plain_autograd_and_are_taken_before_clipping():
    setup = mlp()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1, sinks=[memory], **QUIET):
        x, y = setup.batch(0)
        setup.optimizer.zero_grad()
        setup.criterion(setup.model(x), y).backward()
        reference = {name: torch.cat([p.grad.flatten() for p in m.parameters()]).norm().item()
                     for name, m in setup.model.named_children() if list(m.parameters())}
        total = torch.cat([p.grad.flatten() for p in setup.model.parameters()]).norm().item()
        torch.nn.utils.clip_grad_norm_(setup.model.parameters(), total / 100)
        setup.optimizer.step()
    (step, row), = memory.rows
    assert row[keys.GRAD_NORM_TOTAL] == pytest.approx(total, rel=1e-5)
    for name, norm in reference.items():
        assert row[keys.grad_norm(name)] == pytest.approx(norm, rel=1e-5)


def test_every_steps_gradient_norms_match_plain_autograd_across_read_back_intervals():
    """Each step's row is its own gradients' (accumulated over micro-batches), whichever interval it falls in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    memory = wbdebug.MemorySink()
    expected = []
    with wbdebug.watch(model, optimizer, criterion, check_every=3, log_every=1, sinks=[memory], **QUIET) as monitor:
        for step in range(7):  # rows of several read-back intervals, the last one flushed at close()
            optimizer.zero_grad()
            for micro in range(3):
                x, y = torch.randn(16, 512), torch.randint(0, 4, (16,))
                (criterion(model(x), y) / 3).backward()
            per_layer = {keys.grad_norm(name): torch.cat([p.grad.flatten() for p in m.parameters()]).norm().item()
                         for name, m in model.named_children() if list(m.parameters())}
            total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
            expected.append({keys.GRAD_NORM_TOTAL: total, **per_layer})
            optimizer.step()
    assert monitor.step == 7 and memory.steps() == list(range(7))
    for (step, row), want in zip(memory.rows, expected):
        assert {k: row[k] for k in want} == pytest.approx(want, rel=1e-5), step
    assert our_hooks(model, optimizer, criterion) == 0


def test_activation_statistics_match_a_brute_force_count():
    setup = mlp()
    memory = wbdebug.MemorySink()
    captured = {}
    setup.model[1].register_forward_hook(lambda m, i, o: captured.setdefault("relu", o.detach().clone()))
    with torch.no_grad():
        setup.model[0].bias[:20] = -50.0  # 20 of 64 units dead
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1, sinks=[memory], **QUIET):
        train(setup, 1)
    out = captured["relu"]
    row = memory.rows[0][1]
    assert row[keys.act_zero_frac("1")] == pytest.approx((out == 0).float().mean().item())
    assert row[keys.dead_unit_frac("1")] == pytest.approx(((out != 0).sum(0) == 0).float().mean().item())
    assert row[keys.dead_unit_frac("1")] >= 20 / 64
    assert keys.act_zero_frac("0") not in row  # the raw input is data, not an activation


def test_without_an_optimizer_each_backward_is_a_step_and_observe_loss_feeds_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    memory = wbdebug.MemorySink()
    with wbdebug.watch(model, log_every=1, sinks=[memory], **QUIET) as monitor:
        for _ in range(3):
            x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
            loss = F.cross_entropy(model(x), y)  # functional loss: no criterion module to hook
            monitor.observe_loss(loss)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    assert monitor.step == 3
    assert memory.series(keys.LOSS)[2] == pytest.approx(loss.item())


class HFStyle(nn.Module):
    """Returns a dict with ``loss`` and ``logits``, as Hugging Face models do when given labels."""

    def __init__(self, classes: int = 7) -> None:
        super().__init__()
        self.body = nn.Linear(5, classes)

    def forward(self, x, labels=None):
        logits = self.body(x) * 40  # mis-scaled head
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def test_loss_from_a_hugging_face_style_output():
    torch.manual_seed(0)
    model = HFStyle()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    memory = wbdebug.MemorySink()
    with wbdebug.watch(model, opt, log_every=1, sinks=[memory], **QUIET) as monitor:
        out = model(torch.randn(8, 5), labels=torch.randint(0, 7, (8,)))
        out["loss"].backward()
        opt.step()
    assert memory.series(keys.LOSS)[0] == pytest.approx(out["loss"].item())
    event = next(e for e in monitor.events if e.kind == EventKind.INITIAL_LOSS)
    assert event.threshold == pytest.approx(torch.log(torch.tensor(7.0)).item())


def test_evaluation_under_no_grad_is_not_counted():
    setup = mlp()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1, sinks=[memory], **QUIET) as m:
        losses = train(setup, 2)
        with torch.no_grad():
            x, y = setup.batch(99)
            setup.criterion(setup.model(x * 1000), y)
    assert m.step == 2
    assert memory.series(keys.LOSS)[1] == pytest.approx(losses[1], rel=1e-5)


class ExplodingSink:
    def __init__(self):
        self.events = []

    def log(self, step, metrics):
        raise OSError("disk full")

    def emit(self, event):
        self.events.append(event)

    def close(self, events):
        pass


def test_a_failing_sink_is_reported_once_and_training_goes_on():
    setup = mlp()
    sink, memory = ExplodingSink(), wbdebug.MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1,
                           sinks=[sink, memory], **QUIET) as monitor:
            losses = train(setup, 30)
    assert len(losses) == 30 and monitor.step == 30
    errors = [e for e in monitor.events if e.kind == EventKind.MONITOR_ERROR]
    assert len(errors) == 1 and "disk full" in errors[0].message
    assert len([w for w in caught if "disk full" in str(w.message)]) == 1
    assert memory.steps() == list(range(30))  # the other sinks still got every row


def test_strict_mode_raises_internal_errors():
    setup = mlp()
    with pytest.raises(OSError, match="disk full"):
        with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, log_every=1, strict=True,
                           sinks=[ExplodingSink()], **QUIET):
            train(setup, 2)


@pytest.mark.parametrize("call,error,match", [
    (lambda s: wbdebug.watch("model", **QUIET), TypeError, "torch.nn.Module"),
    (lambda s: wbdebug.watch(nn.ReLU(), **QUIET), ValueError, "no parameters"),
    (lambda s: wbdebug.watch(s.model, "adam", **QUIET), TypeError, "torch.optim.Optimizer"),
    (lambda s: wbdebug.watch(s.model, torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1), **QUIET),
     ValueError, "none of the model's parameters"),
    (lambda s: wbdebug.watch(s.model, s.optimizer, F.cross_entropy, **QUIET), TypeError, "observe_loss"),
    (lambda s: wbdebug.watch(s.model, check_every=-1, **QUIET), ValueError, "check_every"),
    (lambda s: wbdebug.watch(s.model, log_every=0, **QUIET), ValueError, "log_every"),
    (lambda s: wbdebug.watch(s.model, num_classes=1, **QUIET), ValueError, "at least 2"),
    (lambda s: wbdebug.watch(s.model, log_evry=5, **QUIET), TypeError, "log_evry"),
    (lambda s: wbdebug.watch(s.model, run="my-run", **QUIET), TypeError, "wandb Run"),
])
def test_bad_arguments_get_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(mlp())


def test_observe_loss_rejects_non_numbers():
    setup = mlp()
    with wbdebug.watch(setup.model, **QUIET) as monitor:
        with pytest.raises(TypeError, match="loss tensor or a number"):
            monitor.observe_loss("0.5")


def test_settings_come_from_kwargs_then_env_then_dotenv(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("WBDEBUG_LOG_EVERY=7\nWBDEBUG_CHECK_EVERY=3\nWBDEBUG_DEAD_FRACTION=0.8\n")
    monkeypatch.setenv("WBDEBUG_CHECK_EVERY", "5")
    config = wbdebug.Config(dead_fraction=0.95)
    assert (config.log_every, config.check_every, config.dead_fraction) == (7, 5, 0.95)
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, config=config, log_every=2, **QUIET) as m:
        assert (m.config.log_every, m.config.check_every, m.config.dead_fraction) == (2, 5, 0.95)
