"""Repository API behaviour: runs/transitions, attempts, incidents (dedup, statuses, ack), actions,
config versions, telemetry cursor, checkpoints, maintenance, read-only mode, garbage rejection."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.exc import IntegrityError, StatementError

from ulyssesd.daemon.store import (
    InvalidValueError,
    NoDatabaseError,
    NotFoundError,
    ReadOnlyStoreError,
    open_store,
)
from ulyssesd.daemon.store.enums import (
    ActionKind,
    ActionOutcome,
    ApplyMode,
    IncidentStatus,
    RunState,
    Severity,
    Symptom,
)


def test_enums_module_does_not_import_sqlalchemy():
    code = ("import sys; import ulyssesd.daemon.store.enums as e; "
            "assert 'sqlalchemy' not in sys.modules, 'sqlalchemy imported'; print(e.RunState.RUNNING)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "RUNNING"


def test_pragmas_on_writer_and_reader(store, db_path):
    raw = store._engine.raw_connection()
    try:
        cur = raw.cursor()
        got = {p: cur.execute(f"PRAGMA {p}").fetchone()[0]
               for p in ("journal_mode", "foreign_keys", "busy_timeout", "synchronous")}
    finally:
        raw.close()
    assert got == {"journal_mode": "wal", "foreign_keys": 1, "busy_timeout": 5000, "synchronous": 1}


def test_run_state_changes_record_transitions(store, run_id):
    tr = store.set_run_state(run_id, "RUNNING", "launched attempt 1", attempt=1)
    assert (tr.from_state, tr.to_state, tr.attempt) == (RunState.STARTING, RunState.RUNNING, 1)
    assert store.set_run_state(run_id, RunState.RUNNING, "again") is None  # no-op, nothing written
    store.set_run_state(run_id, RunState.COMPLETED, "reached train.steps")
    run = store.get_run(run_id)
    assert run.state is RunState.COMPLETED and run.ended_at is not None
    assert [(t.from_state, t.to_state) for t in store.list_transitions(run_id)] == [
        (None, RunState.STARTING), (RunState.STARTING, RunState.RUNNING), (RunState.RUNNING, RunState.COMPLETED)]
    assert store.latest_run().id == run_id
    with pytest.raises(NotFoundError, match="no run 'nope'"):
        store.set_run_state("nope", "RUNNING", "x")
    with pytest.raises(InvalidValueError, match="already exists"):
        store.create_run(run_id)


def test_attempts_and_readoption_lookup(store, run_id):
    a1 = store.add_attempt(run_id, command=["torchrun", "-m", "x"], pid=100, pgid=100, proc_start_time=12.5)
    assert a1.number == 1
    assert store.open_attempt(run_id).number == 1
    store.end_attempt(run_id, 1, returncode=None, signal=9, diagnosis="host_oom_killed",
                      diagnosis_evidence=["Killed"])
    assert store.open_attempt(run_id) is None
    a2 = store.add_attempt(run_id, command=["torchrun"], resumed_from="step-00000010")
    assert a2.number == 2 and store.open_attempt(run_id).number == 2
    store.update_attempt(run_id, 2, pid=200, pgid=200, proc_start_time=99.0)
    got = store.get_attempt(run_id, 1)
    assert (got.signal, got.diagnosis, got.diagnosis_evidence) == (9, "host_oom_killed", ["Killed"])
    assert [a.pid for a in store.list_attempts(run_id)] == [100, 200]
    with pytest.raises(InvalidValueError, match="unknown attempt field"):
        store.update_attempt(run_id, 2, bogus=1)


def test_incident_dedup_is_insert_or_ignore(store, run_id):
    first = store.record_incident(run_id, attempt=1, symptom="loss_spike", step=500, evidence={"loss": 9.1})
    again = store.record_incident(run_id, attempt=1, symptom=Symptom.loss_spike, step=500, evidence={"loss": 0})
    assert first == again
    assert len(store.list_incidents()) == 1
    assert store.get_incident(first).evidence == {"loss": 9.1}  # the first record wins
    # A different attempt / step / symptom is a different incident.
    ids = {store.record_incident(run_id, attempt=2, symptom="loss_spike", step=500),
           store.record_incident(run_id, attempt=1, symptom="loss_spike", step=501),
           store.record_incident(run_id, attempt=1, symptom="nan_loss", step=500)}
    assert len(ids | {first}) == 4
    assert store.find_incident(run_id, 1, "loss_spike", 500).id == first
    assert store.find_incident(run_id, 9, "loss_spike", 500) is None
    assert store.add_incident_if_new(run_id, attempt=1, symptom="loss_spike", step=500) == (first, False)
    new_id, created = store.add_incident_if_new(run_id, attempt=1, symptom="loss_spike", step=900)
    assert created and new_id not in ids | {first}
    # One parameter list for both: record_incident takes exactly add_incident_if_new's, and a wrong keyword is
    # refused by name before anything is written.
    with pytest.raises(TypeError, match="'steps'"):
        store.record_incident(run_id, attempt=1, symptom="loss_spike", steps=901)
    with pytest.raises(TypeError, match="'step'"):
        store.record_incident(run_id, attempt=1, symptom="loss_spike")
    assert len(store.list_incidents()) == 5
    assert store.record_incident(run_id, attempt=1, symptom="loss_spike", step=900, severity="critical") == new_id


def test_incident_lifecycle_ack_and_filters(store, run_id):
    t0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
    a = store.record_incident(run_id, attempt=1, symptom="memory_spike", step=10, severity="critical",
                              detected_at=t0)
    b = store.record_incident(run_id, attempt=1, symptom="slow_step", step=20, detected_at=t0 + timedelta(hours=1))
    assert store.update_incident_status(a, "remediating", "expandable_segments").status is IncidentStatus.remediating
    done = store.update_incident_status(a, IncidentStatus.resolved, "verified over 200 steps")
    assert done.closed_at is not None and done.status_reason == "verified over 200 steps"
    with pytest.raises(InvalidValueError, match="incident .* is resolved; cannot move to open"):
        store.update_incident_status(a, "open")
    store.update_incident_status(b, "escalated")
    store.update_incident_status(b, "resolved", "operator fixed the node")  # escalated -> resolved allowed
    acked = store.ack_incident(a, "alice")
    assert acked.acknowledged_by == "alice" and acked.acknowledged_at is not None
    assert store.ack_incident(a, "bob").acknowledged_by == "alice"  # first ack kept
    with pytest.raises(InvalidValueError):
        store.ack_incident(b, "  ")
    assert [i.id for i in store.list_incidents(symptom="memory_spike")] == [a]
    assert [i.id for i in store.list_incidents(status="resolved")] == [a, b]
    assert [i.id for i in store.list_incidents(since=t0 + timedelta(minutes=30))] == [b]
    assert [i.id for i in store.list_incidents(since=(t0 + timedelta(minutes=30)).timestamp())] == [b]
    assert [i.id for i in store.list_incidents(unacknowledged=True)] == [b]
    assert [i.id for i in store.list_incidents(limit=1)] == [b]
    assert [i.id for i in store.list_incidents(newest_first=True)] == [b, a]
    assert store.list_incidents(run_id="other") == []
    with pytest.raises(NotFoundError):
        store.get_incident(999)


def test_actions_with_config_diff_and_verification(store, run_id):
    inc = store.record_incident(run_id, attempt=1, symptom="loss_oscillation", step=300)
    act = store.record_action(
        run_id, "hot_control", incident_id=inc, parameters={"rung": 1},
        config_before={"train": {"gradient_clipping": 1.0, "lr": 1e-4}},
        config_after={"train": {"gradient_clipping": 0.5, "lr": 1e-4}},
        mode="hot", from_config_version=1, to_config_version=2)
    assert act.config_diff == {"train.gradient_clipping": [1.0, 0.5]}
    assert act.outcome is ActionOutcome.pending and act.mode is ApplyMode.hot
    ver = store.verify_action(act.id, "ineffective", {"oscillation_after": 0.4})
    assert ver.outcome is ActionOutcome.ineffective and ver.verified_at is not None
    noop = store.record_action(run_id, ActionKind.restart, incident_id=inc, observe_only=True)
    full = store.get_incident(inc)
    assert [a.id for a in full.actions] == [act.id, noop.id]
    assert full.actions[1].observe_only is True
    assert [a.id for a in store.list_actions(run_id=run_id)] == [act.id, noop.id]
    with pytest.raises(NotFoundError):
        store.record_action(run_id, "stop", incident_id=12345)


def test_config_versions(store, run_id):
    v1 = store.add_config_version(run_id, {"lr": 1e-4}, reason="spec")
    v2 = store.add_config_version(run_id, {"lr": 9e-5}, reason="lr -10%", parent_version=1)
    assert (v1.version, v2.version, v2.parent_version) == (1, 2, 1)
    assert store.get_run(run_id).config_version == 2
    assert store.get_config_version(run_id).config == {"lr": 9e-5}
    assert store.get_config_version(run_id, 1).reason == "spec"
    assert [c.version for c in store.list_config_versions(run_id)] == [1, 2]
    with pytest.raises(NotFoundError):
        store.get_config_version(run_id, 7)
    with pytest.raises(IntegrityError):
        store.add_config_version(run_id, {}, reason="dup", version=2)


def test_telemetry_cursor_roundtrip(store, run_id):
    assert store.get_telemetry_cursor(run_id) is None
    store.set_telemetry_cursor(run_id, path="/r/telemetry.jsonl", inode=11, offset=100, last_step=3)
    store.set_telemetry_cursor(run_id, path="/r/telemetry.jsonl", inode=11, offset=4096, last_step=40)
    cur = store.get_telemetry_cursor(run_id)
    assert (cur.inode, cur.offset, cur.last_step) == (11, 4096, 40)
    with pytest.raises(InvalidValueError):
        store.set_telemetry_cursor(run_id, path="x", inode=1, offset=-1)


def test_checkpoints_last_and_known_good(store, run_id):
    store.upsert_checkpoint(run_id, "step-00000100", 100, loss=3.0)
    store.upsert_checkpoint(run_id, "step-00000200", 200, loss=2.5)
    store.upsert_checkpoint(run_id, "step-00000100", 100, known_good=True)
    store.upsert_checkpoint(run_id, "step-00000300", 300, loss=2.2)
    assert store.latest_checkpoint(run_id).tag == "step-00000300"
    assert store.latest_checkpoint(run_id, known_good=True).tag == "step-00000100"
    bad = store.upsert_checkpoint(run_id, "step-00000300", 300, valid=False, invalid_reason="sha256 mismatch")
    assert (bad.valid, bad.known_good, bad.invalid_reason, bad.loss) == (False, False, "sha256 mismatch", 2.2)
    assert store.latest_checkpoint(run_id).tag == "step-00000200"
    store.mark_checkpoint_pruned(run_id, "step-00000200")
    assert [c.tag for c in store.list_checkpoints(run_id)] == ["step-00000100", "step-00000300"]
    assert len(store.list_checkpoints(run_id, include_pruned=True)) == 3
    assert store.latest_checkpoint(run_id).tag == "step-00000100"


def test_a_retention_pass_marks_its_removals_in_one_call_and_unknown_runs_stay_errors(store, run_id):
    for step in (100, 200, 300):
        store.upsert_checkpoint(run_id, f"step-{step:08d}", step)
    # Tags without a row and tags already pruned are skipped; the rest are marked, once.
    assert store.mark_checkpoints_pruned(run_id, ["step-00000100", "step-00000200", "step-00000999"]) == 2
    assert store.mark_checkpoints_pruned(run_id, ["step-00000100"]) == 0
    assert [c.tag for c in store.list_checkpoints(run_id)] == ["step-00000300"]
    assert store.mark_checkpoints_pruned(run_id, []) == 0
    # The run-exists check is cached per run id; another id is still looked up and refused.
    store.set_telemetry_cursor(run_id, path="t", inode=1, offset=5)
    with pytest.raises(LookupError):
        store.set_telemetry_cursor("no-such-run", path="t", inode=1, offset=5)
    with pytest.raises(LookupError):
        store.upsert_checkpoint("no-such-run", "step-00000001", 1)


def test_rows_are_stamped_by_the_stores_clock(db_path):
    """The store's clock (the daemon's seam; the simulator's clock under `ulyssesd simulate`) stamps every row:
    the repository's own stamps and the models' column defaults alike, never the host's clock."""
    class Clock:
        def __init__(self):
            self.t = 1_000_000_000.0  # 2001-09-09, far from the host's now

        def time(self):
            return self.t

        def monotonic(self):
            return 0.0

        def sleep(self, s):
            raise AssertionError("no sleep")

    clock = Clock()
    st = open_store(db_path, clock=clock)
    run = st.create_run("run-c", spec={})
    st.add_attempt(run.id, command=["train"], pid=1, proc_start_time=1.0)
    inc = st.record_incident(run.id, attempt=1, symptom="nan_loss", step=5)
    clock.t += 3600.0
    st.upsert_checkpoint(run.id, "step-00000010", 10)
    st.set_run_state(run.id, "RUNNING", "progress")
    want0 = datetime.fromtimestamp(1_000_000_000.0, timezone.utc)
    assert st.get_run(run.id).created_at == want0
    assert st.list_attempts(run.id)[0].started_at == want0
    assert st.get_incident(inc).detected_at == want0
    assert st.list_checkpoints(run.id)[0].saved_at == want0 + timedelta(hours=1)
    assert st.get_run(run.id).updated_at == want0 + timedelta(hours=1)
    st.close()


