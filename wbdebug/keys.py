"""Metric key names, in one place: the README's key table is tested against these."""

from __future__ import annotations

PREFIX = "wbdebug"
STEP = f"{PREFIX}/step"
LOSS = f"{PREFIX}/loss"
GRAD_NORM_TOTAL = f"{PREFIX}/grad_norm_total"
EVENTS_TABLE = f"{PREFIX}/events"
EVENT_COUNT = f"{PREFIX}/event_count"
ROOT_NAME = "(root)"
INPUT_NAME = "(input)"  # where a NaN is named when the model's input batch already held it
LOSS_NAME = "(loss)"  # where a NaN is named when the loss computation created it


def layer_name(qualified_name: str) -> str:
    """The display name of a module: its ``named_modules()`` name, ``(root)`` for the model itself."""
    return qualified_name or ROOT_NAME


def grad_norm(layer: str) -> str:
    """L2 norm of the gradients of ``layer``'s own parameters."""
    return f"{PREFIX}/grad_norm/{layer}"


def act_zero_frac(layer: str) -> str:
    """Fraction of exactly-zero elements in ``layer``'s monitored activation."""
    return f"{PREFIX}/act_zero_frac/{layer}"


def dead_unit_frac(layer: str) -> str:
    """Fraction of units (features/channels) that are zero for every sample in the batch."""
    return f"{PREFIX}/dead_unit_frac/{layer}"


#: (pattern, meaning) rows for the README's key table.
KEY_TABLE: list[tuple[str, str]] = [
    (STEP, "wbdebug's step metric (optimizer steps); every wbdebug/* key is plotted against it"),
    (LOSS, "mean training loss over the steps since the previous row"),
    (GRAD_NORM_TOTAL, "global L2 norm of all gradients at the logged step, before clipping"),
    (grad_norm("<layer>"), "L2 norm of one module's own parameter gradients, before clipping"),
    (act_zero_frac("<layer>"), "fraction of exactly-zero activations (latest sampled step)"),
    (dead_unit_frac("<layer>"), "fraction of units zero for every sample in the batch (latest sample)"),
    (EVENTS_TABLE, "table of every event, written at close()"),
]
