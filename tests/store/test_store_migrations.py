"""Alembic migrations: empty → head, head → base → head, data survives 0001 → head, no model drift."""

from __future__ import annotations

import logging
import re
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from ulyssesd.daemon.store import (
    NoDatabaseError,
    SchemaMismatchError,
    current_revision,
    db_current,
    db_status,
    db_upgrade,
    downgrade,
    head_revision,
    open_store,
    upgrade_to_head,
)
from ulyssesd.daemon.store import enums as E
from ulyssesd.daemon.store.engine import make_engine
from ulyssesd.daemon.store.migrate import upgrade
from ulyssesd.daemon.store.models import Base

APP_TABLES = {"runs", "attempts", "incidents", "actions", "config_versions", "state_transitions",
              "checkpoints", "telemetry_cursors"}


def tables(db: Path) -> set[str]:
    with sqlite3.connect(db) as c:
        return {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")} - {"sqlite_sequence"}


def drift(db: Path, metadata: sa.MetaData) -> list:
    engine = make_engine(db, readonly=True)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "render_as_batch": True})
            return compare_metadata(ctx, metadata)
    finally:
        engine.dispose()


def test_empty_to_head_creates_every_table(db_path):
    assert head_revision() == "0007"
    assert upgrade_to_head(db_path) == "0007"
    assert tables(db_path) == APP_TABLES | {"alembic_version"}
    assert current_revision(db_path) == "0007"
    with sqlite3.connect(db_path) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # Idempotent: a second daemon start is a no-op.
    assert upgrade_to_head(db_path) == "0007"


def test_head_to_base_to_head(db_path):
    upgrade_to_head(db_path)
    with open_store(db_path) as st:  # a 0003/0004 symptom row is dropped by its downgrade, others kept
        st.create_run("r", spec={}, run_dir="/x")
        st.record_incident("r", attempt=0, symptom="store_damaged", step=0)
        st.record_incident("r", attempt=0, symptom="crash", step=0)
        st.record_incident("r", attempt=0, symptom="internal_error", step=0)
        st.record_incident("r", attempt=0, symptom="inner_restart", step=0)
        st.record_incident("r", attempt=0, symptom="inner_restart", step=0)  # two in-job restarts at one step
    with sqlite3.connect(db_path) as c:
        assert [r[0] for r in c.execute("SELECT COUNT(*) FROM incidents WHERE symptom = 'inner_restart'")] == [2]
    assert downgrade(db_path, "0005") == "0005"
    with sqlite3.connect(db_path) as c:  # 0007's downgrade drops the inner restarts, keeps the rest
        assert sorted(r[0] for r in c.execute("SELECT symptom FROM incidents")) == [
            "crash", "internal_error", "store_damaged"]
    assert downgrade(db_path, "0003") == "0003"
    with sqlite3.connect(db_path) as c:
        assert sorted(r[0] for r in c.execute("SELECT symptom FROM incidents")) == ["crash", "store_damaged"]
    assert downgrade(db_path, "0002") == "0002"
    with sqlite3.connect(db_path) as c:
        assert [r[0] for r in c.execute("SELECT symptom FROM incidents")] == ["crash"]
        with pytest.raises(sqlite3.IntegrityError, match="ck_incidents_symptom"):
            c.execute("INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status,"
                      " detected_at, updated_at) VALUES ('r', 0, 1, 'store_damaged', 'info', '', '{}', 'open',"
                      " '2026-01-01', '2026-01-01')")
    assert downgrade(db_path, "0001") == "0001"
    assert "checkpoints" not in tables(db_path)
    assert downgrade(db_path, "base") is None
    assert tables(db_path) == {"alembic_version"}
    assert upgrade_to_head(db_path) == "0007"
    assert tables(db_path) == APP_TABLES | {"alembic_version"}
    assert drift(db_path, Base.metadata) == []


def test_first_revision_with_data_upgrades_to_head_intact(db_path):
    assert upgrade(db_path, "0001") == "0001"
    ts = "2026-11-01 10:00:00.000000"
    with sqlite3.connect(db_path) as c:  # data as a 0001-era daemon wrote it
        c.execute("INSERT INTO runs (id, spec, state, state_reason, created_at, updated_at) "
                  "VALUES ('old', '{\"k\": 1}', 'RUNNING', 'launched', ?, ?)", (ts, ts))
        c.execute("INSERT INTO state_transitions (run_id, from_state, to_state, reason, at) "
                  "VALUES ('old', 'STARTING', 'RUNNING', 'launched', ?)", (ts,))
        c.execute("INSERT INTO attempts (run_id, number, command, pid, started_at) "
                  "VALUES ('old', 1, '[\"torchrun\", \"x\"]', 4242, ?)", (ts,))
        c.execute("INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status, "
                  "detected_at, updated_at) VALUES ('old', 1, 77, 'nan_loss', 'critical', 's', "
                  "'{\"loss\": \"nan\"}', 'open', ?, ?)", (ts, ts))
        c.execute("INSERT INTO actions (run_id, incident_id, kind, parameters, config_diff, mode, observe_only, "
                  "applied_at, outcome) VALUES ('old', 1, 'rollback_skip', '{}', '{}', 'restart', 0, ?, 'pending')",
                  (ts,))

    assert upgrade_to_head(db_path) == "0007"

    with open_store(db_path, readonly=True) as st:
        run = st.get_run("old")
        assert (run.state, run.spec) == (E.RunState.RUNNING, {"k": 1})
        att = st.get_attempt("old", 1)
        assert (att.pid, att.command, att.pgid, att.proc_start_time) == (4242, ["torchrun", "x"], None, None)
        inc = st.get_incident(1)
        assert (inc.symptom, inc.step, inc.evidence) == (E.Symptom.nan_loss, 77, {"loss": "nan"})
        assert [a.kind for a in inc.actions] == [E.ActionKind.rollback_skip]
        assert [t.to_state for t in st.list_transitions("old")] == [E.RunState.RUNNING]
    # The new 0002 features work on the migrated DB, and the old dedup key still holds.
    with open_store(db_path) as st:
        st.update_attempt("old", 1, pgid=4242, proc_start_time=1.5)
        st.upsert_checkpoint("old", "step-00000070", 70, loss=2.5, known_good=True)
        assert st.record_incident("old", attempt=1, symptom="nan_loss", step=77) == 1
        assert len(st.list_incidents()) == 1
    with sqlite3.connect(db_path) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert c.execute("PRAGMA foreign_key_check").fetchall() == []


