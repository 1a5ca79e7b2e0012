"""The ``wbdebug`` command: a thin typer layer over the library."""

from __future__ import annotations

import os
from typing import Optional

import typer

app = typer.Typer(
    name="wbdebug",
    help="Find the deep-learning bugs that don't crash: watch a training run, run pre-flight checks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str) -> None:
    """Exit with one line on stderr and status 2 (bad input), like other Python CLIs."""
    typer.echo(f"wbdebug: error: {message}", err=True)
    raise typer.Exit(2)


@app.callback()
def main() -> None:
    """wbdebug: the systematic training-debugging protocol, running itself."""


@app.command()
def demo(
    bug: Optional[str] = typer.Option(
        None, "--bug", help="Inject one of the seed's bugs: lr, dead_relu, init, nan, spike."
    ),
    steps: int = typer.Option(300, "--steps", min=1, help="Training steps."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    recover: bool = typer.Option(
        False, "--recover", help="Roll back past spikes and NaN (on_spike/on_nonfinite=rollback)."
    ),
    replay: bool = typer.Option(
        False, "--replay", help="Replay the first non-finite batch to name the operation and source line."
    ),
) -> None:
    """Train a small classifier on scikit-learn's digits with wbdebug watching, and print its health."""
    from wbdebug.demo import BUGS, run_demo

    if bug is not None and bug not in BUGS:
        fail(f"unknown bug {bug!r}; expected one of: {', '.join(BUGS)}")
    os.environ.setdefault("WANDB_SILENT", "true")
    typer.echo(f"wbdebug demo: digits MLP, {steps} steps" + (f", bug: {bug} ({BUGS[bug]})" if bug else ", healthy"))
    settings: dict = {}
    if recover:
        settings.update(on_spike="rollback", on_nonfinite="rollback")
    if replay:
        settings["nan_forensics"] = "replay"
    result = run_demo(bug, steps=steps, seed=seed, **settings)
    monitor = result.monitor
    typer.echo("loss every 25 steps: " + "  ".join(
        f"{i}:{loss:.3g}" for i, loss in enumerate(result.losses) if i % 25 == 0 or i == len(result.losses) - 1
    ))
    if monitor.skipped_steps:
        typer.echo(f"skipped (rolled back) steps: {monitor.skipped_steps[0]}-{monitor.skipped_steps[-1]}")
    problems = [e for e in monitor.events if e.severity != "info"]
    typer.echo(f"{len(problems)} warning/error event(s)." if problems else "Healthy: no warning or error events.")
    run = monitor.run
    if run is not None:
        run_dir = os.path.dirname(run.dir.rstrip("/"))
        typer.echo(f"W&B run directory: {run_dir}")
        if getattr(run.settings, "mode", "") == "offline" or getattr(run, "offline", False):
            typer.echo(f"Upload it with:  wandb sync {run_dir}")
    if monitor.journal_path is not None:
        typer.echo(f"Event journal:     {monitor.journal_path}")


if __name__ == "__main__":
    app()
