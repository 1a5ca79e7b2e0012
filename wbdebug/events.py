"""Diagnosed events: what went wrong, where, when, why, and the fix."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Severity = Literal["info", "warning", "error"]
SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}


class EventKind(str, Enum):
    """The condition an event reports (a snake_case noun, never a detector's name)."""

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    EXPLODING_GRADIENTS = "exploding_gradients"
    VANISHING_GRADIENTS = "vanishing_gradients"
    DEAD_ACTIVATIONS = "dead_activations"
    LOSS_SPIKE = "loss_spike"
    INITIAL_LOSS = "initial_loss"
    # pre-flight checks
    OVERFIT_FAILED = "overfit_failed"
    UNNORMALIZED_INPUTS = "unnormalized_inputs"
    LABEL_RANGE = "label_range"
    TARGET_LEAKAGE = "target_leakage"
    VAL_AUGMENTATION = "val_augmentation"
    SPLIT_OVERLAP = "split_overlap"
    CLASS_IMBALANCE = "class_imbalance"
    # recovery
    ROLLBACK = "rollback"
    # distributed and mixed precision
    RANK_DIVERGENCE = "rank_divergence"
    AMP_OVERFLOW = "amp_overflow"
    # the monitor's own health
    MONITOR_ERROR = "monitor_error"

    def __str__(self) -> str:
        return self.value


#: The recommended fix for each kind, following the seed's CAUSE & FIX table.
FIXES: dict[EventKind, str] = {
    EventKind.NONFINITE_LOSS: (
        "Find the first non-finite value (wrap one step in torch.autograd.detect_anomaly()); "
        "check for log/sqrt/division of zero or negative numbers, lower the learning rate, "
        "and enable gradient clipping."
    ),
    EventKind.NONFINITE_GRAD: (
        "Lower the learning rate and enable gradient clipping "
        "(torch.nn.utils.clip_grad_norm_); check the named layer for log/sqrt/division of zero."
    ),
    EventKind.EXPLODING_GRADIENTS: (
        "Learning rate too high: lower it, add warm-up, and enable gradient clipping "
        "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))."
    ),
    EventKind.VANISHING_GRADIENTS: (
        "Add residual connections or normalisation (BatchNorm/LayerNorm), use ReLU-family "
        "activations instead of sigmoid/tanh, and use a variance-preserving init (Kaiming/Xavier)."
    ),
    EventKind.DEAD_ACTIVATIONS: (
        "Check for negative biases feeding the ReLU, switch to LeakyReLU/GELU, and lower the learning rate."
    ),
    EventKind.LOSS_SPIKE: (
        "Roll back to a checkpoint before the spike, skip the offending batch, "
        "and resume with a temporarily lower learning rate."
    ),
    EventKind.INITIAL_LOSS: (
        "The final layer's weights are mis-initialised or the loss is scaled wrongly: initialise the "
        "output layer small (or zero its weights) so the first prediction is uninformed, and check the "
        "loss reduction."
    ),
    EventKind.OVERFIT_FAILED: (
        "Check that labels match inputs, that the loss receives raw logits (no softmax before "
        "CrossEntropyLoss), that every layer is registered as a submodule (nn.ModuleList, not a list), "
        "that the optimizer holds the model's parameters with a non-zero learning rate, and that "
        "nothing detaches the graph."
    ),
    EventKind.UNNORMALIZED_INPUTS: (
        "Scale inputs: divide raw pixels by 255 (then standardise per channel), and standardise "
        "tabular features to mean 0, std 1 using statistics of the training split."
    ),
    EventKind.LABEL_RANGE: (
        "Class labels must be integers in [0, C): subtract 1 from 1-based labels, and check that "
        "num_classes matches the data."
    ),
    EventKind.TARGET_LEAKAGE: (
        "Remove the input feature that encodes the target (an ID, a label column, a post-outcome "
        "field) from the inputs."
    ),
    EventKind.VAL_AUGMENTATION: (
        "Use deterministic transforms for the validation split: no random crops, flips or noise."
    ),
    EventKind.SPLIT_OVERLAP: (
        "Deduplicate before splitting and split by a stable key so no sample is in both train and validation."
    ),
    EventKind.CLASS_IMBALANCE: (
        "Use a class-weighted loss or a balanced sampler, and report per-class metrics."
    ),
    EventKind.ROLLBACK: (
        "wbdebug restored a snapshot and cooled the learning rate down; if it keeps happening, lower the "
        "base learning rate, add warm-up or clipping, and inspect the skipped batches (steps in the event)."
    ),
    EventKind.RANK_DIVERGENCE: (
        "Replicas must stay identical: check that every rank loads the same checkpoint and seed, that no "
        "rank skips optimizer.step() or runs under no_sync() alone, and inspect the named rank's data shard."
    ),
    EventKind.AMP_OVERFLOW: (
        "Occasional skipped steps are GradScaler working as designed. If the scale keeps collapsing, lower "
        "the learning rate, check for inf-producing ops under autocast, or train in bfloat16."
    ),
    EventKind.MONITOR_ERROR: (
        "wbdebug's own failure: training goes on; please report it with the message."
    ),
}


class Event(BaseModel):
    """One diagnosed condition: what, where (`layer`), when (`step`), why (`message`), fix."""

    model_config = ConfigDict(frozen=True)

    kind: EventKind
    severity: Severity
    step: int
    layer: str | None = None
    value: float | None = None
    threshold: float | None = None
    message: str
    fix: str = ""
    cleared: bool = Field(False, description="True when this event reports the condition has cleared.")
    data: dict[str, Any] = Field(default_factory=dict, description="Machine-readable details (rollback steps, ...).")

    def model_post_init(self, __context: object) -> None:
        if not self.fix:
            object.__setattr__(self, "fix", FIXES.get(self.kind, ""))

    def headline(self) -> str:
        """A one-line summary, e.g. for a console or an alert title."""
        where = f" in {self.layer}" if self.layer else ""
        return f"[{self.severity}] {self.kind.value}{where} at step {self.step}"
