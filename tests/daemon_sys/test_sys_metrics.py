"""Prometheus metrics: scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import math
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ulyssesd.daemon.host.metrics import METRIC_NAMES, Metrics
from ulyssesd.daemon.store.records import RelaunchCounts


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


def _types(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def test_scrape_after_updates():
    port = _free_port()
    m = Metrics(port=port)
    assert m.start()
    try:
        m.update(run_id="tiny-1", step=120, step_time=1764444400.5, loss=2.31, tokens_per_s=11217.0,
                 step_time_s=0.82, step_time_max_s=1.9, slowest_rank=5, mem_allocated_gib=41.2,
                 mem_max_allocated_gib=66.9, state="RUNNING", attempt=4,
                 relaunch_counts=lambda: RelaunchCounts(restarts=2, operator_relaunches=1), config_version=3,
                 incidents_by_symptom={"crash": 2, "loss_spike": 1}, actions_by_kind={"restart": 2},
                 now=1764444444.0)
        got = _scrape(port)
        assert got["ulyssesd_step"] == 120 and got["ulyssesd_loss"] == 2.31
        assert got["ulyssesd_last_step_timestamp_seconds"] == 1764444400.5
        assert got["ulyssesd_tokens_per_second"] == 11217.0
        assert got["ulyssesd_memory_max_allocated_bytes"] == 66.9 * 1024 ** 3  # base units: bytes, not GiB
        assert got["ulyssesd_memory_allocated_bytes"] == 41.2 * 1024 ** 3
        assert got["ulyssesd_rank_step_duration_seconds{rank=0}"] == 0.82
        assert got["ulyssesd_rank_step_duration_seconds{rank=5}"] == 1.9
        assert got["ulyssesd_state{state=RUNNING}"] == 1 and got["ulyssesd_restarts_total"] == 2
        assert got["ulyssesd_operator_relaunches_total"] == 1
        assert got["ulyssesd_incidents_total{symptom=crash}"] == 2 and got["ulyssesd_config_version"] == 3
        assert got["ulyssesd_actions_total{kind=restart}"] == 2
        assert got["ulyssesd_run_info{run_id=tiny-1}"] == 1
        assert got["ulyssesd_last_update_timestamp_seconds"] == 1764444444.0
        types = _types(port)
        for counter in ("ulyssesd_restarts", "ulyssesd_operator_relaunches", "ulyssesd_incidents", "ulyssesd_actions"):
            assert types[counter] == "counter", (counter, types[counter])
        # every documented family is exposed once the loop has published everything, and nothing else
        exposed = {s.name for fam in text_string_to_metric_families(
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
            for s in fam.samples if s.name.startswith("ulyssesd_")}
        assert {n for n in exposed if not n.endswith("_created")} == set(METRIC_NAMES)
        m.update(state="REMEDIATING", loss="nan", incidents_by_symptom={"crash": 3}, step_time_s=0.8)
        got = _scrape(port)
        assert got["ulyssesd_state{state=RUNNING}"] == 0 and got["ulyssesd_state{state=REMEDIATING}"] == 1
        assert math.isnan(got["ulyssesd_loss"]) and got["ulyssesd_step"] == 120  # None = unchanged
        # a counter never goes back: a symptom absent from this tick keeps its count
        assert got["ulyssesd_incidents_total{symptom=loss_spike}"] == 1
        assert got["ulyssesd_incidents_total{symptom=crash}"] == 3
        # per-rank times are this step's only: rank 5 is no longer the slowest
        assert "ulyssesd_rank_step_duration_seconds{rank=5}" not in got
    finally:
        m.close()


def test_relaunch_counts_are_read_once_per_attempt_and_a_store_error_keeps_the_last_values():
    port = _free_port()
    m = Metrics(port=port)
    assert m.start()
    reads: list[int] = []

    def counts(restarts: int, operator: int):
        def read() -> RelaunchCounts:
            reads.append(restarts)
            return RelaunchCounts(restarts=restarts, operator_relaunches=operator)
        return read

    def broken() -> RelaunchCounts:
        raise OSError("database is locked")

    try:
        m.update(attempt=2, relaunch_counts=counts(1, 0))
        for _ in range(5):  # ticks of the same attempt: the store is not asked again
            m.update(attempt=2, relaunch_counts=counts(99, 99))
        assert reads == [1]
        got = _scrape(port)
        assert got["ulyssesd_restarts_total"] == 1 and got["ulyssesd_operator_relaunches_total"] == 0
        m.update(attempt=3, relaunch_counts=broken)  # logged, not raised; the counters keep their values
        assert _scrape(port)["ulyssesd_restarts_total"] == 1
        m.update(attempt=3, relaunch_counts=counts(1, 1))  # retried at the next tick
        got = _scrape(port)
        assert reads == [1, 1] and got["ulyssesd_operator_relaunches_total"] == 1
    finally:
        m.close()


def test_configurable_address_is_the_one_bound():
    port = _free_port()
    m = Metrics(port=port, host="127.0.0.2")  # any loopback address other than the default
    try:
        assert m.start()
        m.update(step=7)
        text = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5).read().decode()
        assert "ulyssesd_step 7.0" in text
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    finally:
        m.close()


def test_grafana_dashboard_uses_only_exposed_metrics():
    dashboard = json.loads((Path(__file__).parents[2] / "docs" / "grafana" / "ulyssesd.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\bulyssesd_[a-z_]+", expr))
        assert names, f"panel expression without a ulyssesd metric: {expr}"
        used |= names
    unknown = used - set(METRIC_NAMES)
    assert not unknown, f"dashboard uses metrics the daemon does not expose: {sorted(unknown)}"
    assert {"ulyssesd_last_step_timestamp_seconds", "ulyssesd_rank_step_duration_seconds",
            "ulyssesd_incidents_total", "ulyssesd_actions_total"} <= used


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