def test_to_dict_is_strict_json(store, run_id):
    inc = store.record_incident(run_id, attempt=1, symptom="nan_loss", step=5,
                                evidence={"loss": float("nan"), "scale": float("inf")})
    store.record_action(run_id, "rollback_skip", incident_id=inc, parameters={"skip": [100, 300]})
    d = store.get_incident(inc).to_dict()
    text = json.dumps(d, allow_nan=False)  # strict JSON for `ulyssesctl --json`
    assert d["evidence"] == {"loss": "nan", "scale": "inf"}
    assert d["symptom"] == "nan_loss" and d["actions"][0]["kind"] == "rollback_skip"
    assert json.loads(text)["detected_at"].endswith("+00:00")


def test_maintenance_checks_and_truncates_wal(store, run_id, db_path):
    for i in range(50):
        store.record_incident(run_id, attempt=1, symptom="slow_step", step=i)
    res = store.maintenance()
    assert res.ok and res.integrity == ["ok"] and res.wal_busy == 0
    assert res.wal_bytes_before > 0 and res.wal_bytes_after == 0
    assert json.dumps(res.to_dict())


def test_readonly_store_reads_and_refuses_writes(store, run_id, db_path):
    store.record_incident(run_id, attempt=1, symptom="hang", step=1)
    store.close()  # daemon down: the read-only open must still work
    with open_store(db_path, readonly=True) as ro:
        assert [i.symptom for i in ro.list_incidents()] == [Symptom.hang]
        with pytest.raises(ReadOnlyStoreError, match="open read-only"):
            ro.record_incident(run_id, attempt=1, symptom="hang", step=2)
        assert ro.maintenance(quick=True).ok


