"""What a pre-flight check returns: pydantic models, so a report serialises to JSON and back."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from wbdebug.events import Event

CheckName = Literal["overfit", "initial_loss", "data"]

#: Prefix of the W&B keys a check writes (kept beside the checks until ``keys.py`` takes them over).
KEY_PREFIX = "wbdebug/check"


def has_error(events: list[Event]) -> bool:
    """A check fails exactly when it raised an error-level event; warnings are reported, not gating."""
    return any(e.severity == "error" and not e.cleared for e in events)


class CheckResult(BaseModel):
    """The outcome of one check: passed or not, the events that say why, and its measurements."""

    model_config = ConfigDict(ser_json_inf_nan="constants")  # a diverged loss curve survives a JSON round trip

    name: CheckName
    passed: bool
    summary: str = Field(description="One line: what was measured and the verdict.")
    events: list[Event] = Field(default_factory=list)
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Measured numbers, e.g. initial_loss, expected, final_loss, target."
    )
    loss_curve: list[float] = Field(default_factory=list, description="Loss per step (the overfit check only).")


class Report(BaseModel):
    """Every check of one :func:`wbdebug.preflight` (or ``wbdebug check``) run."""

    checks: list[CheckResult]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def events(self) -> list[Event]:
        return [e for c in self.checks for e in c.events]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def loss_curve(self) -> list[float]:
        """The overfit check's loss per step (empty when it did not run)."""
        return next((c.loss_curve for c in self.checks if c.name == "overfit"), [])

    def check(self, name: CheckName) -> CheckResult | None:
        """The result of the check called ``name``, if it ran."""
        return next((c for c in self.checks if c.name == name), None)

    def summary_metrics(self) -> dict[str, float]:
        """Flat numbers for a W&B run summary or a sweep's metric: ``wbdebug/check/<check>/<metric>``."""
        out: dict[str, float] = {f"{KEY_PREFIX}/passed": float(self.passed)}
        for c in self.checks:
            out[f"{KEY_PREFIX}/{c.name}/passed"] = float(c.passed)
            out.update({f"{KEY_PREFIX}/{c.name}/{k}": v for k, v in c.metrics.items()})
        return out
