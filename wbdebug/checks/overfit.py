"""Sanity check #1 of the seed: overfit one fixed micro-batch to near-zero loss.

A model that cannot memorise ten samples has a bug in its labels, its loss or its gradient flow, and no
amount of data or compute will fix it. Besides the loss curve, the check looks at the graph of the first
step, which names the bug directly when parameters are used but never trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import median

import torch
from torch import nn

from wbdebug.checks.batches import (
    call_model,
    compute_loss,
    criterion_name,
    model_device,
    prediction,
    preserved,
    split_batch,
    to_device,
)
from wbdebug.checks.result import CheckResult, has_error
from wbdebug.events import Event, EventKind
from wbdebug.probes.loss import loss_family_of
from wbdebug.detectors.loss import BINARY_CROSS_ENTROPY, CROSS_ENTROPY

#: The loss must fall to this fraction of an uninformed model's loss (log C, log 2, mean(y²)): 5 % of
#: log 10 = 0.115, where the right class already gets ~90 % probability on every sample — the seed's
#: "near 0.0", while a softmax-before-CrossEntropyLoss floor (log(1 + (C-1)/e) = 1.46 for C = 10) is far above.
TARGET_FRACTION = 0.05
#: Losses read back every this many steps (one host-device sync each), for early stop and progress.
READBACK_EVERY = 10
#: Passed once this many consecutive losses are at or under the target.
SETTLE_STEPS = 5
#: "Flat": the loss kept over 90 % of its first value and moved less than 10 % of it.
FLAT_RATIO = 0.9
#: "Fluctuating": the last half of the curve spans more than half its median and goes up on 20 % of steps.
FLUCTUATION_SPAN = 0.5
FLUCTUATION_UPS = 0.2

Progress = Callable[[int, "float | None"], None]


def overfit_one_batch(
    model: nn.Module,
    batch: tuple,
    criterion: Callable,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 200,
    target: float | None = None,
    progress: Progress | None = None,
) -> CheckResult:
    """Train on one fixed batch with the user's own model, criterion and optimizer; pass on near-zero loss.

    The seed's sanity check #1: ~10 samples, 100–200 steps. The target, when not given, is
    ``TARGET_FRACTION`` (5 %) of an uninformed model's loss: log C for cross-entropy/NLL, log 2 for binary
    cross-entropy, mean(y²) (predicting 0) for MSE, mean|y| for L1, otherwise 5 % of the first loss.
    Training stops early once ``SETTLE_STEPS`` losses in a row are under it. The model, optimizer,
    gradients and random number generators are restored afterwards.

    Args:
        model: the ``nn.Module`` (train mode is used; its own mode is restored).
        batch: ``(inputs, targets)``; inputs a tensor, or a tuple/dict of tensors passed as ``*args``/``**kwargs``.
        criterion: the loss, called as ``criterion(model(inputs), targets)``.
        optimizer: the optimizer built from ``model.parameters()``.
        steps: the most training steps.
        target: pass when the loss falls to this value; default derived from the loss type (above).
        progress: called after each step as ``progress(steps_done, loss_or_None)``, e.g. for a progress bar.

    Returns:
        A :class:`CheckResult`; failing ones carry ``overfit_failed`` errors saying what the curve did and why.

    Raises:
        TypeError, ValueError: bad arguments, or a model/criterion that rejects the batch.
    """
    _validate(model, criterion, optimizer, steps, target)
    inputs, targets = split_batch(batch, "batch")
    device = model_device(model)
    inputs, targets = to_device(inputs, device), targets.to(device)
    n = int(targets.shape[0])
    events: list[Event] = []
    losses: list[float] = []
    with preserved(model, optimizer):
        model.train()
        curve = torch.empty(steps, device=device)
        rule = ""
        detached = False
        target_value = target
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            pred = prediction(call_model(model, inputs))
            loss = compute_loss(criterion, pred, targets)
            if step == 0:
                first = float(loss.detach())  # sync point (once)
                reference, rule = uninformed_loss(criterion, pred, targets, first)
                if target is not None:
                    rule = "given"
                if target_value is None:
                    target_value = TARGET_FRACTION * reference
                events += output_findings(criterion, pred, first)
                if not loss.requires_grad:
                    events.append(_detached_event())
                    detached = True
                    losses = [first]
                    break
                events += parameter_findings(model, optimizer, loss, inputs)
            loss.backward()
            optimizer.step()
            curve[step] = loss.detach()
            done = step + 1
            if done % READBACK_EVERY == 0 or done == steps:
                losses = curve[:done].tolist()  # sync point: once per READBACK_EVERY steps
                if progress is not None:
                    progress(done, losses[-1])
                if _settled(losses, target_value) or not math.isfinite(losses[-1]):
                    break
            elif progress is not None:
                progress(done, None)
    assert target_value is not None
    reached = bool(losses) and _settled(losses, target_value)
    if not reached and not detached:
        events.insert(0, curve_event(losses, target_value, rule, n, criterion, events))
    final = median(losses[-SETTLE_STEPS:]) if losses else math.nan
    passed = not has_error(events)
    verdict = "passed" if passed else "failed"
    summary = (
        f"{verdict}: loss on {n} samples {losses[0]:.4g} -> {final:.4g} in {len(losses)} steps "
        f"(target <= {target_value:.3g})"
    )
    return CheckResult(
        name="overfit", passed=passed, summary=summary, events=events, loss_curve=losses,
        metrics={"first_loss": losses[0], "final_loss": final, "target": target_value,
                 "steps": float(len(losses)), "samples": float(n)},
    )


def _validate(model, criterion, optimizer, steps, target) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(criterion):
        raise TypeError(f"criterion must be a loss such as nn.CrossEntropyLoss(), got {type(criterion).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0):
        raise ValueError(f"target must be a positive number (the loss to reach), got {target!r}")


def uninformed_loss(criterion, pred: torch.Tensor, targets: torch.Tensor, first: float) -> tuple[float, str]:
    """The loss of a model that knows nothing, and how it was derived (the overfit target's reference)."""
    family = loss_family_of(criterion if isinstance(criterion, nn.Module) else None)
    if family == CROSS_ENTROPY and pred.ndim >= 2 and pred.shape[1] >= 2:
        c = int(pred.shape[1])
        return math.log(c), f"{TARGET_FRACTION:g} x log({c})"
    if family == BINARY_CROSS_ENTROPY:
        return math.log(2.0), f"{TARGET_FRACTION:g} x log(2)"
    if isinstance(criterion, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)) and targets.is_floating_point():
        y = targets.detach().float()
        if isinstance(criterion, nn.MSELoss):
            ref, what = float((y * y).mean()), "mean(y^2), the MSE of predicting 0"
        else:
            ref, what = float(y.abs().mean()), "mean|y|, the error of predicting 0"
        if ref > 0:
            return ref, f"{TARGET_FRACTION:g} x {what}"
    return abs(first), f"{TARGET_FRACTION:g} x the first loss"