def test_readonly_missing_db_has_clear_error(tmp_path):
    with pytest.raises(NoDatabaseError, match=r"no database at .*missing\.db — has ulyssesd run\?"):
        open_store(tmp_path / "missing.db", readonly=True)
    assert not (tmp_path / "missing.db").exists()  # and nothing was created


# -- garbage in ---------------------------------------------------------------------------------------------

def test_unknown_symptom_or_state_rejected_with_clear_error(store, run_id):
    with pytest.raises(InvalidValueError, match=r"unknown Symptom 'gpu_on_fire'; allowed: memory_spike, "):
        store.record_incident(run_id, attempt=1, symptom="gpu_on_fire", step=1)
    with pytest.raises(InvalidValueError, match=r"unknown RunState 'running'; allowed: STARTING, RUNNING"):
        store.set_run_state(run_id, "running", "lowercase is not a state")
    with pytest.raises(InvalidValueError, match="unknown Severity"):
        store.record_incident(run_id, attempt=1, symptom="hang", step=1, severity="meh")
    with pytest.raises(InvalidValueError, match="unknown ActionKind"):
        store.record_action(run_id, "reboot_the_cluster")
    with pytest.raises(InvalidValueError, match="unknown RunState"):
        store.create_run("run-2", state="ZOMBIE")
    # nothing was stored
    assert store.list_incidents() == []
    assert store.get_run(run_id).state is RunState.STARTING
    assert len(store.list_transitions(run_id)) == 1
    assert store.list_actions() == []
    with pytest.raises(NotFoundError):
        store.get_run("run-2")


