"""The exit handler's guard and the one-line state reasons, on the fake OS and a real SQLite store.

An exception inside the code that handles an attempt's exit must not kill the daemon: it is logged, recorded
as a crash incident with its traceback, and the run goes on where the termination plan said (a stop stays a
stop; a crash relaunches within the restart budget). A transition's recorded reason says each thing once.
"""

from __future__ import annotations

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup

from ulyssesd.daemon.core import attempt_diagnosis
from ulyssesd.daemon.core.states import transition_reason
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.store.enums import RunState

S = RunState


def _crash(fos, sup):
    with open(fos.jobs[sup.job.pid]["log"], "a") as fh:
        fh.write("Traceback (most recent call last):\nRuntimeError: boom\n")
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))


def _running(sup, fos, first_step=1):
    _emit(sup, kind="event", event="started", step=first_step - 1)
    _steps(sup, first_step, first_step + 2)
    assert sup.state == S.RUNNING


def test_an_exception_in_the_exit_handler_is_an_incident_and_the_run_relaunches(tmp_path, monkeypatch):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    _running(sup, fos)
    real = attempt_diagnosis.diagnose_attempt
    calls = {"n": 0}

    def broken_once(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("diagnosis exploded")
        return real(*a, **kw)

    monkeypatch.setattr(attempt_diagnosis, "diagnose_attempt", broken_once)
    _crash(fos, sup)
    sup.tick()  # must not raise
    assert calls["n"] == 1
    assert sup.attempt == 2 and sup.job is not None and sup.state == S.STARTING
    incs = sup.store.list_incidents(sup.run_id)
    internal = [sup.store.get_incident(i.id) for i in incs if "exit" in i.summary and "failed" in i.summary]
    assert len(internal) == 1, [i.summary for i in incs]
    inc = internal[0]
    assert inc.symptom.value == "crash" and inc.attempt == 1
    assert "RuntimeError: diagnosis exploded" in inc.summary
    assert "diagnosis exploded" in inc.evidence["internal_error"] and "Traceback" in inc.evidence["internal_error"]
    att1 = sup.store.list_attempts(sup.run_id)[0]
    assert att1.ended_at is not None and att1.diagnosis == "internal_error"
    # The next crash is handled the normal way again (the guard is not sticky).
    _running(sup, fos, first_step=4)
    _crash(fos, sup)
    sup.tick()
    assert sup.attempt == 3 and calls["n"] == 2
    normal = [i for i in sup.store.list_incidents(sup.run_id) if i.attempt == 2]
    assert [i.symptom.value for i in normal] == ["crash"] and "diagnosis" in normal[0].summary


def test_an_exit_handler_that_always_fails_ends_in_the_restart_budget_not_a_loop(tmp_path, monkeypatch):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, remediation={"max_restarts_per_hour": 3, "no_progress_restarts": 10})
    sup.start()

    def broken(*a, **kw):
        raise ValueError("always broken")

    monkeypatch.setattr(attempt_diagnosis, "diagnose_attempt", broken)
    for _ in range(10):
        if sup.state == S.FAILED:
            break
        _running(sup, fos)
        _crash(fos, sup)
        sup.tick()
    assert sup.state == S.FAILED
    assert sup.attempt == 4  # 3 relaunches allowed per hour, the 4th exit hits the budget
    symptoms = [i.symptom.value for i in sup.store.list_incidents(sup.run_id)]
    assert symptoms.count("crash") == 4 and "crash_loop" in symptoms


def test_an_exception_in_the_exit_handler_after_an_operator_stop_still_stops(tmp_path, monkeypatch):
    fos = FakeOS()
    fos.term_behaviour = "exit0"
    sup = _sup(tmp_path, fos)
    sup.start()
    _running(sup, fos)

    def store_down(*a, **kw):
        raise OSError(5, "Input/output error")

    assert sup.handle_command({"cmd": "stop"})["ok"]
    assert sup.state == S.STOPPING
    monkeypatch.setattr(sup.store, "end_attempt", store_down)
    for _ in range(5):
        if sup.state == S.STOPPED:
            break
        fos.advance(0.5)
        sup.tick()
    assert sup.state == S.STOPPED and len(fos.spawns) == 1  # stopped honestly, nothing relaunched
    incs = sup.store.list_incidents(sup.run_id)
    assert any("Input/output error" in i.summary for i in incs), [i.summary for i in incs]


def _stopped_by_the_operator(tmp_path):
    fos = FakeOS()
    fos.term_behaviour = "exit0"
    sup = _sup(tmp_path, fos)
    sup.start()
    _running(sup, fos)
    sup.handle_command({"cmd": "stop"})
    for _ in range(5):
        fos.advance(0.5)
        sup.tick()
    assert sup.state == S.STOPPED
    return sup


def test_a_healthy_stop_records_no_internal_error(tmp_path):
    # The negative control of the guard: the normal stop path records no incident at all.
    sup = _stopped_by_the_operator(tmp_path)
    assert sup.store.list_incidents(sup.run_id) == []


def test_stop_reason_is_said_once(tmp_path):
    sup = _stopped_by_the_operator(tmp_path)
    reason = sup.store.get_run(sup.run_id).state_reason
    assert reason == "job exited after operator stop", reason
    last = sup.store.list_transitions(sup.run_id)[-1]
    assert last.to_state == S.STOPPED and last.reason == reason


