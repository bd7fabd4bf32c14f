"""Incidents of operator requests (core/commands.py) and what is left open when a run completes
(core/incident_log.IncidentLog.resolve_all), on the fake OS and a real store.

A refused request is an answer, not an incident. A request that raises is one `internal_error` incident per
command, resolved by the next request of the same command that is handled without raising (another
command's success proves nothing about it). Whatever is still open or remediating when the run completes
is resolved, saying so; an escalated incident stays, waiting for its human.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from test_daemon_step_guard import _internal, _raiser, _running, _tick
from test_daemon_unit_fakeos import _emit

from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.store.enums import IncidentStatus, RunState

S = RunState
CTL = Path(sys.executable).parent / "ulyssesctl"


def test_refused_requests_are_answers_not_incidents(tmp_path):
    fos, sup = _running(tmp_path)
    refusals = {
        "bad_state": {"cmd": "resume"},  # the run is RUNNING, not PAUSED
        "bad_request": {"cmd": "ack", "args": {"id": 0}},
        "not_found": {"cmd": "ack", "args": {"id": 999}},
        "unknown_command": {"cmd": "reboot"},
    }
    for code, req in refusals.items():
        resp = sup.handle_command(req)
        assert resp["ok"] is False and resp["code"] == code, resp
    _tick(sup, fos, 2)
    assert sup.store.list_incidents(sup.run_id) == []
    assert sup.status_dict()["tick_step_errors"] == {}
    assert sup.state == S.RUNNING


def test_a_request_that_raised_is_resolved_by_the_next_clean_request_of_the_same_command(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    monkeypatch.setattr(sup.store, "ack_incident", _raiser(sup.store.ack_incident, 2))  # two acks fail
    for _ in range(2):
        resp = sup.handle_command({"cmd": "ack", "args": {"id": 1}})
        assert resp == {"ok": False, "code": "internal",
                        "error": "internal error handling 'ack' (Injected); see the daemon log"}
    [inc] = _internal(sup, "control_request:ack")  # one incident for the repeated error
    assert inc.status == IncidentStatus.open
    # Other commands answering cleanly (status, a refused resume) say nothing about ack: still open.
    _tick(sup, fos, 3)
    assert sup.handle_command({"cmd": "resume"})["code"] == "bad_state"
    assert sup.store.get_incident(inc.id).status == IncidentStatus.open
    # The same command handled without raising resolves it, whatever the answer (here: no such incident).
    assert sup.handle_command({"cmd": "ack", "args": {"id": inc.id + 100}})["code"] == "not_found"
    done = sup.store.get_incident(inc.id)
    assert done.status == IncidentStatus.resolved and done.status_reason == "control_request:ack ran cleanly again"
    assert sup.state == S.RUNNING


def test_what_is_still_open_when_the_run_completes_is_resolved_and_escalated_stays(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    # A request that failed once and was never retried.
    monkeypatch.setattr(sup, "stop_run", _raiser(sup.stop_run, None))
    assert sup.handle_command({"cmd": "pause"})["code"] == "internal"
    [failed_pause] = _internal(sup, "control_request:pause")
    # Left open by an earlier attempt or daemon (nothing in this daemon's memory refers to it), and one that
    # waits for a human.
    store, run_id = sup.store, sup.run_id
    earlier = store.record_incident(run_id, attempt=1, symptom="slow_step", step=2, summary="slow")
    asked = store.record_incident(run_id, attempt=1, symptom="disk_full", step=1, summary="final save failed")
    store.update_incident_status(asked, IncidentStatus.escalated, "final save failed; nothing to retry now")
    # Attempt 1 crashes (its crash incident waits for its fix to be verified); attempt 2 trains to the end.
    monkeypatch.undo()
    fos.die(sup.job.pid, ExitStatus(None, signal.SIGSEGV, "wait"))
    for _ in range(10):
        fos.advance(1.0)
        sup.tick()
        if sup.attempt == 2 and sup.job is not None:
            break
    assert sup.attempt == 2
    _emit(sup, kind="event", event="started", step=3)
    _tick(sup, fos, 2)
    assert len(store.list_incidents(run_id, status="open") + store.list_incidents(run_id, status="remediating")) == 3
    _emit(sup, kind="event", event="exiting", reason="completed", step=sup.last_step)
    fos.die(sup.job.pid, ExitStatus(0, None, "file"))
    sup.tick()
    assert sup.state == S.COMPLETED
    for iid in (failed_pause.id, earlier):
        inc = store.get_incident(iid)
        assert inc.status == IncidentStatus.resolved, inc
        assert inc.status_reason == "run completed: nothing left to act on (still open when the run completed)"
    [crash] = store.list_incidents(run_id, symptom="crash")
    assert crash.status == IncidentStatus.resolved and crash.status_reason == "run completed"
    assert store.get_incident(asked).status == IncidentStatus.escalated
    # What `ulyssesctl status` shows of the finished run: nothing open.
    res = subprocess.run([str(CTL), "--state-dir", str(sup.dcfg.state_dir), "status", "--json"],
                         capture_output=True, text=True, timeout=60)
    shown = json.loads(res.stdout)
    assert shown["state"] == "COMPLETED" and shown["open_incidents"] == 0 and shown["open_incident_list"] == []


def test_a_run_that_does_not_complete_leaves_its_open_incidents_open(tmp_path):
    # The healthy counterpart of the sweep: an operator stop is not a completion; nothing is resolved for it.
    fos, sup = _running(tmp_path)
    fos.term_behaviour = "exit0"
    left = sup.store.record_incident(sup.run_id, attempt=1, symptom="slow_step", step=2, summary="slow")
    assert sup.handle_command({"cmd": "stop"})["ok"]
    _tick(sup, fos, 2)
    assert sup.state == S.STOPPED
    assert sup.store.get_incident(left).status == IncidentStatus.open