def test_orm_layer_rejects_garbage_even_bypassing_the_repository(store, run_id):
    from sqlalchemy.orm import Session

    from ulyssesd.daemon.store.models import Incident

    with Session(store._engine) as s, pytest.raises(StatementError, match="gpu_on_fire"):
        s.add(Incident(run_id=run_id, attempt=1, step=1, symptom="gpu_on_fire", severity="info",
                       summary="", evidence={}, status="open"))
        s.commit()
    assert store.list_incidents() == []


def test_database_check_rejects_garbage_from_raw_sql(store, run_id, db_path):
    conn = sqlite3.connect(db_path)
    ts = "2026-11-01 00:00:00.000000"
    sql = ("INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status,"
           " detected_at, updated_at) VALUES (?, 1, ?, ?, 'info', '', '{}', 'open', ?, ?)")
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed: ck_incidents_symptom"):
        conn.execute(sql, (run_id, 1, "gpu_on_fire", ts, ts))
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed: ck_runs_state"):
        conn.execute("UPDATE runs SET state = 'ZOMBIE'")
    conn.execute(sql, (run_id, 2, "hang", ts, ts))  # positive control: a valid value goes in
    conn.commit()
    conn.close()
    assert [(i.step, i.symptom) for i in store.list_incidents()] == [(2, Symptom.hang)]