def output_findings(criterion, pred: torch.Tensor, first: float) -> list[Event]:
    """Errors visible in the first output: probabilities fed to a loss that wants logits or log-probabilities."""
    pred = pred.detach()
    if isinstance(criterion, nn.NLLLoss) and pred.ndim >= 2 and bool((pred >= 0).all()):
        return [Event(
            kind=EventKind.OVERFIT_FAILED, severity="error", step=0, layer="(output)", value=first,
            message=(
                "The model's outputs are non-negative, so NLLLoss is fed probabilities (softmax), not "
                f"log-probabilities: its loss ({first:.4g}) can go below zero and means nothing."
            ),
            fix="End the model with nn.LogSoftmax(dim=1) for NLLLoss, or return raw logits and use CrossEntropyLoss.",
        )]
    if isinstance(criterion, nn.CrossEntropyLoss) and looks_like_probabilities(pred):
        c = int(pred.shape[1])
        floor = math.log(1 + (c - 1) / math.e)
        return [Event(
            kind=EventKind.OVERFIT_FAILED, severity="warning", step=0, layer="(output)", value=floor,
            message=(
                "The model's outputs are already probabilities (each row is in [0, 1] and sums to 1): "
                "CrossEntropyLoss applies log_softmax itself, so softmax is applied twice and the loss "
                f"cannot fall below log(1 + (C-1)/e) = {floor:.3g} for C = {c}."
            ),
            fix="Remove the final softmax: CrossEntropyLoss expects raw logits (apply softmax only for predictions).",
        )]
    if isinstance(criterion, nn.BCEWithLogitsLoss) and pred.numel() >= 8 and bool(((pred >= 0) & (pred <= 1)).all()):
        return [Event(
            kind=EventKind.OVERFIT_FAILED, severity="warning", step=0, layer="(output)",
            message=(
                "Every output is in [0, 1]: a sigmoid before BCEWithLogitsLoss (which applies its own) caps "
                "the loss at no less than log(1 + 1/e) = 0.313."
            ),
            fix="Remove the final sigmoid: BCEWithLogitsLoss expects raw logits.",
        )]
    return []


