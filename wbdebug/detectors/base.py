"""What every detector shares: the per-step numbers it reads and the once-per-condition rule."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from wbdebug.events import SEVERITY_RANK, Event, EventKind, Severity


@dataclass
class StepStats:
    """Host-side numbers for one optimizer step, read back from the device in one go."""

    step: int
    loss: float | None = None
    grad_total: float | None = None
    #: layer -> gradient norm, only layers that received a gradient this step (parameter order).
    grad_layers: dict[str, float] = field(default_factory=dict)
    #: layer -> (zero fraction, dead-unit fraction, non-finite flag); forward order; sampled steps only.
    activations: dict[str, tuple[float, float, bool]] | None = None
    #: layers whose statistics are of their input (weight layers), not their output.
    measured_at_input: frozenset[str] = frozenset()
    #: whether the model's input batch held NaN/Inf (sampled steps only).
    input_nonfinite: bool | None = None
    #: NaN forensics (replay): the module that created the first non-finite value, and how.
    origin_layer: str | None = None
    origin: str | None = None
    #: the first parameter (in parameter order) whose gradient was non-finite.
    nonfinite_param: str | None = None
    #: under torch.distributed: the ranks whose loss was non-finite this step.
    nonfinite_ranks: list[int] | None = None
    #: with a GradScaler: backward passes whose gradients overflowed (skipped steps), and the scale.
    amp_overflows: int | None = None
    amp_scale: float | None = None


def is_finite(x: float | None) -> bool:
    """True for a real, finite number."""
    return x is not None and math.isfinite(x)


def jump_threshold(values: list[float], factor: float, tail: float) -> float:
    """Level above which a new value jumps out of its recent history.

    At least ``factor`` × the median, widened to exp(``tail`` × the 90th percentile of log(value/median)):
    a converged classifier's per-batch loss and gradient norm are heavy-tailed (a few hard samples
    make 3–10× excursions; measured on the healthy test models), while a large-batch LM's are not,
    so a fixed multiple alone is either blind on one or noisy on the other. Non-positive medians
    (losses that can go negative) fall back to median + max(8 robust std, (factor-1)·|median|).
    """
    med = statistics.median(values)
    if med <= 0:
        spread = 1.4826 * statistics.median(abs(v - med) for v in values)
        return med + max(8.0 * spread, (factor - 1.0) * abs(med))
    excursions = sorted(math.log(v / med) for v in values if v > 0)
    q90 = excursions[int(0.9 * (len(excursions) - 1))] if excursions else 0.0
    return med * max(factor, math.exp(tail * max(q90, 0.0)))


class RollingWindow:
    """The last ``size`` finite values, with robust centre and spread."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def append(self, x: float) -> None:
        self.values.append(float(x))

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        return statistics.median(self.values)

    def jump_threshold(self, factor: float, tail: float) -> float:
        """See :func:`jump_threshold`."""
        return jump_threshold(list(self.values), factor, tail)

    def state_dict(self) -> dict:
        return {"values": list(self.values), "size": self.values.maxlen}

    def load_state_dict(self, state: dict) -> None:
        self.values = deque(state["values"], maxlen=state["size"])


class ConditionTracker:
    """Turns a per-step verdict into events: one when a condition starts, one when it worsens, one when it clears."""

    def __init__(self, clear_after: int = 1) -> None:
        self.active: dict[tuple[str, str | None], str] = {}
        self.clear_after = clear_after
        self.absent: dict[tuple[str, str | None], int] = {}

    def update(
        self,
        kind: EventKind,
        layer: str | None,
        severity: Severity | None,
        make: Callable[[Severity], Event],
        *,
        step: int,
        clear_message: str | None = None,
    ) -> list[Event]:
        """Report ``kind``@``layer`` at ``severity`` (None = condition absent); return the events to raise."""
        key = (kind.value, layer)
        previous = self.active.get(key)
        if severity is None:
            if previous is None:
                return []
            # Hysteresis: a condition that flaps (explode, recover, explode) is one incident, not many.
            self.absent[key] = self.absent.get(key, 0) + 1
            if self.absent[key] < self.clear_after:
                return []
            del self.active[key]
            del self.absent[key]
            where = f" in {layer}" if layer else ""
            return [
                Event(
                    kind=kind, severity="info", step=step, layer=layer, cleared=True,
                    message=clear_message or f"{kind.value}{where} has cleared.",
                )
            ]
        self.absent.pop(key, None)
        if previous is not None and SEVERITY_RANK[severity] <= SEVERITY_RANK[previous]:
            return []
        self.active[key] = severity
        return [make(severity)]

    def is_active(self, kind: EventKind, layer: str | None = None) -> bool:
        return (kind.value, layer) in self.active

    def state_dict(self) -> dict:
        return {
            "active": [[k, layer, s] for (k, layer), s in self.active.items()],
            "absent": [[k, layer, n] for (k, layer), n in self.absent.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.active = {(k, layer): s for k, layer, s in state["active"]}
        self.absent = {(k, layer): n for k, layer, n in state.get("absent", [])}
