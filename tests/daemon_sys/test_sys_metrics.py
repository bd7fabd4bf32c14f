"""Prometheus metrics: scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import math
import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ulyssesd.daemon.metrics import Metrics


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_scrape_after_updates():
    port = _free_port()
    m = Metrics(port=port)
    assert m.start()
    try:
        m.update(run_id="tiny-1", step=120, loss=2.31, tokens_per_s=11217.0, mem_allocated_gib=41.2,
                 mem_max_allocated_gib=66.9, state="RUNNING", restarts=2, config_version=3,
                 incidents_by_symptom={"crash": 2, "loss_spike": 1}, now=1764444444.0)
        got = _scrape(port)
        assert got["ulyssesd_step"] == 120 and got["ulyssesd_loss"] == 2.31
        assert got["ulyssesd_tokens_per_second"] == 11217.0 and got["ulyssesd_memory_max_allocated_gib"] == 66.9
        assert got["ulyssesd_state{state=RUNNING}"] == 1 and got["ulyssesd_restarts"] == 2
        assert got["ulyssesd_incidents{symptom=crash}"] == 2 and got["ulyssesd_config_version"] == 3
        assert got["ulyssesd_run_info{run_id=tiny-1}"] == 1
        assert got["ulyssesd_last_update_timestamp_seconds"] == 1764444444.0
        m.update(state="REMEDIATING", loss="nan", incidents_by_symptom={"crash": 3})
        got = _scrape(port)
        assert got["ulyssesd_state{state=RUNNING}"] == 0 and got["ulyssesd_state{state=REMEDIATING}"] == 1
        assert math.isnan(got["ulyssesd_loss"]) and got["ulyssesd_step"] == 120  # None = unchanged
        assert got["ulyssesd_incidents{symptom=loss_spike}"] == 0 and got["ulyssesd_incidents{symptom=crash}"] == 3
    finally:
        m.close()


def test_off_by_default_opens_nothing():
    m = Metrics()
    assert m.start() is False and not m.enabled
    m.update(step=1, state="RUNNING")  # no-op, no error


def test_port_in_use_is_logged_not_raised():
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        m = Metrics(port=blocker.getsockname()[1])
        assert m.start() is False and not m.enabled
        m.update(step=1)
    finally:
        blocker.close()
