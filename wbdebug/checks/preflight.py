"""All pre-flight checks in one call: the seed's steps 1, 2 and 4 before the long run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from wbdebug.checks.batches import first_batch, take_rows
from wbdebug.checks.data import MAX_BATCHES, inspect_data
from wbdebug.checks.initial_loss import check_initial_loss
from wbdebug.checks.overfit import Progress, overfit_one_batch
from wbdebug.checks.result import CheckResult, Report, has_error

CHECKS = ("overfit", "initial_loss", "data")
#: The seed's micro-batch: "a single micro-batch of 10 samples".
OVERFIT_SAMPLES = 10


def preflight(
    model: nn.Module,
    train: Any,
    criterion: Callable,
    optimizer: torch.optim.Optimizer,
    *,
    val: Any = None,
    num_classes: int | None = None,
    checks: Sequence[str] = CHECKS,
    steps: int = 200,
    overfit_samples: int = OVERFIT_SAMPLES,
    max_batches: int = MAX_BATCHES,
    progress: Progress | None = None,
) -> Report:
    """Run the pre-flight checks in the seed's order and return one :class:`Report`.

    ``overfit``: :func:`overfit_one_batch` on the first ``overfit_samples`` samples of the first training
    batch; ``initial_loss``: :func:`check_initial_loss` on the whole first batch; ``data``:
    :func:`inspect_data` on ``train`` and ``val``. The model and optimizer are left as they were.

    Args:
        model, criterion, optimizer: what the training loop uses.
        train: the training DataLoader (or Dataset, iterable of batches, ``(X, y)`` pair).
        val: the validation split, for the overlap and augmentation checks.
        num_classes: C for cross-entropy and label checks; inferred when omitted.
        checks: which of ``overfit``, ``initial_loss``, ``data`` to run.
        steps: most overfit steps.
        overfit_samples: size of the overfit micro-batch.
        max_batches: batches per split read by the data inspection.
        progress: overfit progress callback, ``progress(steps_done, loss_or_None)``.

    Returns:
        The :class:`Report`: ``passed``, ``events``, ``loss_curve`` and each check's result.
    """
    if isinstance(checks, str) or not set(checks) <= set(CHECKS) or not checks:
        raise ValueError(f"checks must be a non-empty list drawn from {list(CHECKS)}, got {checks!r}")
    if isinstance(overfit_samples, bool) or not isinstance(overfit_samples, int) or overfit_samples < 1:
        raise ValueError(f"overfit_samples must be a positive int, got {overfit_samples!r}")
    results: list[CheckResult] = []
    batch = first_batch(train, "train") if {"overfit", "initial_loss"} & set(checks) else None
    if "overfit" in checks:
        assert batch is not None
        micro = (take_rows(batch[0], overfit_samples), batch[1][:overfit_samples])
        results.append(overfit_one_batch(model, micro, criterion, optimizer, steps=steps, progress=progress))
    if "initial_loss" in checks:
        results.append(check_initial_loss(model, batch, criterion, num_classes=num_classes))
    if "data" in checks:
        events = inspect_data(train, val, num_classes=num_classes, max_batches=max_batches)
        passed = not has_error(events)
        counts = {s: sum(e.severity == s for e in events) for s in ("error", "warning")}
        results.append(CheckResult(
            name="data", passed=passed, events=events,
            metrics={"errors": float(counts["error"]), "warnings": float(counts["warning"])},
            summary=(
                f"{'passed' if passed else 'failed'}: {counts['error']} error(s), {counts['warning']} warning(s) "
                f"in {'train and val' if val is not None else 'train (no val given)'}"
            ),
        ))
    return Report(checks=results)