@pytest.mark.parametrize(("reason", "table", "expected"), [
    ("job exited after operator stop", "job exited after stop", "job exited after operator stop"),
    ("reached final step 40", "reached final step", "reached final step 40"),
    ("operator pause by uid 0", "job asked to stop", "operator pause by uid 0 (job asked to stop)"),
    ("operator stop by uid 0", "job asked to stop", "operator stop by uid 0"),
    ("internal error in engine: KeyError: 'x'", "budget exhausted or an unrecoverable error",
     "internal error in engine: KeyError: 'x'"),
    ("nan_loss: lr -10%", "anomaly detected", "nan_loss: lr -10% (anomaly detected)"),
])
def test_transition_reason_adds_the_table_reason_only_when_it_says_something_new(reason, table, expected):
    assert transition_reason(reason, table) == expected


def _repeated_phrase(reason: str) -> str | None:
    """A run of 2+ words said twice in one reason ("operator stop ... (operator stop)"), or None."""
    words = [w.strip("():;,.").lower() for w in reason.split()]
    for n in (3, 2):
        grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
        for g in grams:
            if grams.count(g) > 1:
                return g
    return None


def test_the_reasons_of_a_pause_resume_restart_crash_hang_stop_session_read_well(tmp_path):
    # Every transition reason the supervisor writes in a busy session: no "None", no phrase said twice, the
    # operator's commands start with the store's OPERATOR_REASON_PREFIX and name the uid only when known.
    from ulyssesd.daemon.store.repository.runs import OPERATOR_REASON_PREFIX

    fos = FakeOS()
    fos.term_behaviour = "exit0"
    sup = _sup(tmp_path, fos, daemon={"stack_dump_wait_s": 1.0, "hang_grace_s": 2.0},
               detectors={"hang_timeout_floor_s": 5.0}, remediation={"no_progress_restarts": 10})
    sup.start()
    _running(sup, fos)

    def settle(until, ticks=12):
        for _ in range(ticks):
            if until():
                return
            fos.advance(0.5)
            sup.tick()
        assert until(), sup.state

    assert sup.handle_command({"cmd": "pause", "peer": {"uid": 1000}})["ok"]
    settle(lambda: sup.state == S.PAUSED)
    assert sup.handle_command({"cmd": "resume", "peer": {"uid": 1000}})["ok"]
    _running(sup, fos, first_step=4)
    assert sup.handle_command({"cmd": "restart", "peer": {}})["ok"]  # uid unknown
    settle(lambda: sup.state == S.STARTING and sup.attempt == 3)
    _running(sup, fos, first_step=7)
    _crash(fos, sup)
    settle(lambda: sup.attempt == 4 and sup.job is not None)
    _running(sup, fos, first_step=10)
    fos.term_behaviour = "ignore"  # hung: only SIGKILL ends it
    fos.advance(6.0)  # no step for longer than the hang timeout
    settle(lambda: sup.attempt == 5 and sup.job is not None, ticks=20)
    assert [i.symptom.value for i in sup.store.list_incidents(sup.run_id)] == ["crash", "hang"]
    _running(sup, fos, first_step=13)
    fos.term_behaviour = "exit0"
    assert sup.handle_command({"cmd": "stop", "peer": {"uid": 0}})["ok"]
    settle(lambda: sup.state == S.STOPPED)

    reasons = [t.reason for t in sup.store.list_transitions(sup.run_id)]
    for r in reasons:
        assert "None" not in r and "uid None" not in r, (r, reasons)
        assert _repeated_phrase(r) is None, (r, _repeated_phrase(r), reasons)
    operator = [r for r in reasons if r.startswith(OPERATOR_REASON_PREFIX)]
    assert operator == ["operator pause by uid 1000 (job asked to stop)", "operator restart", "operator stop by uid 0"], \
        reasons
    assert reasons[-1] == "job exited after operator stop"
    # The store tells the operator's relaunches (pause+resume, restart) from the restarts (crash, hang).
    counts = sup.store.relaunch_counts(sup.run_id)
    assert (counts.operator_relaunches, counts.restarts) == (2, 2), (counts, reasons)


@pytest.mark.parametrize(("reason", "repeated"), [
    ("operator stop (uid None) (stop requested)", None),  # "None" is caught by the other assertion
    ("operator stop (operator stop)", "operator stop"),
    ("relaunch in 2.0s (crash, relaunching) (crash, relaunching)", "crash relaunching"),
])
def test_the_repeated_phrase_check_catches_a_phrase_said_twice(reason, repeated):
    assert _repeated_phrase(reason) == repeated


@pytest.mark.parametrize(("peer", "expected"), [
    ({"uid": 1000, "pid": 7}, "operator stop by uid 1000"),
    ({"uid": 0}, "operator stop by uid 0"),  # root is a known uid, not a missing one
    ({}, "operator stop"),
    (None, "operator stop"),
    ({"uid": None}, "operator stop"),
])
def test_an_operator_reason_names_the_uid_only_when_known(peer, expected):
    from ulyssesd.daemon.core.commands import operator_reason

    assert operator_reason("stop", peer) == expected


def test_an_ack_without_a_name_or_uid_does_not_record_none(tmp_path):
    from ulyssesd.daemon.store.enums import Severity, Symptom

    sup = _stopped_by_the_operator(tmp_path)
    iid = sup.incidents.incident(Symptom.crash, 1, Severity.warning, "an incident to acknowledge", {})
    assert sup.handle_command({"cmd": "ack", "args": {"id": iid}})["ok"]  # no name, no peer credentials
    assert sup.store.get_incident(iid).acknowledged_by == "an operator (uid unknown)"
