"""W&B sink: metrics against wbdebug's own step metric, alerts for warnings and errors, an events table."""

from __future__ import annotations

import netrc
import os
import time
from typing import Any
from urllib.parse import urlparse

from wbdebug import keys
from wbdebug.events import Event

TITLE_LIMIT = 64  # W&B's limit on alert titles
_LEVELS = {"info": "INFO", "warning": "WARN", "error": "ERROR"}


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
    """Writes to one W&B run; finishes it at close() only if wbdebug started it."""

    def __init__(self, run: Any, *, owns_run: bool, alerts: bool = True, alert_cooldown_s: float = 300.0) -> None:
        self.run = run
        self.owns_run = owns_run
        self.alerts = alerts
        self.alert_cooldown_s = alert_cooldown_s
        self._last_alert: dict[tuple[str, str | None], float] = {}
        run.define_metric(keys.STEP, hidden=True)
        run.define_metric(f"{keys.PREFIX}/*", step_metric=keys.STEP)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # Never pass step= : the user's own wandb.log calls keep their steps, and wandb holds rows with explicit steps.
        self.run.log({**metrics, keys.STEP: step})

    def emit(self, event: Event) -> None:
        if not self.alerts or event.severity == "info":
            return
        key = (event.kind.value, event.layer)
        now = time.monotonic()
        last = self._last_alert.get(key)
        if last is not None and now - last < self.alert_cooldown_s:
            return  # the client forwards wait_duration but does not enforce it
        self._last_alert[key] = now
        import wandb

        self.run.alert(
            title=alert_title(event, getattr(self.run, "name", None)),
            text=alert_text(event),
            level=getattr(wandb.AlertLevel, _LEVELS[event.severity]),
            wait_duration=int(self.alert_cooldown_s),
        )

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


def alert_title(event: Event, run_name: str | None = None) -> str:
    """``wbdebug: <kind> in <layer> (<run>)``, cut to W&B's 64 characters."""
    title = f"wbdebug: {event.kind.value}" + (f" in {event.layer}" if event.layer else "")
    if run_name:
        title += f" ({run_name})"
    return title if len(title) <= TITLE_LIMIT else title[: TITLE_LIMIT - 1] + "…"


def alert_text(event: Event) -> str:
    lines = [event.message, f"step: {event.step}"]
    if event.value is not None:
        lines.append(f"value: {event.value:.4g}" + (f" (threshold {event.threshold:.4g})" if event.threshold is not None else ""))
    lines.append(f"fix: {event.fix}")
    return "\n".join(lines)
