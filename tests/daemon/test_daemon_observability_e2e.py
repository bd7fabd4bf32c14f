"""A real `ulyssesd run` (subprocess, fake job, a SIGKILL at step 12) under a stand-in for systemd's journal
stream, with its Prometheus endpoint scraped while it runs and its webhook pointed at a local HTTP server:
the three outputs an operator's tools read, checked together on one real daemon."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families
from uls_daemon_helpers import fake_spec

from ulyssesd.daemon.host.alerts import SIGNATURE_HEADER, sign


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Receiver:
    def __init__(self) -> None:
        self.posts: list[tuple[bytes, str | None]] = []
        receiver = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.posts.append((self.rfile.read(int(self.headers["Content-Length"])),
                                       self.headers.get(SIGNATURE_HEADER)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def test_journal_priorities_metrics_and_webhooks_of_a_real_daemon(tmp_path):
    port, hook = _free_port(), _Receiver()
    spec = fake_spec(tmp_path, steps=40, interval=5, faults=[{"kind": "sigkill", "at_step": 12}],
                     daemon={"prometheus_port": port, "webhook_url": hook.url,
                             "webhook_events": ["incident", "action", "restart", "hang", "completed", "stopped",
                                                "failed"],
                             "webhook_secret_env": "ULS_TEST_HOOK_KEY"})
    out = tmp_path / "journal-stream"
    scrapes: list[dict[str, float]] = []
    try:
        with out.open("wb") as fh:
            st = os.fstat(fh.fileno())
            env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}", "ULS_TEST_HOOK_KEY": "k3y"}
            env.pop("ULYSSESD_LOG_LEVEL", None)
            d = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                                 env=env, stdout=fh, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 90
            while d.poll() is None and time.monotonic() < deadline:
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                    scrapes.append(_samples(text))
                except OSError:
                    pass
                time.sleep(0.1)
            assert d.wait(30) == 0
    finally:
        hook.server.shutdown()
        hook.server.server_close()

    # journald: every line is "<N>" + one JSON object; the crash is an error, the ending is info
    lines = out.read_text().splitlines()
    assert lines and all(line[:1] == "<" and line[2:4] == ">{" for line in lines), lines[:3]
    records = [(int(line[1]), json.loads(line[3:])) for line in lines]
    crash = [(p, r) for p, r in records if r["event"] == "incident" and r.get("symptom") == "crash"]
    assert crash and all(p == 3 and r["level"] == "error" for p, r in crash)
    assert any(p == 4 and r["event"] == "action" for p, r in records)
    done = [(p, r) for p, r in records if r["event"] == "state" and r.get("to") == "COMPLETED"]
    assert len(done) == 1 and done[0][0] == 6
    assert not [r for _, r in records if r["event"] in ("event", "narration")]  # one line per event
    in_loop = [r for _, r in records if r["event"] in ("incident", "action", "attempt ended")]
    assert in_loop and all(r.get("run_id") and r.get("attempt") for r in in_loop)  # bound context

    # Prometheus: scraped while running; counters and base units as documented
    assert scrapes, "the metrics endpoint never answered"
    last = scrapes[-1]
    assert max(s.get("ulyssesd_step", 0) for s in scrapes) >= 20
    assert last["ulyssesd_incidents_total{symptom=crash}"] == 1 and last["ulyssesd_restarts_total"] >= 1
    assert any(k.startswith("ulyssesd_actions_total{kind=") for k in last)
    assert last["ulyssesd_memory_max_allocated_bytes"] > 1e8  # the fake job reports ~1 GiB, in bytes here
    assert abs(last["ulyssesd_last_step_timestamp_seconds"] - time.time()) < 120

    # webhook: every event signed; the crash, its action, the restart and the completion all arrived
    events = []
    for body, signature in hook.posts:
        assert signature == sign("k3y", body)
        payload = json.loads(body)
        assert payload["text"].startswith("[ulyssesd@") and payload["details"]["run_id"]
        events.append(payload["event"])
    assert {"incident", "action", "restart", "completed"} <= set(events), events
    assert events[-1] == "completed"
