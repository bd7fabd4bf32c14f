"""What the step guard (core/housekeeping.StepGuard) records, on the fake OS and a real store: each distinct
error of a failure episode gets its own `internal_error` incident, even when the training step does not move
between them (a stalled job, a broken store failing several tick steps in one tick: before migration 0005 the
incidents' unique key folded the second into the first's row); repeats of one error stay one incident; an
error back after its step ran cleanly is a new incident, rate-limited per error; and the guard's incidents
are bounded in all."""

from __future__ import annotations

import sqlite3

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup

from ulyssesd.daemon.core import decisions, housekeeping
from ulyssesd.daemon.store import downgrade, open_store, upgrade_to_head
from ulyssesd.daemon.store.enums import RunState

S = RunState


def _running(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"step_error_limit": 1000}, detectors={"hang_timeout_floor_s": 100_000.0})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 3)
    assert sup.state == S.RUNNING and sup.last_step == 3
    return fos, sup


def _failing(monkeypatch, errors):
    """decisions.read_telemetry raises errors[i] on its i-th call while `errors` has one; then works again."""
    real, calls = decisions.read_telemetry, {"n": 0}

    def body(sup):
        calls["n"] += 1
        if calls["n"] <= len(errors):
            raise errors[calls["n"] - 1]
        return real(sup)

    monkeypatch.setattr(decisions, "read_telemetry", body)
    return calls


def _ticks(sup, fos, n, dt=1.0):
    for _ in range(n):
        fos.advance(dt)
        sup.tick()


def _internal(sup):
    return [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "internal_error"]


def test_two_different_errors_at_one_training_step_are_two_incidents_each_resolved_by_its_own_step(
        tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    _failing(monkeypatch, [ValueError("bad offset"), KeyError("cursor"), ValueError("bad offset")])
    real_publish = sup._publish
    publish_calls = {"n": 0}

    def publish():
        publish_calls["n"] += 1
        if publish_calls["n"] <= 5:
            raise OSError(28, "No space left on device")  # the same tick, another step
        real_publish()

    monkeypatch.setattr(sup, "_publish", publish)
    _ticks(sup, fos, 3)  # the job's step stays 3: the telemetry is not read
    incs = _internal(sup)
    assert sup.last_step == 3 and {i.step for i in incs} == {3}
    assert sorted(i.summary for i in incs) == [
        "internal error in publish: OSError: [Errno 28] No space left on device",
        "internal error in telemetry: KeyError: 'cursor'",
        "internal error in telemetry: ValueError: bad offset"], [i.summary for i in incs]
    for inc in incs:
        full = sup.store.get_incident(inc.id)
        assert "Traceback" in full.evidence["internal_error"] and full.status.value == "open"
        assert full.summary.rsplit(": ", 1)[-1].strip("'") in full.evidence["internal_error"]  # its own traceback
    _ticks(sup, fos, 1)  # telemetry runs cleanly again; publish still fails
    status = {i.summary.split(":")[0]: i.status.value for i in _internal(sup)}
    assert status == {"internal error in telemetry": "resolved", "internal error in publish": "open"}, status
    _ticks(sup, fos, 3)
    assert {i.status.value for i in _internal(sup)} == {"resolved"} and len(_internal(sup)) == 3


def test_a_repeating_error_is_one_incident_and_its_return_after_recovery_a_new_one_rate_limited(
        tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    same = RuntimeError("store locked")
    calls = _failing(monkeypatch, [same] * 100)
    _ticks(sup, fos, 120)  # 100 raises in a row, then clean ticks
    assert calls["n"] >= 101 and len(_internal(sup)) == 1 and _internal(sup)[0].status.value == "resolved"
    assert sup.guard.counts() == {"telemetry": 100}

    # Back two minutes after its incident was recorded: counted and logged, no new incident (rate limit)...
    _failing(monkeypatch, [same] * 3)
    _ticks(sup, fos, 5)
    assert len(_internal(sup)) == 1
    # ... and back after RECUR_RECORD_EVERY_S: its own incident, saying it was seen before.
    fos.advance(housekeeping.RECUR_RECORD_EVERY_S)
    _failing(monkeypatch, [same] * 2)
    _ticks(sup, fos, 4)
    incs = _internal(sup)
    assert len(incs) == 2 and incs[1].id != incs[0].id
    assert sup.store.get_incident(incs[1].id).evidence["seen_before"] == 103
    assert incs[1].status.value == "resolved"


def test_the_guards_incidents_are_bounded_in_all(tmp_path, monkeypatch):
    monkeypatch.setattr(housekeeping, "MAX_ERROR_INCIDENTS", 4)
    fos, sup = _running(tmp_path)
    _failing(monkeypatch, [RuntimeError(f"error {n}") for n in range(30)])  # 30 distinct errors in a row
    _ticks(sup, fos, 40)
    assert len(_internal(sup)) == 4 and sup.guard.counts() == {"telemetry": 30}
    assert sup.state == S.RUNNING


# ------------------------------------------------------------------------------------------ the store
def test_the_store_keeps_internal_errors_apart_and_still_deduplicates_the_rest(tmp_path):
    db = tmp_path / "s.db"
    with open_store(db) as st:
        st.create_run("r", run_dir="/x")
        a = st.add_incident_if_new("r", attempt=1, symptom="internal_error", step=7, summary="first")
        b = st.add_incident_if_new("r", attempt=1, symptom="internal_error", step=7, summary="second")
        assert a[1] and b[1] and a[0] != b[0]  # both created, each its own row
        c = st.add_incident_if_new("r", attempt=1, symptom="loss_spike", step=7, summary="spike")
        d = st.add_incident_if_new("r", attempt=1, symptom="loss_spike", step=7, summary="replayed")
        assert c[1] and d == (c[0], False)  # a replayed finding still finds its incident
    # Downgrading keeps the oldest internal error of each key (the old constraint could not hold both).
    assert downgrade(db, "0004") == "0004"
    with sqlite3.connect(db) as conn:
        assert [r[0] for r in conn.execute("SELECT summary FROM incidents ORDER BY id")] == ["first", "spike"]
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
            conn.execute("INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status,"
                         " detected_at, updated_at) VALUES ('r', 1, 7, 'internal_error', 'critical', '', '{}', "
                         "'open', '2026-01-01', '2026-01-01')")
    assert upgrade_to_head(db) == "0007"