def test_naive_datetimes_rejected(store, run_id):
    with pytest.raises(InvalidValueError, match="naive datetime"):
        store.record_incident(run_id, attempt=1, symptom="hang", step=1, detected_at=datetime(2026, 1, 1))


def test_foreign_keys_enforced(store):
    with pytest.raises(NotFoundError):
        store.add_attempt("ghost", command=["x"])
    raw = sqlite3.connect(store.path)
    raw.execute("PRAGMA foreign_keys = ON")
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        raw.execute("INSERT INTO telemetry_cursors (run_id, path, inode, offset, updated_at) "
                    "VALUES ('ghost', 'p', 1, 0, '2026-01-01 00:00:00')")
    raw.close()


def test_severity_enum_values_are_text(store, run_id, db_path):
    store.record_incident(run_id, attempt=1, symptom="crash_loop", step=0, severity=Severity.critical)
    with sqlite3.connect(db_path) as c:
        assert c.execute("SELECT symptom, severity, status FROM incidents").fetchone() == (
            "crash_loop", "critical", "open")


def test_online_backup_has_committed_rows_a_plain_copy_may_not(store, run_id, db_path, tmp_path):
    """docs/STORE.md's backup advice: `.backup` (sqlite3 backup API) while the daemon runs is complete;
    copying the .db file alone misses commits still in the -wal (negative control)."""
    import shutil

    store.maintenance()  # WAL empty: the run row is in the main file
    for i in range(5):
        store.record_incident(run_id, attempt=1, symptom="hang", step=i)
    shutil.copy(db_path, tmp_path / "plain.db")
    src = sqlite3.connect(db_path)
    dst = sqlite3.connect(tmp_path / "backup.db")
    src.backup(dst)
    src.close()
    dst.close()
    with sqlite3.connect(tmp_path / "backup.db") as c:
        assert c.execute("SELECT count(*) FROM incidents").fetchone()[0] == 5
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with sqlite3.connect(tmp_path / "plain.db") as c:
        assert c.execute("SELECT count(*) FROM incidents").fetchone()[0] == 0
