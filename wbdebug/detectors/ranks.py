"""Rank detector: replicas that silently disagree (parameters drifted apart, a rank's loss off on its own)."""

from __future__ import annotations

import statistics

from wbdebug.detectors.base import ConditionTracker, is_finite
from wbdebug.events import Event, EventKind


def diverging_ranks(values: list[float], factor: float) -> list[int]:
    """Ranks whose value is more than ``factor`` × (or under 1/``factor`` ×) the median of all ranks."""
    finite = [v for v in values if is_finite(v)]
    if len(finite) < 2:
        return []
    med = statistics.median(finite)
    if med <= 0:
        return []
    return [r for r, v in enumerate(values) if is_finite(v) and (v > factor * med or v < med / factor)]


def drifted_ranks(param_norms: list[float], tolerance: float) -> list[int]:
    """Ranks whose parameter norm differs from rank 0's by more than ``tolerance`` (relative).

    DDP replicas apply identical averaged gradients, so their parameters stay identical; any
    difference means a replica missed an update or was loaded from another checkpoint.
    """
    ref = param_norms[0]
    if not is_finite(ref):
        return []
    return [r for r, v in enumerate(param_norms) if r and abs(v - ref) > tolerance * max(abs(ref), 1e-12)]


class RankDetector:
    """Raises ``rank_divergence`` once per interval-level incident, on every rank alike."""

    def __init__(self, *, loss_factor: float = 3.0, param_tolerance: float = 1e-4, clear_steps: int = 1) -> None:
        self.loss_factor = loss_factor
        self.param_tolerance = param_tolerance
        self.conditions = ConditionTracker(clear_steps)

    def observe(self, step: int, losses: list[float], grad_norms: list[float], param_norms: list[float]) -> list[Event]:
        """One interval's per-rank means (loss, gradient norm) and current parameter norms."""
        drifted = drifted_ranks(param_norms, self.param_tolerance)
        loss_off = diverging_ranks(losses, self.loss_factor)
        grad_off = diverging_ranks(grad_norms, self.loss_factor)
        ranks = sorted(set(drifted) | set(loss_off) | set(grad_off))
        reasons = []
        if drifted:
            reasons.append(f"parameters differ from rank 0's on rank(s) {drifted}")
        if loss_off:
            reasons.append(f"loss is off the other ranks' median on rank(s) {loss_off}")
        if grad_off:
            reasons.append(f"gradient norm is off the other ranks' median on rank(s) {grad_off}")
        return self.conditions.update(
            EventKind.RANK_DIVERGENCE, None, "error" if drifted else ("warning" if ranks else None),
            lambda sev: Event(
                kind=EventKind.RANK_DIVERGENCE, severity=sev, step=step, layer=None,
                value=float(ranks[0]),
                message=f"Replicas disagree at step {step}: " + "; ".join(reasons) + ".",
            ),
            step=step, clear_message=f"All ranks agree again at step {step}.",
        )

    def state_dict(self) -> dict:
        return {"conditions": self.conditions.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.conditions.load_state_dict(state["conditions"])
