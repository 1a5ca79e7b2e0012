"""Sinks: where metrics and events go. One file each, one small protocol; a sink never decides what is wrong."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from wbdebug.events import Event


@runtime_checkable
class Sink(Protocol):
    """What the Monitor calls. Every call is guarded: a sink that raises is reported once and skipped."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One row of metrics at wbdebug's ``step``."""

    def emit(self, event: Event) -> None:
        """One event, as it happens."""

    def close(self, events: list[Event]) -> None:
        """Flush; ``events`` is every event of the run, for summaries."""


from wbdebug.sinks.console import ConsoleSink  # noqa: E402
from wbdebug.sinks.journal import JournalSink, read_journal  # noqa: E402
from wbdebug.sinks.memory import MemorySink  # noqa: E402
from wbdebug.sinks.slack import SlackChannel  # noqa: E402
from wbdebug.sinks.wandb import WandbAlerts, WandbSink, start_run  # noqa: E402
from wbdebug.sinks.webhook import WebhookChannel  # noqa: E402

__all__ = [
    "ConsoleSink", "JournalSink", "MemorySink", "Sink", "SlackChannel", "WandbAlerts", "WandbSink", "WebhookChannel",
    "read_journal", "start_run",
]
