"""Works where real training runs: torch.compile, mixed precision, odd models, long runs, interrupts."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wbdebug
from wbdebug import EventKind, keys
from models import mlp, train
from test_watch import our_hooks

QUIET = dict(wandb=False, console=False)


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss()


def loop(model, opt, crit, steps, *, call=None, nan_at=None):
    call = call or model
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        if step == nan_at:
            x[0, 0] = float("nan")
        opt.zero_grad()
        crit(call(x), y).backward()
        opt.step()


@pytest.mark.parametrize("order", ["watch_then_compile", "compile_then_watch"])
def test_torch_compile_keeps_loss_gradients_and_nan_detection(order):
    model, opt, crit = tiny()
    memory = wbdebug.MemorySink()
    if order == "compile_then_watch":
        compiled = torch.compile(model, backend="aot_eager")
        monitor = wbdebug.watch(compiled, opt, crit, log_every=5, sinks=[memory], **QUIET)
    else:
        monitor = wbdebug.watch(model, opt, crit, log_every=5, sinks=[memory], **QUIET)
        compiled = torch.compile(model, backend="aot_eager")
    with monitor:
        loop(model, opt, crit, 30, call=compiled, nan_at=22)
    row = memory.rows[1][1]
    assert {keys.LOSS, keys.GRAD_NORM_TOTAL, keys.grad_norm("0"), keys.grad_norm("2")} <= set(row)
    notes = [e for e in monitor.events if e.severity == "info" and "compile" in e.message]
    assert len(notes) == 1  # said once, not every step
    assert next(e for e in monitor.events if e.kind == EventKind.NONFINITE_LOSS).step == 22
    assert our_hooks(model, opt, crit) == 0


class InfGrad(torch.autograd.Function):
    """Identity forward, inf backward: what an fp16 gradient overflow looks like to GradScaler."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def amp_loop(model, opt, crit, scaler, steps, overflow=lambda step: False):
    gen = torch.Generator().manual_seed(0)
    norms = []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        if overflow(step):
            out = InfGrad.apply(out)
        scaler.scale(crit(out.float(), y)).backward()
        scaler.unscale_(opt)
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        scaler.step(opt)
        scaler.update()
    return norms


def test_amp_norms_are_unscaled_and_skipped_steps_are_overflow_not_nan():
    model, opt, crit = tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    memory = wbdebug.MemorySink()
    with wbdebug.watch(model, opt, crit, scaler=scaler, log_every=1, sinks=[memory], **QUIET) as monitor:
        norms = amp_loop(model, opt, crit, scaler, 20, overflow=lambda s: s in (3, 11))
    assert monitor.step == 18  # two skipped optimizer steps
    # the norm of step 0 is the unscaled gradient (the scale is 4096)
    assert memory.series(keys.GRAD_NORM_TOTAL)[0] == pytest.approx(norms[0], rel=1e-4)
    kinds = [(e.kind, e.severity) for e in monitor.events]
    assert (EventKind.AMP_OVERFLOW, "info") in kinds
    assert all(k not in (EventKind.NONFINITE_GRAD, EventKind.EXPLODING_GRADIENTS) for k, _ in kinds)
    assert monitor.amp_overflows == 2


def test_amp_persistent_overflow_is_a_warning():
    model, opt, crit = tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with wbdebug.watch(model, opt, crit, scaler=scaler, **QUIET) as monitor:
        amp_loop(model, opt, crit, scaler, 60, overflow=lambda s: s % 5 != 0)
    warning = next(e for e in monitor.events if e.kind == EventKind.AMP_OVERFLOW and e.severity == "warning")
    assert warning.value < 1.0


def test_monitor_memory_stays_flat_over_5000_steps():
    model, opt, crit = tiny()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with wbdebug.watch(model, opt, crit, log_every=10, sinks=[wbdebug.MemorySink(max_rows=50)], **QUIET):
        def steps(n):
            for _ in range(n):
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()

        steps(500)
        tracemalloc.start()
        steps(100)
        first, _ = tracemalloc.get_traced_memory()
        steps(4400)
        last, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert last - first < 200_000, f"monitor memory grew by {last - first} bytes over 4400 steps"


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.embed.weight  # tied weights
        nn.init.normal_(self.embed.weight, std=0.1)  # GPT-style small init: N(0, 1) would mis-scale the tied head

    def forward(self, tokens):
        return self.head(F.relu(self.embed(tokens))).flatten(0, 1)


def test_tied_weights_and_integer_inputs():
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    crit = nn.CrossEntropyLoss()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(model, opt, crit, log_every=1, sinks=[memory], **QUIET) as monitor:
        for _ in range(5):
            tokens = torch.randint(0, 20, (4, 6))
            opt.zero_grad()
            crit(model(tokens), tokens.roll(-1, dims=1).flatten()).backward()  # next-token targets
            opt.step()
    row = memory.rows[-1][1]
    assert row[keys.grad_norm("embed")] == pytest.approx(model.embed.weight.grad.norm().item(), rel=1e-5)
    assert keys.grad_norm("head") not in row  # the shared weight is counted once, under its first owner
    assert [e for e in monitor.events if e.severity != "info"] == []


def test_frozen_then_unfrozen_layers_and_tuple_outputs():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 2)

        def forward(self, x):
            h = F.relu(self.body(x))
            return self.a(h), {"aux": self.b(h)}

    torch.manual_seed(0)
    model = TwoHeads()
    for p in model.body.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    crit = nn.CrossEntropyLoss()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(model, opt, crit, log_every=1, sinks=[memory], **QUIET) as monitor:
        for step in range(10):
            if step == 5:
                for p in model.body.parameters():
                    p.requires_grad_(True)
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            opt.zero_grad()
            out, extra = model(x)
            (crit(out, y) + extra["aux"].pow(2).mean()).backward()
            opt.step()
    assert keys.grad_norm("body") not in memory.rows[4][1]
    assert memory.rows[5][1][keys.grad_norm("body")] > 0
    assert [e for e in monitor.events if e.severity != "info"] == []


def test_data_parallel_wrapper_and_empty_batches():
    model, opt, crit = tiny()
    memory = wbdebug.MemorySink()
    with wbdebug.watch(nn.DataParallel(model), opt, crit, log_every=1, sinks=[memory], **QUIET) as monitor:
        loop(model, opt, crit, 3, call=nn.DataParallel(model))
        with torch.no_grad():
            model(torch.empty(0, 16))  # an empty evaluation batch passes through the hooks
    assert keys.grad_norm("0") in memory.rows[-1][1]  # no "module." prefix
    assert monitor.step == 3


def test_keyboard_interrupt_mid_step_still_closes_and_keeps_events(tmp_path):
    setup = mlp()
    journal = tmp_path / "events.jsonl"
    with pytest.raises(KeyboardInterrupt):
        with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, journal_path=journal,
                           **QUIET) as monitor:
            train(setup, 7, corrupt=lambda s, x, y: (x * float("nan"), y) if s == 2 else (x, y))
            x, y = setup.batch(0)
            setup.criterion(setup.model(x), y).backward()
            raise KeyboardInterrupt  # Ctrl-C between backward and step
    assert monitor.closed and our_hooks(setup.model, setup.optimizer, setup.criterion) == 0
    assert [e.kind for e in wbdebug.read_journal(journal)][:1] == [EventKind.NONFINITE_LOSS]
