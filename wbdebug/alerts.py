"""Alerts: which events reach people, how often, and what the message says.

One :class:`AlertPolicy` (pure Python over events and a clock, no I/O) decides; one :class:`AlertSink`
applies it once per event and hands every resulting :class:`Alert` to each channel — W&B's
``run.alert``, Slack, a generic webhook — so every channel sends the same alerts at the same moments.
A channel never decides what is worth sending, and never makes the training step wait on the network.
"""

from __future__ import annotations

import math
import socket
import time
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Protocol

from wbdebug import keys
from wbdebug.events import SEVERITY_RANK, Event, EventKind, Severity

TITLE_LIMIT = 64  # W&B's limit on alert titles

#: Kinds whose warnings alert by default; errors of every kind alert too (``alert_all_errors``).
DEFAULT_ALERT_KINDS: tuple[EventKind, ...] = (
    EventKind.NONFINITE_LOSS,
    EventKind.NONFINITE_GRAD,
    EventKind.EXPLODING_GRADIENTS,
    EventKind.VANISHING_GRADIENTS,
    EventKind.DEAD_ACTIVATIONS,
    EventKind.LOSS_SPIKE,
    EventKind.INITIAL_LOSS,
)

#: Kinds whose detectors report the end of the condition (an ``info`` event with ``cleared=True``):
#: only these can be "still active" (reminders) or "recovered". The others are one-off diagnoses.
CLEARING_KINDS = frozenset({
    EventKind.NONFINITE_LOSS,
    EventKind.NONFINITE_GRAD,
    EventKind.EXPLODING_GRADIENTS,
    EventKind.VANISHING_GRADIENTS,
    EventKind.DEAD_ACTIVATIONS,
    EventKind.LOSS_SPIKE,
    EventKind.RANK_DIVERGENCE,
    EventKind.AMP_OVERFLOW,
})

#: The kinds ``on_nonfinite`` acts on.
NONFINITE_KINDS = frozenset({EventKind.NONFINITE_LOSS, EventKind.NONFINITE_GRAD})

Reason = Literal["new", "escalation", "reminder", "recovered"]
_TAGS: dict[str, str] = {"new": "", "escalation": "escalated", "reminder": "still active", "recovered": "recovered"}


class TrainingHealthError(RuntimeError):
    """Raised from ``optimizer.step()`` under ``on_nonfinite="raise"``, once the alert has been sent.

    ``event`` is the :class:`~wbdebug.Event` that stopped training.
    """

    def __init__(self, event: Event) -> None:
        self.event = event
        super().__init__(
            f"wbdebug stopped training (on_nonfinite='raise'): {event.headline()}: {event.message} Fix: {event.fix}"
        )


# ---------------------------------------------------------------------------------------- content
@dataclass(frozen=True)
class RunRef:
    """Where an alert points: the W&B run's name and URL when online, its directory when offline."""

    name: str | None = None
    url: str | None = None
    path: str | None = None
    host: str = field(default_factory=socket.gethostname)

    @classmethod
    def of(cls, run: Any) -> "RunRef":
        """The reference for a W&B run (or ``None``: no run, only the host)."""
        if run is None:
            return cls()
        name = getattr(run, "name", None) or getattr(run, "id", None)
        mode = getattr(getattr(run, "settings", None), "mode", None)
        offline = mode in ("offline", "dryrun") or bool(getattr(run, "offline", False))
        url = None if offline else (getattr(run, "url", None) or None)
        run_dir = getattr(run, "dir", None)
        path = str(Path(run_dir).parent) if run_dir else None
        return cls(name=str(name) if name else None, url=url, path=path)

    def describe(self) -> str:
        """One line: the run's URL online; offline, its directory and the command that uploads it."""
        if self.url:
            return self.url
        if self.path:
            return f"offline run {self.path} (upload: wandb sync {self.path})"
        return f"no W&B run (host {self.host})"


