"""Webhook alerts against a real local HTTP server that fails, then succeeds."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ulyssesd.daemon.host.alerts import EVENTS, SIGNATURE_HEADER, AlertConfig, AlertSender, redact, sign


class Hook:
    """A webhook endpoint answering a scripted list of status codes (the last one repeats)."""

    def __init__(self, statuses):
        self.statuses = list(statuses)
        self.bodies = []
        self.raw = []  # (body bytes, signature header)
        hook = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.bodies.append((self.path, self.headers["Content-Type"], json.loads(body)))
                hook.raw.append((body, self.headers.get(SIGNATURE_HEADER)))
                code = hook.statuses.pop(0) if len(hook.statuses) > 1 else hook.statuses[0]
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"ok" if code == 200 else b"err")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}/services/T000/B000/SECRET"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _cfg(url, **kw):
    base = dict(url=url, timeout_s=2.0, max_attempts=4, max_total_s=10.0, backoff_initial_s=0.05,
                backoff_max_s=0.2, prefix="[test]")
    base.update(kw)
    return AlertConfig(**base)


def test_fails_twice_then_succeeds():
    hook = Hook([500, 503, 200])
    try:
        out = AlertSender(_cfg(hook.url)).send_now("run tiny FAILED: crash loop")
        assert out.ok and out.attempts == 3 and out.status == 200 and out.error is None
        assert len(hook.bodies) == 3
        path, ctype, body = hook.bodies[-1]
        assert path == "/services/T000/B000/SECRET" and ctype == "application/json"
        assert body["text"] == "[test] run tiny FAILED: crash loop" and body["event"] == "incident"
    finally:
        hook.close()


def test_client_error_is_not_retried():
    hook = Hook([404])
    try:
        out = AlertSender(_cfg(hook.url)).send_now("x")
        assert not out.ok and out.attempts == 1 and out.status == 404 and "not retried" in out.error
    finally:
        hook.close()


def test_rate_limit_is_retried_and_gives_up_after_max_attempts():
    hook = Hook([429])
    try:
        out = AlertSender(_cfg(hook.url, max_attempts=3)).send_now("x")
        assert not out.ok and out.attempts == 3 and len(hook.bodies) == 3 and "gave up after 3" in out.error
    finally:
        hook.close()


def test_unreachable_endpoint_is_bounded_in_time_and_never_raises():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens on this port now
    t0 = time.monotonic()
    out = AlertSender(_cfg(f"http://127.0.0.1:{port}/hook", max_attempts=100, max_total_s=1.0,
                           backoff_initial_s=0.2, backoff_max_s=0.4)).send_now("x")
    elapsed = time.monotonic() - t0
    assert not out.ok and out.status is None and "refused" in out.error.lower()
    assert 1 < out.attempts < 100 and elapsed < 3.0  # stopped by the time bound, not the attempt count


def test_worker_queue_send_and_drain_without_blocking():
    hook = Hook([500, 200])
    try:
        sender = AlertSender(_cfg(hook.url))
        t0 = time.monotonic()
        assert sender.send("escalation: memory ladder exhausted")
        assert time.monotonic() - t0 < 0.1  # the main loop does not wait for HTTP
        outcomes = []
        deadline = time.monotonic() + 5
        while not outcomes and time.monotonic() < deadline:
            outcomes = sender.drain()
            time.sleep(0.02)
        assert len(outcomes) == 1 and outcomes[0].ok and outcomes[0].attempts == 2
        assert sender.close() == []
    finally:
        hook.close()


def test_full_queue_drops_and_counts():
    gate = threading.Event()
    sender = AlertSender(_cfg("http://127.0.0.1:9/x", queue_size=2))
    sender.send_now = lambda *a: gate.wait(5) or None  # worker stuck in a slow POST
    results = [sender.send(f"a{i}") for i in range(6)]
    assert results.count(False) >= 3 and sender.dropped == results.count(False)
    gate.set()


def test_bad_scheme_and_redaction():
    with pytest.raises(ValueError, match="must be an http"):
        AlertSender(_cfg("file:///etc/passwd"))
    assert redact("https://hooks.slack.com/services/T/B/SECRET") == "https://hooks.slack.com/…"


def test_every_event_kind_reaches_the_receiver_signed():
    """Each kind the daemon sends arrives as structured JSON with a Slack `text`, signed with HMAC-SHA256."""
    hook = Hook([200])
    sender = AlertSender(_cfg(hook.url, events=EVENTS, secret="s3cret"))
    try:
        for kind in EVENTS:
            assert sender.send(f"{kind} happened", event=kind, details={"run_id": "tiny", "step": 12})
        deadline = time.monotonic() + 10
        while len(hook.bodies) < len(EVENTS) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(b["event"] for _, _, b in hook.bodies) == sorted(EVENTS)
        for (_, ctype, body), (raw, signature) in zip(hook.bodies, hook.raw, strict=True):
            assert ctype == "application/json" and body["text"] == f"[test] {body['event']} happened"
            assert body["details"] == {"run_id": "tiny", "step": 12} and body["host"] and body["time"] > 0
            assert signature == sign("s3cret", raw)  # what a receiver recomputes from the raw body
            assert signature != sign("wrong", raw)
        assert all(o.ok for o in sender.close())
    finally:
        hook.close()


def test_only_the_chosen_events_are_sent_and_unknown_kinds_are_refused():
    hook = Hook([200])
    try:
        sender = AlertSender(_cfg(hook.url, events=("failed",)))
        assert sender.send("x", event="incident") is False and sender.dropped == 0  # not chosen: skipped
        assert sender.send("run failed", event="failed")
        sender.close()
        assert [b["event"] for _, _, b in hook.bodies] == ["failed"]
        assert sender.send_now("no secret").ok and hook.raw[-1][1] is None  # unsigned without a secret
    finally:
        hook.close()
    with pytest.raises(ValueError, match="unknown event kind.*'crashed'"):
        AlertSender(_cfg("http://127.0.0.1:9/x", events=("crashed",)))


def test_receiver_rejecting_the_signature_neither_blocks_nor_raises():
    """A receiver with another secret answers 401: not retried, reported in the outcome, the caller goes on."""
    hook = Hook([401])
    try:
        sender = AlertSender(_cfg(hook.url, secret="not-the-receivers"))
        t0 = time.monotonic()
        assert sender.send("hang at step 3", event="hang")
        assert time.monotonic() - t0 < 0.1  # send() only enqueues
        out = sender.close()
        assert len(out) == 1 and not out[0].ok and out[0].attempts == 1 and out[0].status == 401
    finally:
        hook.close()