def looks_like_probabilities(pred: torch.Tensor) -> bool:
    """Rows (dim 1) in [0, 1] that sum to 1: softmax has been applied already."""
    if pred.ndim < 2 or pred.shape[1] < 2 or not pred.is_floating_point():
        return False
    p = pred.float()
    return bool(((p >= 0) & (p <= 1)).all()) and bool(torch.allclose(p.sum(1), torch.ones((), device=p.device), atol=1e-3))


def parameters_in_graph(loss: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf tensor the loss's backward will write a gradient to (its AccumulateGrad nodes)."""
    seen: set = set()
    stack = [loss.grad_fn]
    leaves: list[torch.Tensor] = []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return leaves


def parameter_findings(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, inputs) -> list[Event]:
    """Parameters the forward uses but nothing trains: unregistered layers, an optimizer over other
    parameters or with a zero learning rate, and parameters cut off from the loss."""
    events: list[Event] = []
    input_ids = {id(t) for t in _tensors(inputs)}
    used = [t for t in parameters_in_graph(loss) if id(t) not in input_ids]
    named = {id(p): name for name, p in model.named_parameters()}
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    unregistered = [t for t in used if id(t) not in named]
    if unregistered:
        holders = unregistered_containers(model)
        where = (
            "; ".join(f"{name} is a plain Python {kind} of {count} module(s)" for name, kind, count in holders)
            if holders else "tensors created in forward() or kept outside the module tree"
        )
        shapes = ", ".join(str(tuple(t.shape)) for t in unregistered[:4])
        events.append(Event(
            kind=EventKind.OVERFIT_FAILED, severity="error", step=0,
            layer=holders[0][0] if holders else None, value=float(len(unregistered)),
            message=(
                f"The forward uses {len(unregistered)} parameter tensor(s) ({shapes}) that are not registered on "
                f"the model ({where}): model.parameters(), the optimizer, .to(device) and state_dict() all miss them."
            ),
            fix="Keep sub-layers in nn.ModuleList / nn.ModuleDict (tensors in nn.Parameter), not in a list or dict.",
        ))
    used_named = [t for t in used if id(t) in named]
    untrained = [t for t in used_named if id(t) not in in_opt]
    if used_named and len(untrained) == len(used_named):
        events.append(Event(
            kind=EventKind.OVERFIT_FAILED, severity="error", step=0, value=float(len(untrained)),
            message=(
                f"The optimizer holds none of the {len(used_named)} parameter tensors the forward uses "
                f"(it holds {len(in_opt)} other tensor(s)): it was built over another model's parameters."
            ),
            fix="Build the optimizer from this model, after moving it to its device: optimizer = Adam(model.parameters()).",
        ))
    elif untrained:
        layers = _layers(named[id(t)] for t in untrained)
        events.append(Event(
            kind=EventKind.OVERFIT_FAILED, severity="warning", step=0, layer=layers[0],
            value=float(len(untrained)),
            message=(
                f"{len(untrained)} parameter tensor(s) in {', '.join(layers[:4])} get gradients but the optimizer "
                "does not hold them, so they never change."
            ),
            fix="Add them to the optimizer, or set requires_grad_(False) if they are frozen on purpose.",
        ))
    lrs = [g.get("lr", 1.0) for g in optimizer.param_groups if any(id(p) in named for p in g["params"])]
    if lrs and all(float(lr) == 0.0 for lr in lrs):
        events.append(Event(
            kind=EventKind.OVERFIT_FAILED, severity="error", step=0, value=0.0,
            message="The optimizer's learning rate is 0 for every parameter group that holds the model's parameters.",
            fix="Set a non-zero learning rate (and check that a scheduler's warm-up does not start at 0 for long).",
        ))
    used_ids = {id(t) for t in used}
    cut = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in used_ids]
    if cut and used_named:
        layers = _layers(cut)
        events.append(Event(
            kind=EventKind.OVERFIT_FAILED, severity="warning", step=0, layer=layers[0], value=float(len(cut)),
            message=(
                f"{len(cut)} parameter tensor(s) in {', '.join(layers[:4])} require grad but the loss does not "
                "depend on them: a .detach(), torch.no_grad() or .data in forward(), or layers that are never called."
            ),
            fix="Remove the detach/no_grad from the training path, or set requires_grad_(False) on unused layers.",
        ))
    return events