def metric_of(event: Event) -> str | None:
    """The logged metric key whose recent values explain ``event``."""
    kind = event.kind
    if kind in (EventKind.NONFINITE_LOSS, EventKind.LOSS_SPIKE, EventKind.INITIAL_LOSS):
        return keys.LOSS
    if kind in (EventKind.NONFINITE_GRAD, EventKind.EXPLODING_GRADIENTS):
        return keys.GRAD_NORM_TOTAL
    if kind == EventKind.VANISHING_GRADIENTS and event.layer:
        return keys.grad_norm(event.layer)
    if kind == EventKind.DEAD_ACTIVATIONS and event.layer:
        return keys.act_zero_frac(event.layer)
    return None


#: Kinds whose event value is the metric itself (so it can close the series of recent values).
_VALUE_IS_METRIC = frozenset({
    EventKind.NONFINITE_LOSS, EventKind.LOSS_SPIKE, EventKind.INITIAL_LOSS, EventKind.EXPLODING_GRADIENTS,
    EventKind.VANISHING_GRADIENTS,
})


def fmt(x: float | None) -> str:
    """A number for people: 4 significant digits, nan/inf spelled out."""
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


@dataclass(frozen=True)
class Alert:
    """One message to people about one event: a new condition, its escalation, a reminder, or its recovery."""

    event: Event
    reason: Reason = "new"
    #: the step the monitor had reached when the alert was made (later than ``event.step`` for reminders).
    step: int = 0
    #: the first step of the incident (the condition's first alerted event).
    since_step: int | None = None
    #: events of this kind folded into this alert since the previous one (cool-down).
    suppressed: int = 0
    #: the warning this error escalates (same kind, or another kind still active).
    escalated_from: Event | None = None
    run: RunRef = field(default_factory=RunRef)
    metric: str | None = None
    #: the metric's last logged values, (step, value), oldest first.
    recent: tuple[tuple[int, float], ...] = ()

    @property
    def level(self) -> Severity:
        return "info" if self.reason == "recovered" else self.event.severity

    @property
    def title(self) -> str:
        """``wbdebug: <kind> in <layer> [<tag>] (<run>)``, at most 64 characters (W&B's limit)."""
        return alert_title(self.event.kind.value, self.event.layer, _TAGS[self.reason], self.run.name)

    def status(self) -> str | None:
        """The line that says why this alert is sent now, when it is not a plain new condition."""
        e = self.event
        if self.reason == "recovered":
            return f"recovered at step {e.step}" + (f" (active since step {self.since_step})" if self.since_step is not None else "")
        parts = []
        if self.reason == "reminder":
            parts.append(f"still active at step {self.step}, since step {self.since_step}")
        if self.escalated_from is not None:
            f = self.escalated_from
            if f.kind == e.kind:
                parts.append(f"escalated from {f.severity} (step {f.step}) to {e.severity}")
            else:
                parts.append(f"escalated from {f.kind.value} ({f.severity}, step {f.step})")
        if self.suppressed:
            parts.append(f"{self.suppressed} more {e.kind.value} event(s) since the last alert")
        return "; ".join(parts) or None

    def value_line(self) -> str | None:
        e = self.event
        if e.value is None:
            return None
        return fmt(e.value) + (f" (threshold {fmt(e.threshold)})" if e.threshold is not None else "")

    def recent_line(self) -> str | None:
        if not self.metric or not self.recent:
            return None
        return ", ".join(f"{fmt(v)} @{s}" for s, v in self.recent)

    def text(self) -> str:
        """The plain-text body (W&B alerts, webhooks): message, step, value, recent values, fix, run."""
        e = self.event
        lines = [e.message]
        status = self.status()
        if status:
            lines.append(status)
        lines.append(f"step: {e.step}")
        if e.layer:
            lines.append(f"layer: {e.layer}")
        value = self.value_line()
        if value and self.reason != "recovered":
            lines.append(f"value: {value}")
        recent = self.recent_line()
        if recent:
            lines.append(f"recent {self.metric}: {recent}")
        if self.reason != "recovered" and e.fix:
            lines.append(f"fix: {e.fix}")
        lines.append(f"run: {self.run.describe()}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the event itself plus why and where (the generic webhook's payload)."""
        return {
            "source": "wbdebug",
            "reason": self.reason,
            "level": self.level,
            "title": self.title,
            "text": self.text(),
            "step": self.step,
            "since_step": self.since_step,
            "suppressed": self.suppressed,
            "escalated_from": self.escalated_from.model_dump(mode="json") if self.escalated_from else None,
            "metric": self.metric,
            "recent": [[s, v if math.isfinite(v) else str(v)] for s, v in self.recent],
            "run": {"name": self.run.name, "url": self.run.url, "path": self.run.path, "host": self.run.host},
            "event": self.event.model_dump(mode="json"),
        }


def alert_title(kind: str, layer: str | None = None, tag: str = "", run_name: str | None = None) -> str:
    """``wbdebug: <kind> in <layer> <tag> (<run>)`` within W&B's 64 characters.

    The kind always survives; a long run name, then a long layer name (keeping its tail, the most
    specific part), are shortened first.
    """

    def build(layer: str | None, run: str | None) -> str:
        title = f"wbdebug: {kind}" + (f" in {layer}" if layer else "") + (f" {tag}" if tag else "")
        return title + (f" ({run})" if run else "")

    def head(name: str | None, n: int) -> str | None:
        return name if name is None or len(name) <= n else name[: n - 1] + "…"

    def tail(name: str | None, n: int) -> str | None:
        return name if name is None or len(name) <= n else "…" + name[-(n - 1):]

    title = build(layer, run_name)
    if len(title) <= TITLE_LIMIT:
        return title
    run_name = head(run_name, 16)
    for n in range(len(layer or ""), 4, -1):  # the layer's tail is its most specific part
        title = build(tail(layer, n), run_name)
        if len(title) <= TITLE_LIMIT:
            return title
    layer = tail(layer, 5)
    for n in range(16, 6, -1):
        title = build(layer, head(run_name, n))
        if len(title) <= TITLE_LIMIT:
            return title
    return title if len(title) <= TITLE_LIMIT else title[: TITLE_LIMIT - 1] + "…"


# ----------------------------------------------------------------------------------------- policy
@dataclass
class _KindState:
    since_step: int
    severity: Severity
    last_event: Event
    last_sent: float
    told_active: bool
    active: set = field(default_factory=set)  # layers whose condition is active (None: the whole model)
    suppressed: int = 0


class AlertPolicy:
    """Decides which events become alerts, and when a quiet condition deserves a reminder.

    - An event alerts when its severity is at least ``min_severity`` and its kind is in ``kinds``, or
      it is an error and ``all_errors``.
    - The same kind alerts at most once per ``cooldown_s``: a condition that flaps (fires, clears, fires
      …) sends one alert, one "recovered", and then nothing until the cool-down has passed; an alert
      sent after it says how many events it folds in.
    - A warning that becomes an error is sent at once (same kind: the cool-down does not hold it back)
      and says what it escalates from (e.g. a loss spike turning into a NaN).
    - When every condition of an alerted kind has cleared, one "recovered" alert (``recovered``).
    - A condition still active ``reminder_s`` after its last alert is alerted again (0: never); one that
      came back during the cool-down is alerted once the cool-down ends (:meth:`due`).
    """

    def __init__(
        self,
        *,
        kinds: Iterable[EventKind | str] = DEFAULT_ALERT_KINDS,
        min_severity: Severity = "warning",
        all_errors: bool = True,
        cooldown_s: float = 300.0,
        reminder_s: float = 3600.0,
        recovered: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kinds = frozenset(EventKind(k) for k in kinds)
        self.min_severity = min_severity
        self.all_errors = all_errors
        self.cooldown_s = cooldown_s
        self.reminder_s = reminder_s
        self.recovered = recovered
        self.clock = clock
        self._state: dict[EventKind, _KindState] = {}

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "AlertPolicy":
        """The policy a :class:`~wbdebug.Config` describes."""
        return cls(
            kinds=config.alert_kinds, min_severity=config.alert_min_severity, all_errors=config.alert_all_errors,
            cooldown_s=config.alert_cooldown_s, reminder_s=config.alert_reminder_s,
            recovered=config.alert_recovered, **overrides,
        )

    def wants(self, event: Event) -> bool:
        """Whether ``event`` (a condition starting or worsening) is worth an alert at all."""
        if event.cleared or SEVERITY_RANK[event.severity] < max(1, SEVERITY_RANK[self.min_severity]):
            return False
        return event.kind in self.kinds or (self.all_errors and event.severity == "error")

    def admit(self, event: Event) -> Alert | None:
        """The alert ``event`` calls for now, or None (not wanted, or held back by the cool-down)."""
        now = self.clock()
        st = self._state.get(event.kind)
        if event.cleared:
            return self._cleared(event, st)
        if not self.wants(event):
            return None
        clears = event.kind in CLEARING_KINDS
        if st is None:
            st = self._state[event.kind] = _KindState(
                since_step=event.step, severity=event.severity, last_event=event, last_sent=-math.inf,
                told_active=False,
            )
        if clears:
            st.active.add(event.layer)
        previous = st.last_event
        st.last_event = event
        cooled = now - st.last_sent >= self.cooldown_s
        if not st.told_active and cooled:  # a fresh incident
            st.since_step, st.severity = event.step, event.severity
        elif SEVERITY_RANK[event.severity] > SEVERITY_RANK[st.severity]:
            # Worse than anything said about this incident: news, whatever the cool-down.
            st.severity = event.severity
            return self._send(st, event, "escalation", now, escalated_from=previous)
        elif not cooled:
            st.suppressed += 1
            return None
        source = self._open_warning(event)
        return self._send(st, event, "escalation" if source else "new", now, escalated_from=source)

    def due(self, step: int) -> list[Alert]:
        """Alerts owed without a new event: reminders, and conditions that came back during a cool-down."""
        if not self._state:
            return []
        now = self.clock()
        out = []
        for st in self._state.values():
            if not st.active or now - st.last_sent < self.cooldown_s:
                continue
            if not st.told_active:
                st.since_step = st.last_event.step
                out.append(self._send(st, st.last_event, "new", now, step=step))
            elif self.reminder_s > 0 and now - st.last_sent >= self.reminder_s:
                out.append(self._send(st, st.last_event, "reminder", now, step=step))
        return out

    def _cleared(self, event: Event, st: _KindState | None) -> Alert | None:
        if st is None or not st.active:
            return None
        if event.layer is None:
            st.active.clear()
        else:
            st.active.discard(event.layer)
        if st.active or not st.told_active:
            return None
        st.told_active = False
        st.suppressed = 0
        if not self.recovered:
            return None
        return Alert(event=event, reason="recovered", step=event.step, since_step=st.since_step)

    def _open_warning(self, event: Event) -> Event | None:
        """For an error: another kind's warning that is still active (the spike before a NaN)."""
        if event.severity != "error":
            return None
        for kind, st in self._state.items():
            if kind != event.kind and st.told_active and st.severity == "warning":
                return st.last_event
        return None

    def _send(
        self, st: _KindState, event: Event, reason: Reason, now: float, *,
        escalated_from: Event | None = None, step: int | None = None,
    ) -> Alert:
        alert = Alert(
            event=event, reason=reason, step=event.step if step is None else step, since_step=st.since_step,
            suppressed=st.suppressed, escalated_from=escalated_from,
        )
        st.last_sent, st.suppressed = now, 0
        st.told_active = event.kind in CLEARING_KINDS and bool(st.active)
        return alert


# ---------------------------------------------------------------------------------------- channels
class AlertChannel(Protocol):
    """Where alerts go (W&B, Slack, a webhook). ``send`` must return at once; delivery may lag."""

    name: str

    def send(self, alert: Alert) -> None:
        """Queue or send one alert; never blocks on the network."""

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for queued alerts; True when none is left."""

    def close(self, timeout: float) -> None:
        """Deliver what is queued within ``timeout`` seconds, then stop."""


class AlertSink:
    """The sink that applies one :class:`AlertPolicy` and fans each alert out to every channel.

    It also keeps the last few logged values of each metric (no extra device sync: they are the rows
    already read back for W&B), so an alert can show the loss or gradient norm leading up to the event.
    """

    def __init__(
        self,
        policy: AlertPolicy,
        channels: list[AlertChannel],
        *,
        run: RunRef | None = None,
        flush_s: float = 10.0,
        recent: int = 5,
    ) -> None:
        self.policy = policy
        self.channels = list(channels)
        self.run = run or RunRef()
        self.flush_s = flush_s
        self.sent: list[Alert] = []  # bounded below: alerts are rare by construction, but runs are long
        self._recent: dict[str, deque[tuple[int, float]]] = {}
        self._recent_len = recent
        self._step = 0
        self._failed: set[str] = set()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._step = step
        for key, value in metrics.items():
            window = self._recent.get(key)
            if window is None:
                window = self._recent[key] = deque(maxlen=self._recent_len)
            window.append((step, value))
        self._dispatch(self.policy.due(step))

    def emit(self, event: Event) -> None:
        self._step = max(self._step, event.step)
        alert = self.policy.admit(event)
        self._dispatch(([alert] if alert else []) + self.policy.due(self._step))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default ``flush_s``, for all channels together) for queued alerts."""
        deadline = time.monotonic() + (self.flush_s if timeout is None else timeout)
        ok = True
        for channel in self.channels:
            ok = channel.flush(max(0.0, deadline - time.monotonic())) and ok
        return ok

    def close(self, events: list[Event]) -> None:
        deadline = time.monotonic() + self.flush_s
        for channel in self.channels:
            channel.close(max(0.0, deadline - time.monotonic()))

    def _dispatch(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            e = alert.event
            metric = metric_of(e)
            recent = list(self._recent.get(metric, ())) if metric else []
            if (e.kind in _VALUE_IS_METRIC and e.value is not None and alert.reason != "recovered"
                    and (not recent or recent[-1][0] < e.step)):
                recent.append((e.step, e.value))  # the event's own step, not logged yet
            alert = replace(alert, run=self.run, metric=metric, recent=tuple(recent[-self._recent_len:]))
            self.sent.append(alert)
            if len(self.sent) > 1000:
                del self.sent[:500]
            for channel in self.channels:
                try:
                    channel.send(alert)
                except Exception as exc:  # noqa: BLE001 - one broken channel must not silence the others
                    if channel.name not in self._failed:
                        self._failed.add(channel.name)
                        warnings.warn(
                            f"wbdebug: the {channel.name} alert channel failed ({type(exc).__name__}); "
                            "its alerts are skipped, the other channels go on.", RuntimeWarning, stacklevel=2,
                        )


def http_channels(config: Any) -> list[AlertChannel]:
    """The Slack and webhook channels ``config`` asks for (none when alerts are off).

    Built before anything else is opened: a malformed URL raises ``ValueError`` here (without quoting it).
    """
    if not config.alerts:
        return []
    from wbdebug.sinks.slack import SlackChannel
    from wbdebug.sinks.webhook import WebhookChannel

    options = dict(
        timeout_s=config.alert_timeout_s, retry_s=config.alert_retry_s, backoff_s=config.alert_backoff_s,
        backoff_max_s=config.alert_backoff_max_s, flush_s=config.alert_flush_s, queue_size=config.alert_queue_size,
    )
    channels: list[AlertChannel] = []
    if config.slack_webhook_url is not None:
        channels.append(SlackChannel(config.slack_webhook_url, **options))
    if config.webhook_url is not None:
        channels.append(WebhookChannel(config.webhook_url, **options))
    return channels
