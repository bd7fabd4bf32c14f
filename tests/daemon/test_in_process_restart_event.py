"""The job's `in_process_restart` event recorded on an incident (daemon/telemetry/in_process.py), real SQLite."""

from __future__ import annotations

from ulyssesd.daemon.core.incident_log import IncidentLog, Position
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.telemetry.in_process import record_in_process_restart


def _log(tmp_path):
    store = open_store(tmp_path / "u.db")
    store.create_run("r", run_dir=str(tmp_path / "r"), spec_path=None, spec={}, state=RunState.RUNNING)
    said: list[str] = []
    log = IncidentLog(store, lambda: Position("r", 1, 7), alert=lambda *a, **k: None, say=said.append)
    return log, store, said


def test_a_nan_restored_in_process_is_a_resolved_incident_with_the_jobs_action(tmp_path):
    log, store, said = _log(tmp_path)
    iid = record_in_process_restart(log, store, said.append, 7, {
        "path": "in_process", "reason": "nan_loss", "error": "loss nan", "failed_step": 7, "tag": "step-00000006",
        "restored_step": 6, "seconds": 0.03, "disk_reads": 0, "skipped_samples": [6, 7], "loss": "nan"})
    inc = store.get_incident(iid)
    assert inc.symptom == Symptom.nan_loss and inc.step == 7 and inc.status == IncidentStatus.resolved
    assert inc.evidence["path"] == "in_process" and inc.evidence["restored_step"] == 6
    (act,) = store.list_actions(incident_id=iid)
    assert act.kind == ActionKind.rollback_skip and act.mode == ApplyMode.hot
    assert act.parameters["path"] == "in_process" and act.parameters["disk_reads"] == 0
    assert any("restored in-process" in line for line in said)


def test_an_exception_restored_in_process_is_a_crash_incident_with_a_restart_action(tmp_path):
    log, store, said = _log(tmp_path)
    iid = record_in_process_restart(log, store, said.append, 5, {
        "path": "in_process", "reason": "exception", "error": "rank 1: InjectedFault: boom", "failed_step": 5,
        "tag": "step-00000003", "restored_step": 3, "seconds": 0.1})
    inc = store.get_incident(iid)
    assert inc.symptom == Symptom.crash and inc.status == IncidentStatus.resolved
    assert store.list_actions(incident_id=iid)[0].kind == ActionKind.restart


def test_a_fallback_leaves_the_incident_open_for_the_usual_path_on_the_same_incident(tmp_path):
    log, store, said = _log(tmp_path)
    iid = record_in_process_restart(log, store, said.append, 1, {
        "path": "fallback", "reason": "nan_loss", "error": "loss nan", "failed_step": 1,
        "fallback_reason": "rank 0: no snapshot in host memory"})
    inc = store.get_incident(iid)
    assert inc.status == IncidentStatus.open and "no snapshot in host memory" in inc.summary
    assert store.list_actions(incident_id=iid) == []
    # The detectors' NaN finding at that step lands on the same incident (the store deduplicates).
    assert log.incident(Symptom.nan_loss, 1, Severity.critical, "nan loss", {}) == iid
