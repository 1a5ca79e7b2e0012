"""HTTP alert delivery off the training thread, and the generic webhook channel built on it.

:class:`Delivery` is the machinery the Slack and webhook channels share: one daemon thread, a bounded
queue, retries with exponential back-off on 429 / 5xx / connection errors (a ``Retry-After`` header
wins), a bounded time per alert after which it is dropped with **one** warning per channel, and a
bounded flush at ``close()`` and at interpreter exit. ``send()`` only enqueues: the training step never
waits on the network. Requests go through ``slack_sdk``'s ``WebhookClient`` (a plain JSON POST), with
its own retries off and its logging silenced: the URL is a secret and never reaches a log, a warning,
an exception or a ``repr``.
"""

from __future__ import annotations

import atexit
import email.utils
import functools
import logging
import queue
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any, Hashable
from urllib.parse import urlsplit
from urllib.request import proxy_bypass

from pydantic import SecretStr

from wbdebug.alerts import Alert

_STOP = object()  # close(): deliver what is ahead of this, then exit
_NUDGE = object()  # flush(): stop waiting to group, deliver now

#: slack_sdk logs the request URL at DEBUG level (and every failed attempt at ERROR): a logger of our
#: own, outside the logging tree and switched off, keeps the secret out of every handler.
_SILENT = logging.Logger("wbdebug.http", level=logging.CRITICAL + 1)
_SILENT.disabled = True
_SILENT.propagate = False


def secret_value(url: SecretStr | str, setting: str) -> str:
    """The URL inside ``url``, checked to be http(s) — without ever quoting it in the error."""
    value = url.get_secret_value() if isinstance(url, SecretStr) else str(url)
    value = value.strip()
    if not value.lower().startswith(("http://", "https://")):
        raise ValueError(f"{setting} must be an http:// or https:// URL (the value is secret and not shown)")
    return value


