"""Where the loss comes from: a criterion module, or a model output that carries one (Hugging Face)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from wbdebug.detectors.loss import BINARY_CROSS_ENTROPY, CROSS_ENTROPY


def find_loss_in_output(output: object) -> torch.Tensor | None:
    """The scalar loss a model returned as ``out.loss`` or ``out["loss"]`` (as Hugging Face models do)."""
    loss = None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif not isinstance(output, (torch.Tensor, tuple, list)):
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    return None


def logits_in_output(output: object) -> torch.Tensor | None:
    """The ``logits`` a model output carries, if any."""
    if isinstance(output, Mapping):
        logits = output.get("logits")
    else:
        logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def first_grad_tensor(output: object) -> torch.Tensor | None:
    """The first tensor in a (nested) output that backward will flow through."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, Mapping):
        items = list(output.values())
    elif isinstance(output, (tuple, list)):
        items = list(output)
    else:
        items = [getattr(output, k) for k in ("loss", "logits") if hasattr(output, k)]
    for item in items:
        found = first_grad_tensor(item)
        if found is not None:
            return found
    return None


def loss_family_of(criterion: nn.Module | None) -> str | None:
    """``cross_entropy``, ``binary_cross_entropy`` or None, from the criterion's type."""
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return CROSS_ENTROPY
    if isinstance(criterion, (nn.BCEWithLogitsLoss, nn.BCELoss)):
        return BINARY_CROSS_ENTROPY
    return None


def classes_in_logits(logits: torch.Tensor) -> int | None:
    """C for cross-entropy input shaped (C,), (N, C) or (N, C, d1, …)."""
    if logits.ndim == 0:
        return None
    return int(logits.shape[1] if logits.ndim >= 2 else logits.shape[0])


def as_scalar_loss(loss: torch.Tensor) -> torch.Tensor:
    """A detached float32 scalar (mean of an unreduced loss), still on the device."""
    loss = loss.detach()
    if loss.dim() == 0 and loss.dtype == torch.float32:
        return loss  # the usual case, on every step: no op beyond the detach
    if loss.numel() != 1:
        loss = loss.float().mean()
    return loss.reshape(()).float()
