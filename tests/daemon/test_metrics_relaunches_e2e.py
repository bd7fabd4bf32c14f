"""The Prometheus restart counters of a real supervised run (fake job, the daemon loop in-process, the
endpoint scraped over HTTP): an operator pause + resume and a crash are one operator relaunch and one restart,
the same numbers `ulyssesctl status` shows, not the attempt count (3 attempts, 2 relaunches)."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.host.metrics import Metrics
from ulyssesd.daemon.store.enums import RunState


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def test_crash_and_pause_resume_scrape_as_one_restart_and_one_operator_relaunch(tmp_path, make_sup):
    # The SIGKILL fault fires in attempt 2 only (the resumed one), a few steps after it resumed.
    spec = fake_spec(tmp_path, steps=400, interval=4, faults=[{"kind": "sigkill", "at_step": 14, "attempts": [2]}])
    port = _free_port()
    sup = make_sup(spec)
    sup.metrics = Metrics(port=port)
    assert sup.metrics.start()
    try:
        sup.start()
        run_until(sup, lambda s: (s.last_step or 0) >= 5, timeout=60)
        got = _scrape(port)
        assert got["ulyssesd_restarts_total"] == 0 and got["ulyssesd_operator_relaunches_total"] == 0
        assert sup.handle_command({"cmd": "pause"})["ok"]
        run_until(sup, lambda s: s.state == RunState.PAUSED, timeout=30)
        assert sup.handle_command({"cmd": "resume"})["ok"]
        run_until(sup, lambda s: s.attempt == 2 and s.state == RunState.RUNNING, timeout=60)
        got = _scrape(port)
        assert got["ulyssesd_restarts_total"] == 0 and got["ulyssesd_operator_relaunches_total"] == 1
        run_until(sup, lambda s: s.attempt == 3 and s.state == RunState.RUNNING, timeout=60)
        got = _scrape(port)
        assert got["ulyssesd_restarts_total"] == 1 and got["ulyssesd_operator_relaunches_total"] == 1
        assert sup.store.relaunch_counts(sup.run_id).to_dict() == {"restarts": 1, "operator_relaunches": 1}
        assert sup.handle_command({"cmd": "stop"})["ok"]
        run_until(sup, lambda s: s.state == RunState.STOPPED, timeout=30)
    finally:
        sup.metrics.close()
