"""Gradient detectors: non-finite, exploding and vanishing gradients (the seed's step 3 table)."""

from __future__ import annotations

from wbdebug.detectors.base import ConditionTracker, RollingWindow, StepStats, is_finite
from wbdebug.events import Event, EventKind

_EMA = 0.1


def vanishing_layers(grad_layers: dict[str, float], ratio: float, floor: float) -> list[str]:
    """Layers whose gradient norm collapsed: under ``floor``, or under ``ratio`` × the largest layer's.

    Only layers that received a gradient are passed in: frozen and unused parameters (``grad is None``)
    are never counted as vanishing.
    """
    if not grad_layers:
        return []
    largest = max(grad_layers.values())
    return [layer for layer, norm in grad_layers.items() if norm < floor or norm < ratio * largest]


class GradientDetector:
    """Raises ``nonfinite_grad``, ``exploding_gradients`` and ``vanishing_gradients``."""

    def __init__(
        self,
        *,
        history: int = 50,
        warmup_steps: int = 20,
        exploding_norm: float = 1e4,
        exploding_factor: float = 10.0,
        exploding_tail: float = 3.0,
        vanishing_ratio: float = 1e-5,
        vanishing_floor: float = 1e-12,
        vanishing_steps: int = 5,
        clear_steps: int = 10,
    ) -> None:
        self.window = RollingWindow(history)
        self.warmup_steps = warmup_steps
        self.exploding_norm = exploding_norm
        self.exploding_factor = exploding_factor
        self.exploding_tail = exploding_tail
        self.vanishing_ratio = vanishing_ratio
        self.vanishing_floor = vanishing_floor
        self.vanishing_steps = vanishing_steps
        self.layer_ema: dict[str, float] = {}
        self.vanishing_run = 0
        self.conditions = ConditionTracker(clear_steps)

    def observe(self, stats: StepStats) -> list[Event]:
        if not stats.grad_layers:
            return []
        events = self._nonfinite(stats)
        if self.conditions.is_active(EventKind.NONFINITE_GRAD):
            return events
        events += self._exploding(stats)
        events += self._vanishing(stats)
        for layer, norm in stats.grad_layers.items():
            prev = self.layer_ema.get(layer)
            self.layer_ema[layer] = norm if prev is None else (1 - _EMA) * prev + _EMA * norm
        return events

    def _nonfinite(self, stats: StepStats) -> list[Event]:
        bad = [layer for layer, norm in stats.grad_layers.items() if not is_finite(norm)]
        first = bad[0] if bad else None
        origin = f"; replay: {stats.origin}" if stats.origin else ""
        step = stats.step
        return self.conditions.update(
            EventKind.NONFINITE_GRAD, None, "error" if bad else None,
            lambda sev: Event(
                kind=EventKind.NONFINITE_GRAD, severity=sev, step=step, layer=first,
                value=stats.grad_layers[first],
                message=(
                    f"Gradients are non-finite at step {step}, first in {first}"
                    + (f" (parameter {stats.nonfinite_param})" if stats.nonfinite_param else "")
                    + (f", {len(bad)} layers in all" if len(bad) > 1 else "") + origin + "."
                ),
            ),
            step=step, clear_message=f"Gradients are finite again at step {step}.",
        )

    def _exploding(self, stats: StepStats) -> list[Event]:
        total = stats.grad_total
        if not is_finite(total):
            return []
        step = stats.step
        severity = None
        threshold = self.exploding_norm
        if total > self.exploding_norm:
            severity = "error"
        if len(self.window) >= self.warmup_steps:
            jump = self.exploding_factor * self.window.median()
            if total > jump or self.conditions.is_active(EventKind.EXPLODING_GRADIENTS):  # full test only when needed
                jump = self.window.jump_threshold(self.exploding_factor, self.exploding_tail)
            if severity is None and total > jump > 0:
                severity, threshold = "warning", jump
            # An explosion must not become its own baseline.
            self.window.append(min(total, jump) if jump > 0 else total)
        else:
            self.window.append(total)
        layer = self._most_jumped_layer(stats)
        return self.conditions.update(
            EventKind.EXPLODING_GRADIENTS, None, severity,
            lambda sev: Event(
                kind=EventKind.EXPLODING_GRADIENTS, severity=sev, step=step, layer=layer, value=total,
                threshold=threshold,
                message=(
                    f"The global gradient norm is {total:.4g} at step {step}, above {threshold:.4g}"
                    + (f"; {layer} grew most against its own history." if layer else ".")
                ),
            ),
            step=step, clear_message=f"The gradient norm is back under its threshold at step {step}.",
        )

    def _most_jumped_layer(self, stats: StepStats) -> str | None:
        best, best_ratio = None, 0.0
        for layer, norm in stats.grad_layers.items():
            ema = self.layer_ema.get(layer)
            if ema and is_finite(norm) and norm / ema > best_ratio:
                best, best_ratio = layer, norm / ema
        return best

    def _vanishing(self, stats: StepStats) -> list[Event]:
        if stats.loss == 0.0:  # a perfect fit has no gradient to lose
            return []
        layers = vanishing_layers(stats.grad_layers, self.vanishing_ratio, self.vanishing_floor)
        self.vanishing_run = self.vanishing_run + 1 if layers else 0
        severity = "warning" if self.vanishing_run >= self.vanishing_steps else None
        if layers and severity is None and self.conditions.is_active(EventKind.VANISHING_GRADIENTS):
            return []
        step = stats.step
        largest = max(stats.grad_layers.values())
        first = layers[0] if layers else None
        return self.conditions.update(
            EventKind.VANISHING_GRADIENTS, None, severity,
            lambda sev: Event(
                kind=EventKind.VANISHING_GRADIENTS, severity=sev, step=step, layer=first,
                value=stats.grad_layers[first], threshold=max(self.vanishing_floor, self.vanishing_ratio * largest),
                message=(
                    f"The gradient norm of {first} is {stats.grad_layers[first]:.3g}, under "
                    f"{self.vanishing_ratio:g}x the largest layer's ({largest:.3g}), for {self.vanishing_run} steps"
                    + (f"; {len(layers)} layers in all." if len(layers) > 1 else ".")
                ),
            ),
            step=step, clear_message=f"Gradients flow through every layer again at step {step}.",
        )

    def state_dict(self) -> dict:
        return {
            "window": self.window.state_dict(),
            "layer_ema": dict(self.layer_ema),
            "vanishing_run": self.vanishing_run,
            "conditions": self.conditions.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])
        self.layer_ema = dict(state["layer_ema"])
        self.vanishing_run = state["vanishing_run"]
        self.conditions.load_state_dict(state["conditions"])
