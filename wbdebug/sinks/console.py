"""Console sink: one readable line per event as it happens, a summary table at close()."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wbdebug.events import SEVERITY_RANK, Event

_STYLE = {"info": "dim", "warning": "yellow", "error": "bold red"}


class ConsoleSink:
    """Prints to stderr so it never mixes with a program's own output."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def emit(self, event: Event) -> None:
        style = _STYLE[event.severity]
        self.console.print(f"[{style}]wbdebug {escape(event.headline())}[/]: {escape(event.message)}", soft_wrap=True)
        if not event.cleared and event.severity != "info":
            self.console.print(f"  [dim]fix:[/] {escape(event.fix)}", soft_wrap=True)

    def close(self, events: list[Event]) -> None:
        self.console.print(summary_table(events))


def summary_table(events: list[Event]) -> Table:
    """One row per (kind, layer): severity, first step, how many events."""
    table = Table(title="wbdebug health summary", show_lines=False)
    for col in ("kind", "layer", "worst", "first step", "events"):
        table.add_column(col)
    rows: dict[tuple[str, str], list] = {}
    for e in events:
        if e.cleared:
            continue
        key = (e.kind.value, e.layer or "")
        row = rows.setdefault(key, [e.severity, e.step, 0])
        if SEVERITY_RANK[e.severity] > SEVERITY_RANK[row[0]]:
            row[0] = e.severity
        row[2] += 1
    if not rows:
        table.add_row("healthy: no events", "", "", "", "")
    for (kind, layer), (sev, first, count) in rows.items():
        table.add_row(escape(kind), escape(layer), f"[{_STYLE[sev]}]{sev}[/]", str(first), str(count))
    return table
