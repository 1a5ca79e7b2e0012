"""Loss detectors: non-finite loss, loss spikes, and the step-0 loss check (seed steps 2 and the spike follow-up)."""

from __future__ import annotations

import math

from wbdebug import keys
from wbdebug.detectors.base import ConditionTracker, RollingWindow, StepStats, is_finite
from wbdebug.events import Event, EventKind, Severity

#: Loss families whose uninformed-model loss we know.
CROSS_ENTROPY = "cross_entropy"
BINARY_CROSS_ENTROPY = "binary_cross_entropy"


def initial_loss_expected(loss_family: str | None, num_classes: int | None) -> float | None:
    """Loss of a model that predicts uniformly: log C for cross-entropy, log 2 for binary cross-entropy."""
    if loss_family == CROSS_ENTROPY and num_classes is not None and num_classes >= 2:
        return math.log(num_classes)
    if loss_family == BINARY_CROSS_ENTROPY:
        return math.log(2.0)
    return None


def initial_loss_severity(measured: float, expected: float, warn_ratio: float, error_ratio: float) -> Severity | None:
    """Judge a first loss against the uninformed one.

    Above: ``warn_ratio``× is a warning, ``error_ratio``× an error (the seed: 45 for log 10 = 2.3 is broken,
    15 % above is a normal imperfect init). Below ``1/error_ratio`` is only a warning: the model already
    "knows" the answer, which is leakage or a wrong loss, or a run resumed from a checkpoint.
    """
    ratio = measured / expected
    if ratio >= error_ratio:
        return "error"
    if ratio >= warn_ratio or ratio <= 1.0 / error_ratio:
        return "warning"
    return None


class LossDetector:
    """Raises ``nonfinite_loss``, ``loss_spike`` and ``initial_loss``."""

    def __init__(
        self,
        *,
        history: int = 50,
        warmup_steps: int = 20,
        spike_factor: float = 2.0,
        spike_tail: float = 3.0,
        spike_min_rise: float = 0.1,
        check_initial: bool = True,
        initial_warn_ratio: float = 1.5,
        initial_error_ratio: float = 3.0,
        clear_steps: int = 10,
    ) -> None:
        self.window = RollingWindow(history)
        self.warmup_steps = warmup_steps
        self.spike_factor = spike_factor
        self.spike_tail = spike_tail
        self.spike_min_rise = spike_min_rise
        self.first_loss: float | None = None
        self.check_initial = check_initial
        self.initial_warn_ratio = initial_warn_ratio
        self.initial_error_ratio = initial_error_ratio
        self.initial_checked = False
        self.conditions = ConditionTracker(clear_steps)
        self.loss_family: str | None = None
        self.num_classes: int | None = None

    def describe_loss(self, loss_family: str | None, num_classes: int | None) -> None:
        """Tell the detector what kind of loss it sees (from the criterion or the model's output)."""
        self.loss_family = loss_family
        self.num_classes = num_classes

    def observe(self, stats: StepStats) -> list[Event]:
        loss = stats.loss
        if loss is None:
            return []
        events: list[Event] = []
        step = stats.step
        finite = is_finite(loss)
        events += self.conditions.update(
            EventKind.NONFINITE_LOSS, None, None if finite else "error",
            lambda sev: Event(
                kind=EventKind.NONFINITE_LOSS, severity=sev, step=step, value=loss,
                layer=_first_nonfinite_layer(stats),
                message=f"The loss is {loss} at step {step}" + _ranks(stats) + _where(stats) + ".",
            ),
            step=step, clear_message=f"The loss is finite again at step {step}.",
        )
        if not finite:
            return events
        if not self.initial_checked:
            self.initial_checked = True
            self.first_loss = loss
            events += self._initial(loss, step)
        events += self._spike(loss, step)
        return events

    def _initial(self, loss: float, step: int) -> list[Event]:
        expected = initial_loss_expected(self.loss_family, self.num_classes)
        if not self.check_initial or expected is None:
            return []
        severity = initial_loss_severity(loss, expected, self.initial_warn_ratio, self.initial_error_ratio)
        if severity is None:
            return []
        what = f"log({self.num_classes})" if self.loss_family == CROSS_ENTROPY else "log(2)"
        return [
            Event(
                kind=EventKind.INITIAL_LOSS, severity=severity, step=step, value=loss, threshold=expected,
                message=(
                    f"The first loss is {loss:.4g}, {loss / expected:.3g}x the {expected:.4g} = {what} "
                    "of a model that predicts uniformly."
                ),
            )
        ]

    def _spike(self, loss: float, step: int) -> list[Event]:
        if len(self.window) < self.warmup_steps:
            self.window.append(loss)
            return []
        median = self.window.median()
        # A spike is also large on the loss's own scale: a converged model's 0.03 -> 0.1 blip is noise.
        rise = self.spike_min_rise * abs(self.first_loss or 0.0)
        threshold = max(self.spike_factor * median, median + rise)
        if loss > threshold or self.conditions.is_active(EventKind.LOSS_SPIKE):  # the full test only when needed
            threshold = max(self.window.jump_threshold(self.spike_factor, self.spike_tail), threshold)
        spiking = loss > threshold
        # A spike must not become its own baseline; a lasting new level enters the window slowly.
        self.window.append(min(loss, threshold))
        return self.conditions.update(
            EventKind.LOSS_SPIKE, None, "warning" if spiking else None,
            lambda sev: Event(
                kind=EventKind.LOSS_SPIKE, severity=sev, step=step, value=loss, threshold=threshold,
                message=(
                    f"The loss jumped to {loss:.4g} at step {step}, {loss / median if median else math.inf:.3g}x "
                    f"its recent median of {median:.4g}."
                ),
            ),
            step=step, clear_message=f"The loss is back under its spike threshold at step {step}.",
        )

    def state_dict(self) -> dict:
        return {
            "window": self.window.state_dict(),
            "initial_checked": self.initial_checked,
            "first_loss": self.first_loss,
            "conditions": self.conditions.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])
        self.initial_checked = state["initial_checked"]
        self.first_loss = state.get("first_loss")
        self.conditions.load_state_dict(state["conditions"])


INPUT = keys.INPUT_NAME


def _first_nonfinite_layer(stats: StepStats) -> str | None:
    """Where non-finite values start: the model's input batch, else the first layer in forward order whose
    activation was non-finite (sampled steps), else the first layer in parameter order whose gradient was."""
    if stats.origin_layer:
        return stats.origin_layer
    if stats.input_nonfinite:
        return INPUT
    for layer, (_, _, nonfinite) in (stats.activations or {}).items():
        if nonfinite:
            return layer
    for layer, norm in stats.grad_layers.items():
        if not is_finite(norm):
            return layer
    return None


def _ranks(stats: StepStats) -> str:
    return f" on rank(s) {stats.nonfinite_ranks}" if stats.nonfinite_ranks else ""


def _where(stats: StepStats) -> str:
    if stats.origin:
        return f"; replay: {stats.origin}"
    layer = _first_nonfinite_layer(stats)
    if layer == INPUT:
        return "; the model's input batch already holds NaN/Inf (a corrupt sample or a broken transform)"
    if layer in stats.measured_at_input:
        return f"; the first non-finite values appear in the input of {layer} (forward order)"
    return f"; the first non-finite values appear in the output of {layer} (forward order)" if layer else ""
