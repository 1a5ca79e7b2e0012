"""Slack and webhook alerts over real HTTP: a stdlib server on 127.0.0.1 stands in for Slack's endpoint.

Nothing is mocked: wbdebug's background delivery posts with slack_sdk's WebhookClient to the server below,
which replies as scripted (200, 500, 429 with Retry-After, or never).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import deque
from contextlib import redirect_stderr
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import wbdebug
from wbdebug import EventKind
from wbdebug.alerts import Alert
from wbdebug.events import Event
from wbdebug.sinks.slack import SlackChannel
from wbdebug.sinks.webhook import WebhookChannel
from models import mlp, train

SECRET = "XoXb5ecr3tT0k3nZ9"  # the secret part of the webhook URL: must never be seen anywhere
HANG = "hang"  # a scripted reply: accept the request and never answer
# Short bounds: tests take seconds, not minutes. Every bound is a Config field.
FAST = dict(alert_timeout_s=2.0, alert_retry_s=5.0, alert_backoff_s=0.05, alert_flush_s=10.0)


class SlackServer:
    """Slack's incoming-webhook endpoint on 127.0.0.1: replies as scripted, then 200 "ok"; records every POST."""

    def __init__(self, replies: list = ()) -> None:
        self.replies = deque(replies)
        self.requests: list[tuple[float, str, dict]] = []  # (monotonic time, path, JSON body)
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((time.monotonic(), self.path, body))
                reply = server.replies.popleft() if server.replies else (200, {})
                if reply == HANG:
                    server.release.wait(60)
                    return
                status, headers = reply
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                text = b"ok" if status == 200 else b"rollup_error"
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}/services/T000/B000/{SECRET}"

    @property
    def posts(self) -> list[dict]:
        return [body for _, _, body in self.requests]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def slack(monkeypatch):
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)  # the server is on this machine
    servers: list[SlackServer] = []

    def start(replies: list = ()) -> SlackServer:
        servers.append(SlackServer(replies))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def nan_from(step: int):
    return lambda s, x, y: (x * float("nan"), y) if s >= step else (x, y)


def watch(setup, **settings):
    settings = {"wandb": False, "console": False, "journal": False, **settings}
    return wbdebug.watch(setup.model, setup.optimizer, setup.criterion, **settings)


def blocks_text(payload: dict) -> str:
    return json.dumps(payload["blocks"], ensure_ascii=False)


def delivery_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "deliver" in str(w.message) or "dropped" in str(w.message)]


def alert(step: int = 5, kind: EventKind = EventKind.NONFINITE_LOSS) -> Alert:
    return Alert(event=Event(kind=kind, severity="error", step=step, value=float("nan"), message="The loss is nan."),
                 step=step)


# ------------------------------------------------------------------------------ the NaN incident
def test_nan_demo_sends_one_slack_message_with_kind_step_layer_and_fix(slack, monkeypatch):
    from wbdebug.demo import run_demo

    server = slack()
    monkeypatch.setenv("WBDEBUG_SLACK_WEBHOOK_URL", server.url)  # the one variable a user sets
    result = run_demo("nan", wandb=False, console=False)
    nan = next(e for e in result.monitor.events if e.kind == EventKind.NONFINITE_LOSS)
    grad = next(e for e in result.monitor.events if e.kind == EventKind.NONFINITE_GRAD)
    assert len(server.posts) == 1, [p["text"] for p in server.posts]  # loss and gradients: one incident
    payload = server.posts[0]
    assert payload["text"].startswith("wbdebug: nonfinite_loss")
    blocks = payload["blocks"]
    assert [b["type"] for b in blocks][:3] == ["header", "section", "section"]
    assert "nonfinite_loss" in blocks[0]["text"]["text"] and nan.layer in blocks[0]["text"]["text"]
    fields = "\n".join(f["text"] for f in blocks[2]["fields"])
    assert "*Step*\n150" in fields and f"*Layer*\n`{nan.layer}`" in fields and "*Kind*\n`nonfinite_loss`" in fields
    text = blocks_text(payload)
    assert "*Fix:* " + nan.fix[:40] in text  # the fix
    assert "nonfinite_grad" in text and grad.fix[:40] in text  # the gradients, in the same message
    assert "wbdebug/loss" in text  # the loss leading up to it
    assert all(len(b["text"]["text"]) <= 3000 for b in blocks if b["type"] == "section" and "text" in b)


