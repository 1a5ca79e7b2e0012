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



def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _positive_int(text: str, option: str) -> int:
    """Parsed here rather than by typer, so a bad value is one line like every other bad input."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        fail(f"{option} must be a positive integer, got {text!r}")
    return value


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def check(
    ctx: typer.Context,
    factory: Optional[str] = typer.Option(
        None, "--factory", help="package.module:function returning a wbdebug.CheckSetup (or a dict of its fields)."
    ),
    which: str = typer.Option("all", "--check", help="Which check: overfit, initial_loss, data or all."),
    steps_text: str = typer.Option("200", "--steps", metavar="N", help="Most overfit-one-batch steps."),
    param: Optional[list[str]] = typer.Option(
        None, "--param", help="key=value passed to the factory; repeatable. Extra --key=value options work too."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks."),
) -> None:
    """Pre-flight checks before the long run: overfit one batch, step-0 loss, data inspection.

    Exit status: 0 all checks passed, 1 a check failed, 2 bad input. Results go to a W&B run (offline
    without an API key). Unknown --key=value options are factory parameters, so the command line
    `wandb agent` builds from a sweep's ${args} works unchanged.
    """
    import json
    import traceback

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from wbdebug.checks import CHECKS, preflight
    from wbdebug.checks.factory import build_setup, parse_params
    from wbdebug.checks.render import print_report
    from wbdebug.checks.sweep import REPORT_ENV

    if factory is None:
        fail("--factory is required; expected package.module:function, e.g. --factory examples.digits:build")
    if which not in (*CHECKS, "all"):
        fail(f"unknown check {which!r}; expected one of: {', '.join(CHECKS)}, all")
    steps = _positive_int(steps_text, "--steps")
    os.environ.setdefault("WANDB_SILENT", "true")
    checks = list(CHECKS) if which == "all" else [which]
    try:
        raw = parse_params(list(param or []) + list(ctx.args))
        setup, params = build_setup(factory, raw)
        err = Console(stderr=True)
        columns = (TextColumn("overfit one batch"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
        with Progress(*columns, console=err, disable="overfit" not in checks) as bar:
            task = bar.add_task("overfit", total=steps, loss="-")

            def progress(done: int, loss: Optional[float]) -> None:
                bar.update(task, completed=done, **({"loss": f"{loss:.4g}"} if loss is not None else {}))

            report = preflight(
                setup.model, setup.train, setup.criterion, setup.optimizer, val=setup.val,
                num_classes=setup.num_classes, checks=checks, steps=steps, progress=progress,
            )
            bar.update(task, total=max(len(report.loss_curve), 1))
        run_dir, offline = _log_check_run(report, {"factory": factory, "check": which, "steps": steps, **params})
    except Exception as exc:  # bad input, or the user's code failing on it: one line unless --verbose
        if verbose:
            traceback.print_exc()
        fail(_one_line(exc) + ("" if verbose else " (--verbose for the traceback)"))
    print_report(report, Console(highlight=False))
    if run_dir:
        typer.echo(f"W&B run directory: {run_dir}")
        if offline:
            typer.echo(f"Upload it with:  wandb sync {run_dir}")
    if os.environ.get(REPORT_ENV):
        with open(os.environ[REPORT_ENV], "w") as f:
            json.dump({"report": report.model_dump(mode="json"), "metrics": report.summary_metrics(),
                       "run_dir": run_dir}, f)
    raise typer.Exit(0 if report.passed else 1)


def _log_check_run(report, config: dict) -> tuple[Optional[str], bool]:
    """Write the report to a W&B run wbdebug starts (unless WBDEBUG_WANDB=false): its directory, and
    whether it is offline."""
    from wbdebug.checks.wandb_log import log_report
    from wbdebug.config import Config
    from wbdebug.sinks.wandb import start_run

    cfg = Config()
    if not cfg.wandb or cfg.wandb_mode == "disabled":
        return None, False
    run = start_run(cfg.wandb_project, cfg.wandb_mode, job_type="preflight", config=config)
    run_dir = os.path.dirname(run.dir.rstrip("/"))
    offline = getattr(run.settings, "mode", "") == "offline"
    log_report(run, report)
    return run_dir, offline


@app.command()
def sweep(
    file: str = typer.Argument(..., help="A W&B sweep config (YAML), e.g. sweeps/sanity.yaml."),
    validate: bool = typer.Option(False, "--validate", help="Only check it against W&B's sweep schema."),
    count_text: Optional[str] = typer.Option(
        None, "--count", metavar="N", help="Most points to run (required for random/bayes)."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Show each point's output and tracebacks."),
) -> None:
    """Run a W&B sweep's points locally, one offline W&B run each, and tabulate which passed.

    Points come from W&B's own sweep engine (the sweeps package); each runs the command `wandb agent`
    would. Exit status: 0 every point passed (or --validate found nothing), 1 a point failed (or the
    config has schema violations), 2 bad input.
    """
    import traceback

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from wbdebug.checks.sweep import load_config, run_sweep, schema_violations

    count = None if count_text is None else _positive_int(count_text, "--count")
    os.environ.setdefault("WANDB_SILENT", "true")
    if validate:
        try:
            violations = schema_violations(load_config(file))
        except Exception as exc:
            fail(_one_line(exc))
        for v in violations:
            typer.echo(f"{file}: {v}")
        typer.echo(f"{file}: {len(violations)} schema violation(s)" if violations else f"{file}: valid W&B sweep config")
        raise typer.Exit(1 if violations else 0)

    def show(point) -> None:
        params = " ".join(f"{k}={v}" for k, v in point.params.items())
        typer.echo(f"[{point.index + 1}] {params}: {point.status} ({point.seconds:.1f}s)")
        if verbose or point.returncode not in (0, 1):
            typer.echo(point.output.rstrip(), err=True)

    try:
        results = run_sweep(file, count=count, on_point=show)
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        fail(_one_line(exc))
    table = Table(title=f"wbdebug sweep: {file}")
    names = list(dict.fromkeys(k for r in results for k in r.params))
    for col in ("#", *names, "result", "events", "run"):
        table.add_column(col)
    for r in results:
        style = "green" if r.returncode == 0 else "bold red"
        table.add_row(str(r.index + 1), *(escape(str(r.params.get(n, ""))) for n in names),
                      f"[{style}]{r.status}[/]", escape(", ".join(r.event_kinds)), escape(r.run_dir or ""))
    Console(highlight=False, width=200).print(table)
    passed = sum(r.returncode == 0 for r in results)
    typer.echo(f"{passed} of {len(results)} point(s) passed.")
    raise typer.Exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    app()