def test_models_match_migrations_no_drift(db_path):
    upgrade_to_head(db_path)
    assert drift(db_path, Base.metadata) == []


def test_drift_check_catches_a_model_change(db_path):
    """Negative control: the no-drift test can fail."""
    upgrade_to_head(db_path)
    md = sa.MetaData()
    for t in Base.metadata.tables.values():
        t.to_metadata(md)
    sa.Table("runs", md, sa.Column("new_col", sa.Integer), extend_existing=True)
    diffs = drift(db_path, md)
    assert any(d[0] == "add_column" and d[3].name == "new_col" for d in diffs), diffs


ENUM_COLUMNS = {
    ("runs", "state"): E.RunState,
    ("state_transitions", "from_state"): E.RunState,
    ("state_transitions", "to_state"): E.RunState,
    ("incidents", "symptom"): E.Symptom,
    ("incidents", "severity"): E.Severity,
    ("incidents", "status"): E.IncidentStatus,
    ("actions", "kind"): E.ActionKind,
    ("actions", "mode"): E.ApplyMode,
    ("actions", "outcome"): E.ActionOutcome,
}


def test_check_constraints_in_db_match_python_enums(db_path):
    """Autogenerate does not compare CHECKs: adding an enum member without a migration must fail here."""
    upgrade_to_head(db_path)
    with sqlite3.connect(db_path) as c:
        ddl = {name: sql for name, sql in c.execute("SELECT name, sql FROM sqlite_master WHERE type='table'")}
    for (table, column), enum_cls in ENUM_COLUMNS.items():
        m = re.search(rf"CONSTRAINT ck_{table}_{column} CHECK \({column} IN \(([^)]*)\)\)", ddl[table])
        assert m, f"no CHECK for {table}.{column}"
        allowed = set(re.findall(r"'([^']*)'", m.group(1)))
        assert allowed == {e.value for e in enum_cls}, f"{table}.{column}: DB {allowed} vs enum"
    # every enum-typed model column is covered above
    model_enum_cols = {(t.name, c.name) for t in Base.metadata.tables.values() for c in t.columns
                       if isinstance(c.type, sa.Enum)}
    assert model_enum_cols == set(ENUM_COLUMNS)


def test_alembic_does_not_touch_logging(db_path):
    root = logging.getLogger()
    before = (list(root.handlers), root.level, logging.getLogger("alembic").handlers[:],
              logging.getLogger("sqlalchemy").level)
    upgrade_to_head(db_path)
    downgrade(db_path, "base")
    after = (list(root.handlers), root.level, logging.getLogger("alembic").handlers[:],
             logging.getLogger("sqlalchemy").level)
    assert before == after


def test_db_cli_functions(db_path):
    with pytest.raises(NoDatabaseError, match=r"no database at .*ulyssesd\.db — has ulyssesd run\?"):
        db_current(db_path)
    assert db_upgrade(db_path) == "0007"
    assert db_current(db_path) == "0007"
    assert db_status(db_path) == {"path": str(db_path.resolve()), "current": "0007", "head": "0007",
                                  "up_to_date": True}


def test_readonly_open_refuses_old_or_empty_schema(db_path):
    db_path.parent.mkdir(parents=True)
    sqlite3.connect(db_path).close()  # exists, but nothing in it
    with pytest.raises(NoDatabaseError, match="has no schema yet"):
        open_store(db_path, readonly=True)
    upgrade(db_path, "0001")
    with pytest.raises(SchemaMismatchError, match=r"revision 0001, this code expects 0007: run `ulyssesctl db upgrade`"):
        open_store(db_path, readonly=True)
    # The writer (daemon start) upgrades, after which readers are fine.
    open_store(db_path).close()
    open_store(db_path, readonly=True).close()


def test_writer_without_migrate_refuses_stale_schema(db_path):
    upgrade(db_path, "0001")
    with pytest.raises(SchemaMismatchError):
        open_store(db_path, migrate=False)