def test_cli_demo_with_the_environment_variable_sends_one_message(slack, tmp_path):
    server = slack()
    env = {**os.environ, "WBDEBUG_SLACK_WEBHOOK_URL": server.url, "WANDB_MODE": "offline",
           "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "wbdebug.cli", "demo", "--bug", "nan"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(server.posts) == 1
    context = server.posts[0]["blocks"][-1]["elements"][0]["text"]
    assert "offline run" in context and "wandb sync" in context  # offline: where the run is, how to upload it
    assert SECRET not in proc.stdout + proc.stderr


def test_alerts_pending_at_interpreter_exit_are_flushed(slack, tmp_path):
    server = slack([(500, {})])  # the first attempt fails: the alert is still pending when the script ends
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import wbdebug
        from models import mlp, train
        setup = mlp()
        monitor = wbdebug.watch(setup.model, setup.optimizer, setup.criterion, wandb=False, console=False,
                                journal=False, check_every=1, alert_backoff_s=0.5,
                                slack_webhook_url={server.url!r})
        train(setup, 8, corrupt=lambda s, x, y: (x * float("nan"), y) if s >= 5 else (x, y))
        # no close(): the interpreter exits with the alert in the queue
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(server.posts) == 2 and server.posts[0] == server.posts[1]  # the failed attempt, then the retry


# ------------------------------------------------------------------------------ policy, end to end
def test_flapping_condition_respects_the_cooldown(slack):
    def flapping(step, x, y):  # a corrupt batch every 30 steps: spike, recover, spike, ...
        if step in (40, 70, 100, 130):
            return x * 30, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(step))]
        return x, y

    server = slack()
    setup = mlp()
    with watch(setup, slack_webhook_url=server.url, **FAST) as monitor:
        train(setup, 160, corrupt=flapping)
    spikes = [e.step for e in monitor.events if e.kind == EventKind.LOSS_SPIKE and not e.cleared]
    assert spikes == [40, 70, 100, 130]
    headers = [p["blocks"][0]["text"]["text"] for p in server.posts]
    # One message when it starts (spike and gradients at step 40), one when it recovers; then silence.
    assert headers == [":warning: loss_spike", ":large_green_circle: loss_spike recovered"], headers
    assert "exploding_gradients" in blocks_text(server.posts[0])

    quiet = slack()
    setup = mlp()
    with watch(setup, slack_webhook_url=quiet.url, alert_cooldown_s=0, **FAST):
        train(setup, 160, corrupt=flapping)
    assert len(quiet.posts) == 8  # without the cool-down: every start and every recovery


def test_spike_that_becomes_nan_is_an_escalation(slack):
    def spike_then_nan(step, x, y):
        if step == 40:
            return x * 30, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
        return (x * float("nan"), y) if step >= 43 else (x, y)

    server = slack()
    setup = mlp()
    with watch(setup, slack_webhook_url=server.url, **FAST):
        train(setup, 60, corrupt=spike_then_nan)
    headers = [p["blocks"][0]["text"]["text"] for p in server.posts]
    assert len(headers) == 2 and headers[0].startswith(":warning: loss_spike"), headers
    assert headers[1].startswith(":red_circle: nonfinite_loss") and headers[1].endswith("escalated")
    assert "escalated from loss_spike (warning, step 40)" in blocks_text(server.posts[1])


# ------------------------------------------------------------------------------ delivery
def test_server_errors_then_success_still_deliver(slack):
    server = slack([(500, {}), (503, {})])
    setup = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(setup, slack_webhook_url=server.url, check_every=1, **FAST) as monitor:
            train(setup, 10, corrupt=nan_from(5))
    channel = monitor._alerts.channels[0]
    assert len(server.requests) == 3 and server.posts[0] == server.posts[2]
    assert (channel.delivered, channel.failed) == (1, 0)
    assert delivery_warnings(caught) == []


def test_retry_after_is_honoured(slack):
    server = slack([(429, {"Retry-After": "1"})])
    channel = SlackChannel(server.url, timeout_s=2, retry_s=10, backoff_s=0.05, group_s=0)
    channel.send(alert())
    assert channel.flush(10)
    (t0, _, first), (t1, _, second) = server.requests
    assert first == second
    assert t1 - t0 >= 0.95  # Slack asked for 1 s; the back-off alone would have retried after 0.05 s
    assert channel.delivered == 1
    channel.close(1)


