"""A pre-flight report into a W&B run: the overfit curve as metrics and a line plot, verdicts in the
summary, events as the same table the monitor writes."""

from __future__ import annotations

from typing import Any

from wbdebug import keys
from wbdebug.checks.result import KEY_PREFIX, Report
from wbdebug.sinks.wandb import WandbSink

OVERFIT_LOSS = f"{KEY_PREFIX}/overfit_loss"
OVERFIT_CURVE = f"{KEY_PREFIX}/overfit_curve"


def log_report(run: Any, report: Report, *, owns_run: bool = True) -> None:
    """Write ``report`` to ``run``; finishes the run when ``owns_run``.

    Keys: ``wbdebug/check/overfit_loss`` per step against ``wbdebug/step``, the ``wbdebug/check/overfit_curve``
    line plot, ``wbdebug/check/passed`` and ``wbdebug/check/<check>/<metric>`` in the summary, and the
    ``wbdebug/events`` table.
    """
    import wandb

    sink = WandbSink(run, owns_run=owns_run)  # no emit(): a pre-flight gate reports by exit code, not alerts
    curve = report.loss_curve
    for step, loss in enumerate(curve):
        sink.log(step, {OVERFIT_LOSS: loss})
    if curve:
        table = wandb.Table(columns=["step", "loss"], data=[[i, v] for i, v in enumerate(curve)])
        run.log({
            OVERFIT_CURVE: wandb.plot.line(table, "step", "loss", title="wbdebug: overfit one batch"),
            keys.STEP: len(curve) - 1,
        })
    run.summary.update(report.summary_metrics())
    sink.close(report.events)
