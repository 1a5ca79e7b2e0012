"""W&B sink: metrics against wbdebug's own step metric and an events table; W&B's alert channel (run.alert)."""

from __future__ import annotations

import netrc
import os
from typing import Any
from urllib.parse import urlparse

from wbdebug import keys
from wbdebug.alerts import TITLE_LIMIT, Alert
from wbdebug.events import Event

_LEVELS = {"info": "INFO", "warning": "WARN", "error": "ERROR"}
__all__ = ["TITLE_LIMIT", "WandbAlerts", "WandbSink", "has_api_key", "start_run"]


def has_api_key() -> bool:
    """True when wandb would find credentials without prompting (env var, identity token, or netrc)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def start_run(project: str, mode: str = "auto", **init_kwargs: Any):
    """Start a W&B run that can never block on a login prompt.

    ``auto`` honours ``WANDB_MODE`` when set, else runs online only with configured credentials and
    offline otherwise (upload later with ``wandb sync``). wandb's own default would raise
    ``UsageError`` or, on a terminal, wait for a key.
    """
    import wandb

    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
    if mode == "dryrun":
        mode = "offline"
    return wandb.init(project=project, mode=mode, **init_kwargs)


class WandbSink:
    """Writes to one W&B run; finishes it at close() only if wbdebug started it. Alerts: :class:`WandbAlerts`."""

    def __init__(self, run: Any, *, owns_run: bool) -> None:
        self.run = run
        self.owns_run = owns_run
        run.define_metric(keys.STEP, hidden=True)
        run.define_metric(f"{keys.PREFIX}/*", step_metric=keys.STEP)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # Never pass step= : the user's own wandb.log calls keep their steps, and wandb holds rows with explicit steps.
        self.run.log({**metrics, keys.STEP: step})

    def emit(self, event: Event) -> None:
        pass  # events reach W&B as alerts (WandbAlerts, under the shared policy) and as the table at close()

    def close(self, events: list[Event]) -> None:
        import wandb

        columns = ["step", "severity", "kind", "layer", "value", "threshold", "message", "fix", "cleared"]
        rows = [
            [e.step, e.severity, e.kind.value, e.layer or "", e.value, e.threshold, e.message, e.fix, e.cleared]
            for e in events
        ]
        last_step = max((e.step for e in events), default=0)
        self.run.log({keys.EVENTS_TABLE: wandb.Table(columns=columns, data=rows), keys.STEP: last_step})
        self.run.summary[keys.EVENT_COUNT] = len([e for e in events if not e.cleared])
        if self.owns_run:
            self.run.finish()


class WandbAlerts:
    """Alert channel: ``run.alert`` per alert; W&B forwards it to Slack / e-mail per the user's W&B settings.

    The policy (which events, cool-down, escalation, recovery) is :class:`~wbdebug.alerts.AlertPolicy`'s:
    the client forwards ``wait_duration`` but does not enforce it (two identical alerts within it are both
    recorded). ``run.alert`` only hands a record to wandb's own service process, so it does not block.
    """

    name = "W&B"

    def __init__(self, run: Any, *, wait_duration_s: float = 300.0) -> None:
        self.run = run
        self.wait_duration_s = wait_duration_s

    def send(self, alert: Alert) -> None:
        import wandb

        self.run.alert(
            title=alert.title,
            text=alert.text(),
            level=getattr(wandb.AlertLevel, _LEVELS[alert.level]),
            wait_duration=max(1, int(self.wait_duration_s)),
        )

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> None:
        pass