def retry_after_s(headers: Any) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not headers:
        return None
    raw = None
    for key, value in headers.items():
        if str(key).lower() == "retry-after":
            raw = value[0] if isinstance(value, (list, tuple)) else value
            break
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except (TypeError, ValueError):
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(raw))
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Delivery:
    """Posts each alert (or a group of alerts) as JSON from a background thread; see the module docstring.

    Args:
        url: the endpoint (a secret).
        name: the channel's name in warnings ("Slack", "webhook").
        timeout_s: seconds one HTTP attempt may take.
        retry_s: seconds to keep retrying one payload before giving up on it.
        backoff_s: first delay between attempts, doubled after each failure up to ``backoff_max_s``.
        flush_s: seconds ``close()`` (and interpreter exit) waits for queued alerts.
        queue_size: alerts waiting beyond this are dropped (with the channel's one warning).
        group_s: after an alert, wait this long for alerts with the same :meth:`group_key` (alerts raised
            at the same step: one incident) and send them as one payload; 0 sends each alone.
        setting: the config field the URL came from, for error messages.
    """

    name = "webhook"

    def __init__(
        self,
        url: SecretStr | str,
        *,
        name: str | None = None,
        timeout_s: float = 10.0,
        retry_s: float = 120.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        flush_s: float = 10.0,
        queue_size: int = 100,
        group_s: float = 0.0,
        setting: str = "webhook_url",
    ) -> None:
        from slack_sdk.webhook import WebhookClient

        if name is not None:
            self.name = name
        self._url = secret_value(url, setting)
        self._client = WebhookClient(self._url, timeout=timeout_s, retry_handlers=[], logger=_SILENT)
        if self._client.proxy and proxy_bypass(urlsplit(self._url).hostname or ""):
            self._client.proxy = None  # slack_sdk reads HTTPS_PROXY but not NO_PROXY
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.flush_s = flush_s
        self.queue_size = queue_size
        self.group_s = group_s
        #: counters: payloads delivered, alerts given up on, alerts dropped on a full queue, HTTP attempts.
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self.attempts = 0
        self.warning: str | None = None  # the one warning, once issued
        self._q: queue.Queue = queue.Queue()
        self._carry: deque = deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._closing = threading.Event()
        self._close_deadline = float("inf")
        self._hurry = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))

    def __repr__(self) -> str:
        return f"<wbdebug {type(self).__name__} delivered={self.delivered} failed={self.failed} url=hidden>"

    # ---------------------------------------------------------------- what subclasses shape
    def render(self, alerts: list[Alert]) -> dict:
        """The JSON body for ``alerts`` (one, unless grouped): the event plus why, where and the run."""
        return alerts[0].as_dict()

    def group_key(self, alert: Alert) -> Hashable:
        return alert.event.step

    # ---------------------------------------------------------------- the channel protocol
    def send(self, alert: Alert) -> None:
        """Queue ``alert``; returns at once. Dropped (with the channel's one warning) when the queue is full."""
        if self._closed:
            return
        with self._cond:
            full = self._pending >= self.queue_size
            if full:
                self.dropped += 1
            else:
                self._pending += 1
        if full:
            self._warn_once(
                f"wbdebug: {self.queue_size} alerts are already waiting for {self.name}, so new ones are dropped "
                "(is the endpoint down?)"
            )
            return
        self._start()
        self._q.put(alert)

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until every queued alert is delivered or given up on."""
        with self._cond:
            if self._pending == 0:
                return True
            self._hurry = True
        self._q.put(_NUDGE)
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending == 0, timeout)
            self._hurry = False
        return done

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued within ``timeout`` (default ``flush_s``) seconds, then stop. Safe twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._thread is None:
            return
        timeout = self.flush_s if timeout is None else timeout
        self._close_deadline = time.monotonic() + timeout
        self._closing.set()
        self._q.put(_STOP)
        self._thread.join(timeout)
        with self._cond:
            left = self._pending
        if left:
            self._warn_once(
                f"wbdebug: {left} alert(s) to {self.name} were not delivered within the {timeout:g} s "
                "allowed at close (alert_flush_s)"
            )

    # ---------------------------------------------------------------- the worker
    def _start(self) -> None:
        if self._thread is None:
            with self._cond:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"wbdebug-{self.name}", daemon=True)
                    self._thread.start()
                    atexit.register(self._atexit)

    def _next(self, timeout: float | None = None) -> Any:
        if self._carry:
            return self._carry.popleft()
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is _STOP:
                return
            if item is _NUDGE:
                continue
            batch = [item]
            if self.group_s > 0:
                key = self.group_key(item)
                end = time.monotonic() + self.group_s
                while True:
                    # flush() and close() stop the wait, but still take what is already queued for this step
                    hurry = self._hurry or self._closing.is_set()
                    nxt = self._next(0.0 if hurry else max(0.0, end - time.monotonic()))
                    if nxt is _NUDGE:
                        continue
                    if nxt is None:
                        break
                    if nxt is not _STOP and self.group_key(nxt) == key:
                        batch.append(nxt)
                        continue
                    self._carry.append(nxt)
                    break
            try:
                self._deliver(batch)
            except Exception as exc:  # noqa: BLE001 - the worker must outlive any one payload
                self._give_up(batch, f"{type(exc).__name__} while preparing the message", 0, 0.0)
            with self._cond:
                self._pending -= len(batch)
                self._cond.notify_all()

    def _limit(self, deadline: float) -> float:
        return min(deadline, self._close_deadline)

    def _deliver(self, batch: list[Alert]) -> None:
        payload = self.render(batch)
        start = time.monotonic()
        deadline = start + self.retry_s
        delay = self.backoff_s
        attempts, reason = 0, ""
        while True:
            now = time.monotonic()
            if now >= self._close_deadline or (attempts and now >= deadline):
                return self._give_up(batch, reason or "no time left at close", attempts, now - start)
            attempts += 1
            self.attempts += 1
            # The first attempt gets the full timeout; later ones end by the retry deadline. None outlives close().
            timeout = self.timeout_s if attempts == 1 else min(self.timeout_s, deadline - now)
            self._client.timeout = max(0.05, min(timeout, self._close_deadline - now))
            outcome, wait, reason = self._attempt(payload)
            if outcome == "ok":
                self.delivered += 1
                return None
            if outcome == "fail":
                return self._give_up(batch, reason, attempts, time.monotonic() - start)
            if wait is None:
                wait, delay = delay, min(delay * 2, self.backoff_max_s)
            else:
                reason += f", Retry-After {wait:g} s"
            if not self._sleep_until(time.monotonic() + wait, deadline):
                return self._give_up(batch, reason, attempts, time.monotonic() - start)

    def _attempt(self, payload: dict) -> tuple[str, float | None, str]:
        """One POST: ("ok" | "retry" | "fail", the server's Retry-After, why) — the why never holds the URL."""
        try:
            resp = self._client.send_dict(payload)
        except Exception as exc:  # noqa: BLE001 - refused, reset, timed out, DNS: all worth a retry
            return "retry", None, self._redact(f"{type(exc).__name__}: {exc}")
        status = resp.status_code
        if 200 <= status < 300:
            return "ok", None, ""
        body = self._redact(str(resp.body or "")[:100])
        reason = f"HTTP {status}" + (f" {body}" if body else "")
        if status in (408, 429) or status >= 500:
            return "retry", retry_after_s(resp.headers), reason
        return "fail", None, reason  # 400 invalid_payload, 403, 404 no_service, 410 channel_is_archived …

    def _sleep_until(self, until: float, deadline: float) -> bool:
        """Sleep until ``until``; False (do not wait) when that is past the retry deadline or close's."""
        while True:
            now = time.monotonic()
            if until > self._limit(deadline):
                return False
            if now >= until:
                return True
            if self._closing.is_set():
                time.sleep(until - now)  # bounded: until <= close's deadline
            else:
                self._closing.wait(until - now)  # close() wakes it to re-check the deadline

    def _give_up(self, batch: list[Alert], reason: str, attempts: int, elapsed: float) -> None:
        self.failed += len(batch)
        what = batch[0].title + (f" and {len(batch) - 1} more" if len(batch) > 1 else "")
        self._warn_once(
            f"wbdebug: gave up delivering an alert to {self.name} ({what}) after {attempts} attempt(s) in "
            f"{elapsed:.1f} s; last error: {reason or 'none'}"
        )

    def _warn_once(self, message: str) -> None:
        with self._cond:
            if self.warning is not None:
                return
            self.warning = message = (
                f"{message}. Training is unaffected, the events are in monitor.events and the event journal; "
                f"further {self.name} delivery problems are not reported."
            )
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _redact(self, text: str) -> str:
        """``text`` with the URL, and its secret path, replaced by ``<secret>``."""
        secret_path = self._url.split("://", 1)[-1].partition("/")[2]
        for value in (self._url, secret_path):
            if value and len(value) >= 4:
                text = text.replace(value, "<secret>")
        return text


class WebhookChannel(Delivery):
    """POSTs each alert as JSON (:meth:`Alert.as_dict`: the event, why now, the run) to any URL.

    For Teams / Discord / PagerDuty bridges and home-grown receivers: one request per alert, nothing
    grouped, same retries and bounds as Slack.
    """

    name = "webhook"


def _close_at_exit(ref: "weakref.ref[Delivery]") -> None:
    delivery = ref()
    if delivery is not None:
        delivery.close()
