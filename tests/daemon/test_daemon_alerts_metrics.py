"""Optional outputs wired into the loop: a webhook alert on FAILED, Prometheus gauges from the tick."""

from __future__ import annotations

from structlog.testing import capture_logs
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState


class FakeAlerts:
    def __init__(self):
        self.sent: list[str] = []
        self.events: list[tuple[str, dict]] = []

    def send(self, text, event="incident", details=None):
        self.sent.append(text)
        self.events.append((event, details or {}))
        return True

    def drain(self):
        return []


class FakeMetrics:
    def __init__(self):
        self.last = {}

    def update(self, **kw):
        self.last = kw


def test_failed_run_alerts_and_metrics_follow_the_loop(tmp_path, make_sup):
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    spec = load_run_spec(fake_spec(tmp_path, steps=10, faults=[{"kind": "exit_at_start", "attempts": list(range(1, 30))}],
                                   remediation={"max_restarts_per_hour": 2}))
    alerts, metrics = FakeAlerts(), FakeMetrics()
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(), alerts=alerts, metrics=metrics)
    with capture_logs() as logs:
        sup.start()
        run_until(sup, lambda s: s.state == RunState.FAILED, timeout=60)
        sup.tick()
    kinds = [e for e, _ in alerts.events]
    assert kinds[-1] == "failed" and kinds.count("failed") == 1, kinds  # one FAILED alert, the last one
    assert "FAILED" in alerts.sent[-1] and sup.run_id in alerts.sent[-1]
    assert "restart" in kinds and "incident" in kinds and "action" in kinds, kinds  # crash -> restart -> ...
    assert alerts.events[-1][1]["run_id"] == sup.run_id and alerts.events[-1][1]["state"] == "FAILED"
    assert metrics.last["state"] == "FAILED" and metrics.last["incidents_by_symptom"]
    assert metrics.last["actions_by_kind"] and metrics.last["relaunch_counts"]().restarts >= 1
    # levels that mean something: the crash incidents at error, the FAILED transition at critical, and the
    # narration copies no longer duplicate the structured lines
    by_event = {}
    for rec in logs:
        by_event.setdefault(rec["event"], []).append(rec)
    assert {r["log_level"] for r in by_event["incident"] if r["symptom"] in ("crash", "crash_loop")} == {"error"}
    failed = [r for r in by_event["state"] if r["to"] == "FAILED"]
    assert len(failed) == 1 and failed[0]["log_level"] == "critical"
    healthy = [r for r in by_event["state"] if r["to"] != "FAILED"]
    assert healthy and {r["log_level"] for r in healthy} == {"info"}
    assert {r["log_level"] for r in by_event["attempt ended"]} == {"error"}  # every attempt crashed
    assert "event" not in by_event and "narration" not in by_event


def test_hang_and_operator_stop_send_their_events(tmp_path):
    """A hang is its own event kind (paged apart from other incidents) and an operator stop says `stopped`;
    a healthy stretch of the same run sends nothing at all."""
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    spec = load_run_spec(fake_spec(tmp_path, steps=400, interval=5, faults=[{"kind": "hang", "at_step": 8}]))
    alerts = FakeAlerts()
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(), alerts=alerts)
    sup.start()
    try:
        run_until(sup, lambda s: (s.last_step or 0) >= 6, timeout=60)
        assert alerts.events == []  # healthy steps: no alert
        run_until(sup, lambda s: s.attempt >= 2 and (s.last_step or 0) >= 12, timeout=60)
        kinds = [e for e, _ in alerts.events]
        assert "hang" in kinds and "restart" in kinds, kinds
        hang = dict(alerts.events)["hang"]
        assert hang["symptom"] == "hang" and hang["attempt"] == 1 and hang["run_id"] == sup.run_id
        assert sup.handle_command({"cmd": "stop"})["ok"]
        run_until(sup, lambda s: s.state == RunState.STOPPED, timeout=30)
    finally:
        if sup.job is not None:
            import signal

            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
    assert alerts.events[-1][0] == "stopped" and alerts.events[-1][1]["state"] == "STOPPED"
    assert "failed" not in [e for e, _ in alerts.events]
