"""wbdebug: the systematic training-debugging protocol, running itself inside your PyTorch loop."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wbdebug.alerts import TrainingHealthError
from wbdebug.config import Config, make_config
from wbdebug.events import Event, EventKind
from wbdebug.monitor import Monitor, unwrap_model
from wbdebug.sinks import MemorySink, Sink, read_journal

__all__ = ["Config", "Event", "EventKind", "MemorySink", "Monitor", "TrainingHealthError", "read_journal", "watch"]
__version__ = "0.1.0"

from wbdebug.checks import (  # noqa: E402  (pre-flight checks)
    CheckResult,
    CheckSetup,
    Report,
    check_initial_loss,
    inspect_data,
    overfit_one_batch,
    preflight,
)

__all__ += [
    "CheckResult", "CheckSetup", "Report", "check_initial_loss", "inspect_data", "overfit_one_batch", "preflight",
]


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    criterion: nn.Module | None = None,
    *,
    num_classes: int | None = None,
    run: Any = None,
    config: Config | None = None,
    sinks: list[Sink] | None = None,
    scaler: Any = None,
    scheduler: Any = None,
    **settings: Any,
) -> Monitor:
    """Watch a model's training: one line added before an existing loop, no other change.

    Args:
        model: the ``nn.Module`` being trained (DDP/DataParallel wrappers are looked through).
        optimizer: its optimizer; each ``optimizer.step()`` is one wbdebug step. Without one, each
            backward pass is a step.
        criterion: the loss module (``nn.CrossEntropyLoss()`` …); its output is the loss. Without one,
            the loss is taken from the model's output (``out.loss``) or from ``monitor.observe_loss``.
        num_classes: C for the step-0 check (log C); inferred from the logits when omitted.
        run: the W&B run to log to; default ``wandb.run``, else wbdebug starts one (offline without an API key).
        config: a :class:`Config`; ``**settings`` override single fields (``log_every=10``).
        sinks: extra sinks (e.g. :class:`MemorySink`) besides W&B, the journal and the console.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop, so gradient norms are reported
            unscaled and skipped steps are counted as ``amp_overflow``, not ``nonfinite_grad``.
        scheduler: the LR scheduler, so a rollback (``on_spike="rollback"``) restores its state too.

    Returns:
        The :class:`Monitor`; call ``close()`` at the end, or use it as a context manager.
    """
    cfg = make_config(config, settings)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inner = unwrap_model(model)
    params = list(inner.parameters())
    if not params:
        raise ValueError(
            f"model {type(inner).__name__} has no parameters to watch; pass the module that holds the weights"
        )
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        ids = {id(p) for p in params}
        if not any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds none of the model's parameters; build it from this model, "
                "e.g. torch.optim.Adam(model.parameters())"
            )
    if criterion is not None and not isinstance(criterion, nn.Module):
        raise TypeError(
            f"criterion must be a loss module such as nn.CrossEntropyLoss(), got {type(criterion).__name__}; "
            "for a functional loss, pass criterion=None and call monitor.observe_loss(loss)"
        )
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)):
        raise TypeError(f"num_classes must be an int, got {type(num_classes).__name__}")
    if num_classes is not None and num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if run is not None and not (hasattr(run, "log") and hasattr(run, "define_metric")):
        raise TypeError(f"run must be a wandb Run (from wandb.init()), got {type(run).__name__}")
    if sinks is not None and (not isinstance(sinks, (list, tuple)) or not all(isinstance(s, Sink) for s in sinks)):
        raise TypeError("sinks must be a list of objects with log(), emit() and close() methods")
    if scaler is not None and not (hasattr(scaler, "_get_scale_async") and hasattr(scaler, "is_enabled")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    return Monitor(
        model, optimizer, criterion, num_classes=num_classes, run=run, config=cfg,
        sinks=list(sinks) if sinks else None, scaler=scaler, scheduler=scheduler,
    )
