"""The store's restart count on a real supervised run (fake job, the daemon loop in-process): a pause +
resume is an operator relaunch, the crash of the resumed attempt is the run's one restart, and a daemon
restart takes over a restart budget that holds the crash only."""

from __future__ import annotations

from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState


def test_pause_resume_then_a_crash_is_one_restart(tmp_path, make_sup):
    # The SIGKILL fault fires in attempt 2 only (the resumed one), a few steps after it resumed.
    spec = fake_spec(tmp_path, steps=400, interval=4, faults=[{"kind": "sigkill", "at_step": 14, "attempts": [2]}])
    sup = make_sup(spec)
    sup.start()
    run_until(sup, lambda s: (s.last_step or 0) >= 5, timeout=60)
    assert sup.handle_command({"cmd": "pause"})["ok"]
    run_until(sup, lambda s: s.state == RunState.PAUSED, timeout=30)
    assert sup.store.relaunch_counts(sup.run_id).to_dict() == {"restarts": 0, "operator_relaunches": 0}
    assert sup.handle_command({"cmd": "resume"})["ok"]
    run_until(sup, lambda s: s.attempt == 3 and s.state == RunState.RUNNING, timeout=60)

    assert sup.store.relaunch_counts(sup.run_id).to_dict() == {"restarts": 1, "operator_relaunches": 1}
    assert [(r.attempt, r.by_operator) for r in sup.store.list_relaunches(sup.run_id)] == [(2, True), (3, False)]

    # A daemon restart re-adopts the run: the restart budget it takes over holds the crash, not the resume.
    again = make_sup(spec)
    again.start()
    assert again.run_id == sup.run_id and again.attempt == 3 and len(again.counters.restarts) == 1
    assert again.handle_command({"cmd": "stop"})["ok"]
    run_until(again, lambda s: s.state == RunState.STOPPED, timeout=30)
