"""Slack alert channel: Block Kit messages to an incoming webhook, sent off the training thread.

For teams that want alerts in Slack without W&B's routing (or while offline). Alerts raised at the same
step are one incident and one message (a NaN loss and the NaN gradients it causes); the retries, bounds
and secrecy of the URL are :class:`~wbdebug.sinks.webhook.Delivery`'s.
"""

from __future__ import annotations

from typing import Any, Hashable

from pydantic import SecretStr

from wbdebug.alerts import Alert
from wbdebug.events import SEVERITY_RANK
from wbdebug.sinks.webhook import Delivery

ICONS = {"error": ":red_circle:", "warning": ":warning:", "info": ":information_source:"}
RECOVERED_ICON = ":large_green_circle:"
_HEADER_LIMIT = 150  # Block Kit: header text
_TEXT_LIMIT = 2900  # Block Kit: section text is 3000


def icon(alert: Alert) -> str:
    return RECOVERED_ICON if alert.reason == "recovered" else ICONS[alert.level]


def esc(text: str) -> str:
    """Escape Slack mrkdwn's control characters (names and messages are not markup)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _section(text: str) -> dict:
    return {"type": "section", "text": {"type": "mrkdwn", "text": _cut(text, _TEXT_LIMIT)}}


def _headline(alert: Alert) -> str:
    e = alert.event
    tag = {"recovered": " recovered", "reminder": " still active", "escalation": " escalated"}.get(alert.reason, "")
    return f"{icon(alert)} {e.kind.value}" + (f" in {e.layer}" if e.layer else "") + tag


def _run_link(alert: Alert) -> str:
    run = alert.run
    if run.url:
        return f"<{run.url}|{esc(run.name or 'W&B run')}>"
    if run.path:
        return f"offline run `{esc(run.path)}` — upload it with `wandb sync {esc(run.path)}`"
    return f"no W&B run (host `{esc(run.host)}`)"


def slack_message(alerts: list[Alert]) -> dict[str, Any]:
    """The Block Kit payload for one incident: the worst alert in full, the others of its step below it.

    Header (kind, layer), the message, fields (kind, severity, step, layer, value vs threshold, run), the
    metric's recent values, the fix, and a context line linking the W&B run (or naming the offline run).
    """
    alerts = sorted(alerts, key=lambda a: -SEVERITY_RANK[a.level])
    main, others = alerts[0], alerts[1:]
    e = main.event
    blocks: list[dict] = [
        {"type": "header", "text": {"type": "plain_text", "text": _cut(_headline(main), _HEADER_LIMIT), "emoji": True}},
        _section(esc(e.message) + (f"\n_{esc(main.status())}_" if main.status() else "")),
    ]
    fields = [f"*Kind*\n`{e.kind.value}`", f"*Severity*\n{'recovered' if main.reason == 'recovered' else e.severity}",
              f"*Step*\n{e.step}", f"*Layer*\n`{esc(e.layer)}`" if e.layer else "*Layer*\n—"]
    value = main.value_line()
    if value and main.reason != "recovered":
        fields.append(f"*Value*\n{value}")
    fields.append(f"*Run*\n{esc(main.run.name) if main.run.name else '—'}")
    blocks.append({"type": "section", "fields": [{"type": "mrkdwn", "text": _cut(f, 1900)} for f in fields]})
    recent = main.recent_line()
    if recent:
        blocks.append(_section(f"*Recent `{esc(main.metric or '')}`* (logged rows): {recent}"))
    if main.reason != "recovered" and e.fix:
        blocks.append(_section(f"*Fix:* {esc(e.fix)}"))
    if others:
        blocks.append({"type": "divider"})
        lines = []
        for other in others[:10]:
            o = other.event
            where = f" in `{esc(o.layer)}`" if o.layer else ""
            line = f"{icon(other)} *{o.kind.value}*{where}: {esc(o.message)}"
            if other.reason != "recovered" and o.fix:
                line += f"\n*Fix:* {esc(o.fix)}"
            lines.append(line)
        if len(others) > 10:
            lines.append(f"…and {len(others) - 10} more.")
        blocks.append(_section(f"*Also at step {e.step}:*\n" + "\n".join(lines)))
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _cut(f"wbdebug · {_run_link(main)}", 2900)}]})
    fallback = main.title + (f" (+{len(others)} more)" if others else "")
    return {"text": fallback, "blocks": blocks}


class SlackChannel(Delivery):
    """Sends alerts to a Slack incoming webhook as Block Kit, one message per incident.

    Alerts of the same step that arrive within ``group_s`` (1 s) of the first are one message (close()
    and flush() take what is already queued without waiting).
    """

    name = "Slack"

    def __init__(self, url: SecretStr | str, *, group_s: float = 1.0, **options: Any) -> None:
        options.setdefault("setting", "slack_webhook_url")
        super().__init__(url, group_s=group_s, **options)

    def render(self, alerts: list[Alert]) -> dict:
        return slack_message(alerts)

    def group_key(self, alert: Alert) -> Hashable:
        return alert.event.step
