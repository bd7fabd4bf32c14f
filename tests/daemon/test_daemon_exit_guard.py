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
    ("operator pause (uid 0)", "stop requested", "operator pause (uid 0) (stop requested)"),
    ("nan_loss: lr -10%", "anomaly detected", "nan_loss: lr -10% (anomaly detected)"),
])
def test_transition_reason_adds_the_table_reason_only_when_it_says_something_new(reason, table, expected):
    assert transition_reason(reason, table) == expected