def unregistered_containers(model: nn.Module) -> list[tuple[str, str, int]]:
    """``(qualified attribute, 'list'|'tuple'|'dict', module count)`` for modules hidden in plain containers."""
    found = []
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_"):
                continue
            items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
            count = sum(isinstance(v, nn.Module) for v in items)
            if count:
                found.append((f"{prefix}.{attr}" if prefix else attr, type(value).__name__, count))
    return found


def curve_event(losses: list[float], target: float, rule: str, n: int, criterion, findings: list[Event]) -> Event:
    """The ``overfit_failed`` event for a curve that missed its target: what it did, and which causes fit."""
    shape, what = describe_curve(losses)
    causes = {
        "nonfinite": "the learning rate is too high, or a log/sqrt/division of zero in the model or loss",
        "flat": (
            "nothing is being trained: a zero learning rate, an optimizer over other parameters, layers not "
            "registered as submodules, or a detached graph"
        ),
        "rising": "the learning rate is too high, or the loss is minimised with the wrong sign",
        "fluctuating": "the learning rate is too high, or randomness in forward (dropout, augmentation) drowns the signal",
        "plateau": (
            "the loss is computed on already-softmaxed outputs (a floor above zero), the same input carries "
            "contradictory labels, or the learning rate or the number of steps is too small"
        ),
    }[shape]
    notes = " ".join(e.message.split(": ")[0].rstrip(".") + "." for e in findings if e.severity != "info")
    message = (
        f"On one fixed batch of {n} samples the {criterion_name(criterion)} loss {what}; it should fall to "
        f"<= {target:.3g} ({rule}). Likely: {causes}." + (f" Found: {notes}" if notes else "")
    )
    return Event(
        kind=EventKind.OVERFIT_FAILED, severity="error", step=len(losses) - 1,
        value=median(losses[-SETTLE_STEPS:]) if all(map(math.isfinite, losses)) else math.nan,
        threshold=target, message=message,
    )


def describe_curve(losses: list[float]) -> tuple[str, str]:
    """``(shape, words)`` for a loss curve: nonfinite, flat, rising, fluctuating or plateau (pure floats)."""
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        return "nonfinite", f"became {losses[bad]} at step {bad}"
    first, final = losses[0], median(losses[-SETTLE_STEPS:])
    low, high = min(losses), max(losses)
    scale = abs(first) or 1.0
    if final >= FLAT_RATIO * first and high - low <= (1 - FLAT_RATIO) * scale:
        return "flat", f"stayed flat at {first:.4g} for {len(losses)} steps"
    if final > first * (2 - FLAT_RATIO):
        return "rising", f"rose from {first:.4g} to {final:.4g}"
    tail = losses[len(losses) // 2:]
    if len(tail) >= 4:
        mid = median(tail)
        ups = sum(b > a for a, b in zip(tail, tail[1:])) / (len(tail) - 1)
        if mid > 0 and (max(tail) - min(tail)) > FLUCTUATION_SPAN * mid and ups >= FLUCTUATION_UPS:
            return "fluctuating", f"fluctuated between {min(tail):.4g} and {max(tail):.4g} over the last {len(tail)} steps"
    return "plateau", f"fell from {first:.4g} but levelled off at a floor of {final:.4g} after {len(losses)} steps"


def _settled(losses: list[float], target: float) -> bool:
    tail = losses[-SETTLE_STEPS:]
    return bool(tail) and all(v <= target for v in tail)


def _detached_event() -> Event:
    return Event(
        kind=EventKind.OVERFIT_FAILED, severity="error", step=0,
        message=(
            "The loss does not require grad: nothing in it connects to a trainable parameter (the graph is "
            "detached by .detach(), .item(), numpy, torch.no_grad() or every parameter is frozen), so backward "
            "cannot train the model."
        ),
        fix="Remove the detach/no_grad/numpy round-trip between the parameters and the loss.",
    )


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _layers(names) -> list[str]:
    """Module names (``encoder.0``) of parameter names (``encoder.0.weight``), in order, unique."""
    out: list[str] = []
    for name in names:
        layer = name.rpartition(".")[0] or "(root)"
        if layer not in out:
            out.append(layer)
    return out
