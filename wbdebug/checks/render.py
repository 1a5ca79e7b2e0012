"""A pre-flight report for people: a table of verdicts, then each problem with its fix."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wbdebug.checks.result import Report

_STYLE = {"info": "dim", "warning": "yellow", "error": "bold red"}


def print_report(report: Report, console: Console) -> None:
    """Print the checks' verdicts and every warning/error event with its fix."""
    table = Table(title="wbdebug pre-flight checks", show_lines=False)
    for col in ("check", "result", "details"):
        table.add_column(col)
    for c in report.checks:
        verdict = "[green]passed[/]" if c.passed else "[bold red]FAILED[/]"
        table.add_row(c.name, verdict, escape(c.summary))
    console.print(table)
    for e in report.events:
        if e.severity == "info":
            continue
        where = f" ({escape(e.layer)})" if e.layer else ""
        console.print(f"[{_STYLE[e.severity]}]{e.severity}[/] {e.kind.value}{where}: {escape(e.message)}", soft_wrap=True)
        console.print(f"  [dim]fix:[/] {escape(e.fix)}", soft_wrap=True)
    failed = [c.name for c in report.checks if not c.passed]
    console.print(
        f"[bold red]FAILED: {', '.join(failed)}[/]" if failed else f"[green]PASSED: {len(report.checks)} check(s)[/]"
    )
