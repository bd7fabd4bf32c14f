"""Optional outputs wired into the loop: a webhook alert on FAILED, Prometheus gauges from the tick."""

from __future__ import annotations

from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState


class FakeAlerts:
    def __init__(self):
        self.sent: list[str] = []

    def send(self, text):
        self.sent.append(text)
        return True

    def drain(self):
        return []


class FakeMetrics:
    def __init__(self):
        self.last = {}

    def update(self, **kw):
        self.last = kw


def test_failed_run_alerts_and_metrics_follow_the_loop(tmp_path, make_sup):
    from ulyssesd.daemon.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    spec = load_run_spec(fake_spec(tmp_path, steps=10, faults=[{"kind": "exit_at_start", "attempts": list(range(1, 30))}],
                                   remediation={"max_restarts_per_hour": 2}))
    alerts, metrics = FakeAlerts(), FakeMetrics()
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(), alerts=alerts, metrics=metrics)
    sup.start()
    run_until(sup, lambda s: s.state == RunState.FAILED, timeout=60)
    sup.tick()
    assert len(alerts.sent) == 1 and "FAILED" in alerts.sent[0] and sup.run_id in alerts.sent[0]
    assert metrics.last["state"] == "FAILED" and metrics.last["incidents_by_symptom"]
