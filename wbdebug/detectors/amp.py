"""Mixed-precision detector: skipped GradScaler steps are information; a collapsing scale is a problem."""

from __future__ import annotations

from wbdebug.detectors.base import ConditionTracker, StepStats
from wbdebug.events import Event, EventKind


class AmpDetector:
    """Raises ``amp_overflow``: info on the first skipped step, a warning when the scale collapses.

    A GradScaler halves its scale and skips the step on every overflow; a few early on are how it
    calibrates, so they are counted, not alarmed on (and never reported as ``nonfinite_grad``).
    """

    def __init__(self, *, min_scale: float = 1.0) -> None:
        self.min_scale = min_scale
        self.total = 0
        self.conditions = ConditionTracker()

    def observe(self, stats: StepStats) -> list[Event]:
        if stats.amp_overflows is None:
            return []
        events: list[Event] = []
        step = stats.step
        if stats.amp_overflows and self.total == 0:
            events.append(Event(
                kind=EventKind.AMP_OVERFLOW, severity="info", step=step, value=float(stats.amp_overflows),
                message=f"GradScaler skipped {stats.amp_overflows} step(s) on inf/NaN gradients before step {step} "
                        "(normal while the scale calibrates; counted in the summary).",
            ))
        self.total += stats.amp_overflows
        scale = stats.amp_scale
        collapsed = scale is not None and scale < self.min_scale
        events += self.conditions.update(
            EventKind.AMP_OVERFLOW, None, "warning" if collapsed else None,
            lambda sev: Event(
                kind=EventKind.AMP_OVERFLOW, severity=sev, step=step, value=scale, threshold=self.min_scale,
                message=f"The GradScaler scale has collapsed to {scale:.3g} after {self.total} overflow(s): "
                        "the gradients overflow persistently.",
            ),
            step=step, clear_message=f"The GradScaler scale recovered at step {step}.",
        )
        return events

    def state_dict(self) -> dict:
        return {"total": self.total, "conditions": self.conditions.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.total = state["total"]
        self.conditions.load_state_dict(state["conditions"])
