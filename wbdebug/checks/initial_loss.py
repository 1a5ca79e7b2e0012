"""Sanity check #2 of the seed: the loss at step 0, before any update, against an uninformed model's."""

from __future__ import annotations

import math
from collections.abc import Callable

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
from wbdebug.config import Config
from wbdebug.detectors.loss import BINARY_CROSS_ENTROPY, CROSS_ENTROPY
from wbdebug.events import Event, EventKind, Severity
from wbdebug.probes.loss import classes_in_logits, loss_family_of


def check_initial_loss(
    model: nn.Module,
    batch: tuple,
    criterion: Callable,
    *,
    num_classes: int | None = None,
    config: Config | None = None,
) -> CheckResult:
    """Compare the step-0 loss with the loss of a model that predicts uniformly, without any update.

    Expected: log C for cross-entropy/NLL (C given, or the logits' width), log 2 for binary cross-entropy,
    mean(y²) for MSE — the MSE of predicting 0, which a freshly initialised output layer nearly does.
    Thresholds are the monitor's (``Config.initial_loss_warn_ratio`` 1.5x: warning,
    ``initial_loss_error_ratio`` 3x: error), applied both ways: the seed names 0.01 for log 10 as broken
    as 45 — a fresh model that already knows the answer has leaked labels or a wrong loss.
    (Skip this check for a pretrained or resumed model.) The model's buffers and RNG are restored.

    Args:
        model: the freshly initialised model, in the mode training will use.
        batch: ``(inputs, targets)``.
        criterion: the loss, called as ``criterion(model(inputs), targets)``.
        num_classes: C for cross-entropy; default the width of the logits.
        config: thresholds; default :class:`wbdebug.Config`'s.

    Returns:
        A :class:`CheckResult` with an ``initial_loss`` event when the loss is off; ``metrics`` holds
        ``initial_loss``, ``expected`` and ``ratio``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(criterion):
        raise TypeError(f"criterion must be a loss such as nn.CrossEntropyLoss(), got {type(criterion).__name__}")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)):
        raise TypeError(f"num_classes must be an int, got {type(num_classes).__name__}")
    if num_classes is not None and num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a wbdebug.Config, got {type(config).__name__}")
    cfg = config or Config()
    inputs, targets = split_batch(batch, "batch")
    device = model_device(model)
    inputs, targets = to_device(inputs, device), targets.to(device)
    with preserved(model), torch.no_grad():
        pred = prediction(call_model(model, inputs))
        measured = float(compute_loss(criterion, pred, targets))  # sync point (once)
    expected, what = expected_initial_loss(criterion, pred, targets, num_classes)
    name = criterion_name(criterion)
    if expected is None:
        return CheckResult(
            name="initial_loss", passed=True, metrics={"initial_loss": measured},
            summary=f"skipped: no uninformed-loss reference for {name} (first loss {measured:.4g})",
        )
    ratio = measured / expected if math.isfinite(measured) else math.inf
    severity = initial_loss_verdict(ratio, cfg.initial_loss_warn_ratio, cfg.initial_loss_error_ratio)
    events: list[Event] = []
    if severity is not None:
        scaled = getattr(criterion, "reduction", "mean") == "sum"
        events.append(Event(
            kind=EventKind.INITIAL_LOSS, severity=severity, step=0, value=measured, threshold=expected,
            message=(
                f"The step-0 {name} loss is {measured:.4g}, {ratio:.3g}x the {expected:.4g} = {what} of a model "
                "that predicts uniformly" + (
                    f" (reduction='sum' scales it with the batch size, {int(targets.shape[0])})." if scaled
                    else ": the model is confidently wrong before training." if ratio > 1
                    else ": the model already knows the answers before training (leakage or a wrong loss)."
                )
            ),
        ))
    passed = not has_error(events)
    return CheckResult(
        name="initial_loss", passed=passed, events=events,
        metrics={"initial_loss": measured, "expected": expected, "ratio": ratio},
        summary=f"{'passed' if passed else 'failed'}: step-0 loss {measured:.4g} vs expected {expected:.4g} ({what}), "
                f"{ratio:.3g}x",
    )


def expected_initial_loss(
    criterion, pred: torch.Tensor, targets: torch.Tensor, num_classes: int | None
) -> tuple[float | None, str]:
    """The uninformed loss for this criterion and ``what`` it is, or ``(None, "")`` when unknown."""
    family = loss_family_of(criterion if isinstance(criterion, nn.Module) else None)
    if family == CROSS_ENTROPY:
        c = num_classes or classes_in_logits(pred)
        if c is not None and c >= 2:
            return math.log(c), f"log({c})"
    if family == BINARY_CROSS_ENTROPY:
        return math.log(2.0), "log(2)"
    if isinstance(criterion, nn.MSELoss) and targets.is_floating_point():
        y = targets.float()
        ref = float((y * y).mean())
        if ref > 1e-12:
            return ref, "mean(y^2), the MSE of predicting 0"
    return None, ""


def initial_loss_verdict(ratio: float, warn_ratio: float, error_ratio: float) -> Severity | None:
    """Severity of a step-0 loss ``ratio`` x the uninformed one; the bands are symmetric (x3 and /3 error)."""
    if not math.isfinite(ratio) or ratio >= error_ratio or ratio <= 1.0 / error_ratio:
        return "error"
    if ratio >= warn_ratio or ratio <= 1.0 / warn_ratio:
        return "warning"
    return None
