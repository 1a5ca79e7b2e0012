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


def is_finite(x: float | None) -> bool:
    """True for a real, finite number."""
    return x is not None and math.isfinite(x)


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

    def robust_std(self) -> float:
        """1.4826 × median absolute deviation: the standard deviation for Gaussian noise, robust to outliers."""
        m = self.median()
        return 1.4826 * statistics.median(abs(v - m) for v in self.values)

    def state_dict(self) -> dict:
        return {"values": list(self.values), "size": self.values.maxlen}

    def load_state_dict(self, state: dict) -> None:
        self.values = deque(state["values"], maxlen=state["size"])


class ConditionTracker:
    """Turns a per-step verdict into events: one when a condition starts, one when it worsens, one when it clears."""

    def __init__(self) -> None:
        self.active: dict[tuple[str, str | None], str] = {}

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
            del self.active[key]
            where = f" in {layer}" if layer else ""
            return [
                Event(
                    kind=kind, severity="info", step=step, layer=layer, cleared=True,
                    message=clear_message or f"{kind.value}{where} has cleared.",
                )
            ]
        if previous is not None and SEVERITY_RANK[severity] <= SEVERITY_RANK[previous]:
            return []
        self.active[key] = severity
        return [make(severity)]

    def is_active(self, kind: EventKind, layer: str | None = None) -> bool:
        return (kind.value, layer) in self.active

    def state_dict(self) -> dict:
        return {"active": [[k, layer, s] for (k, layer), s in self.active.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.active = {(k, layer): s for k, layer, s in state["active"]}
