"""Dead-activation detector (the seed: "90% of layer outputs zero")."""

from __future__ import annotations

from wbdebug.detectors.base import ConditionTracker, StepStats
from wbdebug.events import Event, EventKind


def is_dead(zero_fraction: float, dead_unit_fraction: float, threshold: float) -> bool:
    """A layer is dead when ``threshold`` of its elements, or of its units, are zero."""
    return zero_fraction >= threshold or dead_unit_fraction >= threshold


class DeadActivationDetector:
    """Raises ``dead_activations`` for a layer dead on ``samples`` consecutive activation samples."""

    def __init__(self, *, threshold: float = 0.9, samples: int = 3, clear_samples: int = 2) -> None:
        self.threshold = threshold
        self.samples = samples
        self.dead_run: dict[str, int] = {}
        self.conditions = ConditionTracker(clear_samples)

    def observe(self, stats: StepStats) -> list[Event]:
        if not stats.activations:
            return []
        events: list[Event] = []
        step = stats.step
        for layer, (zero_frac, dead_frac, _) in stats.activations.items():
            dead = is_dead(zero_frac, dead_frac, self.threshold)
            run = self.dead_run[layer] = self.dead_run.get(layer, 0) + 1 if dead else 0
            if dead and run < self.samples:
                continue
            events += self.conditions.update(
                EventKind.DEAD_ACTIVATIONS, layer, "warning" if dead else None,
                lambda sev, layer=layer, z=zero_frac, d=dead_frac, run=run: Event(
                    kind=EventKind.DEAD_ACTIVATIONS, severity=sev, step=step, layer=layer, value=max(z, d),
                    threshold=self.threshold,
                    message=(
                        f"{layer}: {z:.0%} of activations are zero and {d:.0%} of units are dead "
                        f"(zero for every sample), over {run} consecutive samples."
                    ),
                ),
                step=step, clear_message=f"{layer} has live activations again at step {step}.",
            )
        return events

    def state_dict(self) -> dict:
        return {"dead_run": dict(self.dead_run), "conditions": self.conditions.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dead_run = dict(state["dead_run"])
        self.conditions.load_state_dict(state["conditions"])
