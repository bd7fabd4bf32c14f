"""Webhook alerts: structured JSON events with a Slack-compatible `text`, retried with tenacity, never raising.

Every POST body is one JSON object: `{"text": "<prefix> run R: ...", "event": KIND, "host": ..., "time": ...,
"details": {...}}` — Slack, Mattermost and Teams-style incoming webhooks show `text` and ignore the rest;
other receivers route on `event` (one of EVENTS) and read `details` (run_id, attempt, step, state, and the
event's own fields). Only the kinds listed in `events` are sent. With a `secret`, each POST carries
`X-Ulyssesd-Signature: sha256=<hex HMAC-SHA256 of the raw body>` (GitHub's scheme) and
`X-Ulyssesd-Timestamp`, so a receiver can reject forged or replayed alerts.

The main loop is single-threaded and pings the systemd watchdog, so it must not sit in HTTP retries.
`AlertSender.send(text)` only enqueues (bounded queue; when full the alert is dropped and counted) and one
small worker thread does the POSTs; the loop calls `drain()` each tick to collect `AlertOutcome`s to log or
record. `send_now(text)` is the bounded synchronous path the worker uses (and tests/CLIs may use):
attempts stop after `max_attempts` or `max_total_s`, each attempt's HTTP timeout is cut to the time left.
Retried: connection errors, timeouts, HTTP 429 and 5xx. Not retried: other 4xx (a wrong URL stays wrong).
The URL carries a secret (Slack puts the token in the path), so logs only ever show its host.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger

_stop_delay: Callable[[float], stop_base]  # either class below: same constructor
try:  # tenacity >= 8.3: also counts the upcoming wait, so an alert never sleeps past its bound
    from tenacity import stop_before_delay as _stop_delay
except ImportError:  # pragma: no cover
    from tenacity import stop_after_delay as _stop_delay


#: Every event kind the daemon can send. incident: a detector or the store found trouble (an escalation too);
#: action: a remediation was recorded; restart: the run goes to RESTARTING/BACKOFF; hang: a hang incident;
#: completed / stopped / failed: the run ended so.
EVENTS = ("incident", "action", "restart", "hang", "completed", "stopped", "failed", "telemetry")
#: Sent when the spec does not choose: everything but `action` (each action follows an incident already sent).
DEFAULT_EVENTS = ("incident", "restart", "hang", "completed", "stopped", "failed", "telemetry")
SIGNATURE_HEADER = "X-Ulyssesd-Signature"
TIMESTAMP_HEADER = "X-Ulyssesd-Timestamp"


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for `body`: "sha256=" + hex HMAC-SHA256 keyed with `secret`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class AlertConfig:
    url: str  # webhook URL (http/https); a secret — never logged in full
    events: tuple[str, ...] = DEFAULT_EVENTS  # event kinds to send (a subset of EVENTS); others are skipped
    secret: str | None = None  # HMAC-SHA256 key for the signature header; None = unsigned
    timeout_s: float = 3.0  # per-attempt HTTP timeout
    max_attempts: int = 4  # attempts per alert, first one included
    max_total_s: float = 15.0  # wall-clock bound per alert, all attempts and waits included
    backoff_initial_s: float = 0.5  # retry wait scale: wait n is uniform in [0, min(max, this·2^n)]
    backoff_max_s: float = 5.0  # longest single wait
    queue_size: int = 32  # alerts waiting for the worker; more are dropped (and counted)
    prefix: str = f"[ulyssesd@{socket.gethostname()}]"  # prepended to every message


@dataclass(frozen=True)
class AlertOutcome:
    text: str
    ok: bool
    attempts: int
    status: int | None  # last HTTP status, None if no response
    error: str | None
    elapsed_s: float


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Permanent(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def redact(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{':' + str(parts.port) if parts.port else ''}/…"


class AlertSender:
    """Bounded, non-raising webhook alerts; see module doc for the threading story."""

    def __init__(self, config: AlertConfig) -> None:
        scheme = urlsplit(config.url).scheme
        if scheme not in ("http", "https"):  # urllib would also open file:// and ftp://
            raise ValueError(f"daemon.webhook_url must be an http(s) URL, got scheme {scheme!r}")
        unknown = sorted(set(config.events) - set(EVENTS))
        if unknown:
            raise ValueError(f"daemon.webhook_events: unknown event kind(s) {unknown}; known: {', '.join(EVENTS)}")
        self.config = config
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, str, dict] | None] = queue.Queue(maxsize=config.queue_size)
        self._outcomes: queue.SimpleQueue[AlertOutcome] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._log = get_logger("ulyssesd.alerts", webhook=redact(config.url))

    # -- synchronous, bounded -------------------------------------------------------------------------
    def payload(self, text: str, event: str = "incident", details: dict | None = None) -> bytes:
        """The POST body: Slack-compatible `text` plus the structured event (see module doc)."""
        cfg = self.config
        message = f"{cfg.prefix} {text}" if cfg.prefix else text
        return json.dumps({"text": message, "event": event, "host": socket.gethostname(), "time": SYSTEM.time(),
                           "details": details or {}}, default=str).encode()

    def send_now(self, text: str, event: str = "incident", details: dict | None = None) -> AlertOutcome:
        cfg = self.config
        message = f"{cfg.prefix} {text}" if cfg.prefix else text
        body = self.payload(text, event, details)
        headers = {"Content-Type": "application/json", "User-Agent": "ulyssesd"}
        if cfg.secret:
            headers[SIGNATURE_HEADER] = sign(cfg.secret, body)
            headers[TIMESTAMP_HEADER] = str(int(SYSTEM.time()))
        start = SYSTEM.monotonic()
        attempts = 0
        last_status: int | None = None

        def attempt() -> int:
            nonlocal attempts, last_status
            attempts += 1
            left = cfg.max_total_s - (SYSTEM.monotonic() - start)
            req = urllib.request.Request(cfg.url, data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=max(0.1, min(cfg.timeout_s, left))) as resp:
                    last_status = resp.status
                    return resp.status
            except urllib.error.HTTPError as exc:
                last_status = exc.code
                if exc.code == 429 or exc.code >= 500:
                    raise _Retryable(f"HTTP {exc.code} {exc.reason}", exc.code) from None
                raise _Permanent(f"HTTP {exc.code} {exc.reason} (not retried)", exc.code) from None
            except (urllib.error.URLError, OSError) as exc:  # refused, DNS, timeout
                reason = getattr(exc, "reason", exc)
                raise _Retryable(f"{type(reason).__name__}: {reason}") from None

        retrying = Retrying(
            stop=stop_after_attempt(cfg.max_attempts) | _stop_delay(cfg.max_total_s),
            # "full jitter": uniform in [0, min(max, initial·2^n)] — spreads retries of many daemons.
            wait=wait_random_exponential(multiplier=cfg.backoff_initial_s, max=cfg.backoff_max_s),
            retry=retry_if_exception_type(_Retryable),
            reraise=False,
        )
        error: str | None = None
        try:
            status = retrying(attempt)
            ok = 200 <= status < 300
        except RetryError as exc:
            ok, error = False, f"gave up after {attempts} attempt(s): {exc.last_attempt.exception()}"
        except _Permanent as exc:
            ok, error = False, str(exc)
        except Exception as exc:  # never raise into the caller (the main loop)
            ok, error = False, f"{type(exc).__name__}: {exc}"
        outcome = AlertOutcome(text=message, ok=ok, attempts=attempts, status=last_status, error=error,
                               elapsed_s=round(SYSTEM.monotonic() - start, 3))
        if ok:
            self._log.info("alert sent", alert_event=event, attempts=attempts, status=last_status)
        else:
            self._log.warning("alert not delivered", alert_event=event, attempts=attempts, status=last_status,
                              error=error)
        return outcome

    # -- asynchronous, for the main loop -------------------------------------------------------------
    def wants(self, event: str) -> bool:
        return event in self.config.events

    def send(self, text: str, event: str = "incident", details: dict | None = None) -> bool:
        """Queue an alert for the worker; False if the spec did not choose `event`, or (counted in
        `dropped`) if the queue is full."""
        if not self.wants(event):
            return False
        self._ensure_worker()
        try:
            self._queue.put_nowait((text, event, dict(details or {})))
            return True
        except queue.Full:
            self.dropped += 1
            self._log.warning("alert queue full; alert dropped", dropped=self.dropped, queue_size=self.config.queue_size)
            return False

    def drain(self) -> list[AlertOutcome]:
        """Outcomes finished since the last drain (non-blocking)."""
        out: list[AlertOutcome] = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 5.0) -> list[AlertOutcome]:
        """Let the worker finish queued alerts for up to timeout_s, then return the undrained outcomes."""
        if self._worker is not None:
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._worker.join(timeout_s)
            self._worker = None
        return self.drain()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="ulyssesd-alerts", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._outcomes.put(self.send_now(*item))