def test_retry_after_beyond_the_retry_budget_gives_up_at_once(slack):
    server = slack([(429, {"Retry-After": "3600"})])
    channel = SlackChannel(server.url, timeout_s=2, retry_s=10, backoff_s=0.05, group_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        channel.send(alert())
        assert channel.flush(20)
        assert time.monotonic() - t0 < 5  # not 3600 s, nor the 10 s retry budget
    assert len(server.requests) == 1 and channel.failed == 1
    (message,) = delivery_warnings(caught)
    assert "HTTP 429" in message and "Retry-After 3600" in message


def test_unanswering_server_does_not_slow_training_and_warns_once(slack):
    def loop(**settings) -> tuple[float, wbdebug.Monitor]:
        setup = mlp()
        monitor = watch(setup, check_every=1, **settings)
        t0 = time.perf_counter()
        train(setup, 40, corrupt=nan_from(5))
        elapsed = time.perf_counter() - t0
        return elapsed, monitor

    loop()[1].close()  # warm-up: first-call costs are nobody's
    plain, monitor = loop()
    monitor.close()
    server = slack([HANG] * 10)
    bounds = dict(alert_timeout_s=5.0, alert_retry_s=5.0, alert_backoff_s=0.05, alert_flush_s=15.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alerting, monitor = loop(slack_webhook_url=server.url, **bounds)
        t0 = time.perf_counter()
        monitor.close()
        closing = time.perf_counter() - t0
    # A send that waited on the server would cost >= 5 s per attempt; the loop itself takes well under 1 s.
    assert alerting < 2 * plain + 1.5, (alerting, plain)
    assert closing < 15 + 2  # close() waits for the pending alert, boundedly (alert_flush_s)
    (message,) = delivery_warnings(caught)  # exactly one
    assert "gave up delivering an alert to Slack" in message and "nonfinite_loss" in message
    assert SECRET not in message
    assert monitor._alerts.channels[0].failed == 2  # the loss and the gradient alert, one message


def test_full_queue_drops_alerts_with_the_same_single_warning(slack):
    server = slack([HANG] * 5)
    channel = SlackChannel(server.url, timeout_s=1, retry_s=1, backoff_s=0.05, queue_size=2, group_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for step in range(20):
            channel.send(alert(step))
        assert time.perf_counter() - t0 < 0.5  # send() never waits
        channel.close(5)
    assert channel.dropped == 18
    assert len(delivery_warnings(caught)) == 1


def test_generic_webhook_posts_the_event_json(slack):
    server = slack()
    setup = mlp()
    with watch(setup, webhook_url=server.url, check_every=1, **FAST) as monitor:
        train(setup, 8, corrupt=nan_from(5))
    assert [p["event"]["kind"] for p in server.posts] == ["nonfinite_loss", "nonfinite_grad"]  # one per alert
    first = server.posts[0]
    event = Event.model_validate(first["event"])
    assert (event.kind, event.step, event.layer, event.fix) == (EventKind.NONFINITE_LOSS, 5, monitor.events[0].layer,
                                                                monitor.events[0].fix)
    assert first["reason"] == "new" and first["level"] == "error" and first["title"].startswith("wbdebug: ")


def test_a_channel_constructed_alone_works_too(slack):
    server = slack()
    hook = WebhookChannel(server.url, retry_s=1)
    hook.send(alert())
    hook.close(5)
    assert server.posts[0]["event"]["kind"] == "nonfinite_loss"
    assert "url=hidden" in repr(hook)


# ------------------------------------------------------------------------------ secrets
def test_the_webhook_url_never_leaks(slack, capfd):
    server = slack([(500, {})] * 100)  # keeps failing: retries, a give-up, a warning
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(handler.format(record))  # type: ignore[method-assign]
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # a user who turns on every log
    journal = Path("events.jsonl")
    stderr = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, redirect_stderr(stderr):
            warnings.simplefilter("always")
            setup = mlp()
            with watch(setup, slack_webhook_url=server.url, webhook_url=server.url, console=True,
                       journal=True, journal_path=journal, check_every=1, alert_timeout_s=1, alert_retry_s=1,
                       alert_backoff_s=0.05) as monitor:
                train(setup, 8, corrupt=nan_from(5))
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert len(server.requests) > 2  # it did talk to the server, and failed
    seen = [
        *records, *(str(w.message) for w in caught), stderr.getvalue(), *capfd.readouterr(),
        journal.read_text(), *(e.model_dump_json() for e in monitor.events),
        repr(monitor.config), str(monitor.config), monitor.config.model_dump_json(), str(monitor.config.model_dump()),
        repr(monitor), *(repr(c) for c in monitor._alerts.channels),
    ]
    assert any("gave up delivering" in s for s in seen)
    assert not [s for s in seen if SECRET in s]
    with pytest.raises(ValueError) as bad:
        wbdebug.Config(slack_webhook_url=f"hooks.slack.com/services/{SECRET}")  # validated lazily: fine here
        watch(mlp(), slack_webhook_url=f"hooks.slack.com/services/{SECRET}")
    assert SECRET not in str(bad.value) and "http" in str(bad.value)
