"""The alert policy (which events, how often, escalation, recovery, reminders), W&B alerts read back from the
offline run, and on_nonfinite="raise" / "stop"."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import torch

import wbdebug
from wbdebug import EventKind as K
from wbdebug.alerts import AlertPolicy, alert_title
from wbdebug.events import Event
from wbdebug.sinks.wandb import TITLE_LIMIT
from conftest import alerts, read_run
from models import mlp, train
from test_slack import FAST, SECRET, blocks_text, slack  # noqa: F401 - the real-HTTP Slack stand-in fixture


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ev(kind: K, severity: str = "warning", step: int = 0, layer: str | None = None, cleared: bool = False) -> Event:
    return Event(kind=kind, severity="info" if cleared else severity, step=step, layer=layer, cleared=cleared,
                 message=f"{kind.value} {'cleared' if cleared else severity} at {step}")


# ------------------------------------------------------------------------------ which events alert
@pytest.mark.parametrize("kind, severity, settings, alerts_", [
    (K.NONFINITE_LOSS, "error", {}, True),
    (K.LOSS_SPIKE, "warning", {}, True),
    (K.DEAD_ACTIVATIONS, "warning", {}, True),
    (K.INITIAL_LOSS, "warning", {}, True),
    (K.RANK_DIVERGENCE, "error", {}, True),  # every error alerts
    (K.RANK_DIVERGENCE, "warning", {}, False),  # not a default kind
    (K.AMP_OVERFLOW, "warning", {}, False),
    (K.AMP_OVERFLOW, "info", {}, False),
    (K.MONITOR_ERROR, "warning", {}, False),
    (K.RANK_DIVERGENCE, "error", {"all_errors": False}, False),
    (K.LOSS_SPIKE, "warning", {"min_severity": "error"}, False),
    (K.NONFINITE_GRAD, "error", {"min_severity": "error"}, True),
    (K.AMP_OVERFLOW, "warning", {"kinds": ["amp_overflow"]}, True),
    (K.LOSS_SPIKE, "warning", {"kinds": ["amp_overflow"]}, False),
])
def test_policy_selects_kinds_and_severities(kind, severity, settings, alerts_):
    policy = AlertPolicy(**settings)
    assert (policy.admit(ev(kind, severity)) is not None) == alerts_


def test_default_policy_comes_from_config_and_environment(monkeypatch):
    monkeypatch.setenv("WBDEBUG_ALERT_KINDS", '["loss_spike"]')
    monkeypatch.setenv("WBDEBUG_ALERT_COOLDOWN_S", "60")
    policy = AlertPolicy.from_config(wbdebug.Config())
    assert policy.kinds == {K.LOSS_SPIKE} and policy.cooldown_s == 60
    monkeypatch.delenv("WBDEBUG_ALERT_KINDS")
    assert set(wbdebug.Config(_env_file=None).alert_kinds) == {
        K.NONFINITE_LOSS, K.NONFINITE_GRAD, K.EXPLODING_GRADIENTS, K.VANISHING_GRADIENTS, K.DEAD_ACTIVATIONS,
        K.LOSS_SPIKE, K.INITIAL_LOSS,
    }


# ------------------------------------------------------------------------------ how often
def test_cooldown_holds_back_a_flapping_condition_then_says_it_is_back():
    clock = Clock()
    policy = AlertPolicy(cooldown_s=300, reminder_s=3600, clock=clock)
    timeline = [  # (time, event or "due", expected (reason, suppressed) or None)
        (0, ev(K.LOSS_SPIKE, step=40), ("new", 0)),
        (10, ev(K.LOSS_SPIKE, step=50, cleared=True), ("recovered", 0)),
        (20, ev(K.LOSS_SPIKE, step=70), None),  # flaps back within the cool-down: held back
        (30, ev(K.LOSS_SPIKE, step=80, cleared=True), None),  # its recovery was never news
        (40, ev(K.LOSS_SPIKE, step=100), None),
        (299, "due", None),
        (301, "due", ("new", 2)),  # still active after the cool-down: said once, folding in two
        (400, ev(K.LOSS_SPIKE, step=130, cleared=True), ("recovered", 0)),
    ]
    for t, what, expected in timeline:
        clock.t = t
        got = policy.due(step=0) if what == "due" else [a for a in [policy.admit(what)] if a]
        assert [(a.reason, a.suppressed) for a in got] == ([expected] if expected else []), (t, what)


def test_escalation_is_sent_at_once_and_reminders_repeat_a_lasting_condition():
    clock = Clock()
    policy = AlertPolicy(cooldown_s=300, reminder_s=1000, clock=clock)
    spike = policy.admit(ev(K.EXPLODING_GRADIENTS, "warning", step=10))
    clock.t = 5
    worse = policy.admit(ev(K.EXPLODING_GRADIENTS, "error", step=12))  # warning -> error: not held back
    assert (spike.reason, worse.reason, worse.escalated_from.severity) == ("new", "escalation", "warning")
    assert worse.title == "wbdebug: exploding_gradients escalated"
    clock.t = 900
    assert policy.due(step=500) == []
    clock.t = 1006
    (reminder,) = policy.due(step=600)
    assert (reminder.reason, reminder.step, reminder.since_step) == ("reminder", 600, 10)
    assert "still active at step 600, since step 10" in reminder.text()
    clock.t = 1100
    assert policy.due(step=700) == []  # the next reminder waits another reminder_s
    assert AlertPolicy(reminder_s=0, clock=clock).due(step=0) == []


def test_an_error_while_another_kind_warns_escalates_it():
    policy = AlertPolicy(clock=Clock())
    policy.admit(ev(K.LOSS_SPIKE, "warning", step=200))
    nan = policy.admit(ev(K.NONFINITE_LOSS, "error", step=203))
    assert nan.reason == "escalation" and nan.escalated_from.kind == K.LOSS_SPIKE
    assert "escalated from loss_spike (warning, step 200)" in nan.text()


def test_per_layer_conditions_recover_when_the_last_layer_does():
    policy = AlertPolicy(clock=Clock())
    assert policy.admit(ev(K.DEAD_ACTIVATIONS, step=30, layer="1")).reason == "new"
    assert policy.admit(ev(K.DEAD_ACTIVATIONS, step=30, layer="3")) is None  # same kind, same cool-down
    assert policy.admit(ev(K.DEAD_ACTIVATIONS, step=60, layer="1", cleared=True)) is None  # layer 3 is still dead
    assert policy.admit(ev(K.DEAD_ACTIVATIONS, step=70, layer="3", cleared=True)).reason == "recovered"


def test_one_off_diagnoses_get_no_reminders_or_recovery():
    clock = Clock()
    policy = AlertPolicy(reminder_s=10, clock=clock)
    assert policy.admit(ev(K.INITIAL_LOSS, "error")).reason == "new"
    clock.t = 10_000
    assert policy.due(step=100) == []


# ------------------------------------------------------------------------------ content
@pytest.mark.parametrize("kind, layer, tag, run, expected", [
    ("loss_spike", None, "", "digits-1", "wbdebug: loss_spike (digits-1)"),
    ("loss_spike", None, "", "sweep-lr-3e-4-batch-512-seed-7", "wbdebug: loss_spike (sweep-lr-3e-4-batch-512-seed-7)"),
    ("nonfinite_loss", "(input)", "", "abc123", "wbdebug: nonfinite_loss in (input) (abc123)"),
    ("dead_activations", "3", "recovered", None, "wbdebug: dead_activations in 3 recovered"),
    ("vanishing_gradients", "encoder.layers.11.self_attn.out_proj", "still active", "a-very-long-run-name-from-a-sweep-42",
     "wbdebug: vanishing_gradients in …proj still active (a-very-lon…)"),
    ("nonfinite_loss", "encoder.layers.11.self_attn.out_proj", "", "run-5",
     "wbdebug: nonfinite_loss in …layers.11.self_attn.out_proj (run-5)"),
])
def test_alert_titles_name_kind_layer_and_run_within_wandb_limit(kind, layer, tag, run, expected):
    title = alert_title(kind, layer, tag, run)
    assert title == expected and len(title) <= TITLE_LIMIT


# ------------------------------------------------------------------------------ W&B, read back
def test_wandb_alerts_match_slack_and_never_repeat_within_the_wait(offline_wandb, slack):  # noqa: F811
    def flapping_then_nan(step, x, y):
        if step in (40, 70, 100, 130):
            return x * 30, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(step))]
        return (x * float("nan"), y) if step >= 150 else (x, y)

    server = slack()
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, console=False, slack_webhook_url=server.url,
                       **FAST) as monitor:
        train(setup, 170, corrupt=flapping_then_nan)
    run_id = monitor.run.id
    got = [(a["title"], a["level"]) for a in alerts(read_run(Path(monitor.run.dir).parent))]
    nan_layer = next(e.layer for e in monitor.events if e.kind == K.NONFINITE_LOSS)
    grad_layer = next(e.layer for e in monitor.events if e.kind == K.NONFINITE_GRAD)
    spike_layer = next(e.layer for e in monitor.events if e.kind == K.EXPLODING_GRADIENTS)
    assert got == [
        (f"wbdebug: loss_spike ({run_id})", "WARN"),
        (f"wbdebug: exploding_gradients in {spike_layer} ({run_id})", "WARN"),
        (f"wbdebug: loss_spike recovered ({run_id})", "INFO"),
        (f"wbdebug: exploding_gradients recovered ({run_id})", "INFO"),
        (f"wbdebug: nonfinite_loss in {nan_layer} ({run_id})", "ERROR"),
        (f"wbdebug: nonfinite_grad in {grad_layer} ({run_id})", "ERROR"),
    ]  # the spikes at 70, 100 and 130 are within the cool-down (and W&B's wait_duration): no repeats
    # Slack got the same alerts, one message per incident (step), pointing at the offline run.
    assert [p["text"] for p in server.posts] == [
        f"wbdebug: loss_spike ({run_id}) (+1 more)",
        f"wbdebug: loss_spike recovered ({run_id}) (+1 more)",
        f"wbdebug: nonfinite_loss in {nan_layer} ({run_id}) (+1 more)",
    ]
    run_dir = str(Path(monitor.run.dir).parent)
    assert f"wandb sync {run_dir}" in blocks_text(server.posts[-1])
    for path in Path(run_dir).rglob("*"):  # the secret is nowhere in the run (config, logs, alerts)
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    nan_alert = monitor._alerts.sent[4]
    assert f"run: offline run {run_dir}" in nan_alert.text() and "step: 150" in nan_alert.text()


# ------------------------------------------------------------------------------ on_nonfinite
def test_on_nonfinite_raise_stops_the_loop_after_the_alert_is_sent(slack):  # noqa: F811
    server = slack()
    setup = mlp()
    monitor = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, wandb=False, console=False, journal=False,
                            on_nonfinite="raise", slack_webhook_url=server.url, **FAST)
    steps = []
    with monitor:
        try:
            for step in range(100):
                x, y = setup.batch(step)
                if step >= 23:
                    x = x * float("nan")
                setup.optimizer.zero_grad()
                setup.criterion(setup.model(x), y).backward()
                steps.append(step)
                setup.optimizer.step()  # raises from here
        except wbdebug.TrainingHealthError as exc:
            raised, posts_at_raise = exc, len(server.posts)
    assert steps[-1] == 29  # the read-back at the end of step 29 (check_every=10) finds the NaN of step 23
    assert posts_at_raise == 1  # the Slack message was out before the exception
    assert raised.event.kind == K.NONFINITE_LOSS and raised.event.step == 23
    assert "nonfinite_loss" in str(raised) and "Fix:" in str(raised)
    assert monitor.closed and not any(e.kind == K.MONITOR_ERROR for e in monitor.events)


def test_on_nonfinite_raise_without_an_optimizer_raises_from_backward():
    setup = mlp()
    with wbdebug.watch(setup.model, None, setup.criterion, wandb=False, console=False, journal=False,
                       on_nonfinite="raise", check_every=1) as monitor:
        with pytest.raises(wbdebug.TrainingHealthError):
            for step in range(20):
                x, y = setup.batch(step)
                setup.criterion(setup.model(x * float("nan") if step == 4 else x), y).backward()
    assert step == 4 and monitor.step == 5


def test_on_nonfinite_stop_sets_should_stop_for_the_loop_to_check():
    setup = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, wandb=False, console=False,
                           journal=False, on_nonfinite="stop") as monitor:
            for step in range(200):
                x, y = setup.batch(step)
                setup.optimizer.zero_grad()
                setup.criterion(setup.model(x * float("nan") if step >= 15 else x), y).backward()
                setup.optimizer.step()
                if monitor.should_stop:
                    break
    assert step == 19  # the first read-back after the NaN (check_every=10)
    stops = [w for w in caught if "should_stop" in str(w.message)]
    assert len(stops) == 1 and "nonfinite_loss" in str(stops[0].message)


def test_on_nonfinite_warn_trains_on():
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, wandb=False, console=False,
                       journal=False) as monitor:
        train(setup, 40, corrupt=lambda s, x, y: (x * float("nan"), y) if s >= 15 else (x, y))
    assert monitor.step == 40 and not monitor.should_stop
    assert any(e.kind == K.NONFINITE_LOSS for e in monitor.events)


def test_alerting_costs_the_step_nothing_when_nothing_is_wrong(slack):  # noqa: F811
    server = slack()
    setup = mlp()
    with wbdebug.watch(setup.model, setup.optimizer, setup.criterion, wandb=False, console=False, journal=False,
                       slack_webhook_url=server.url) as monitor:
        t0 = time.perf_counter()
        train(setup, 100)
        assert time.perf_counter() - t0 < 30
    assert server.posts == [] and monitor._alerts.channels[0]._thread is None  # no thread until an alert
