"""`ulyssesctl` on a broken store: each problem its own exit code and one readable line, never a
traceback and never 1 (which means "the run FAILED"). Real files, real processes."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.migrate import upgrade

NO_DB, DAMAGED, SCHEMA, BUSY, PERM = 20, 21, 22, 23, 24


def _ctl(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ulyssesd.daemon.operator.ctl", "--state-dir", str(state), *args],
                          capture_output=True, text=True, timeout=60)


def _one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr  # one line, not a stack
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def _db_with_runs(state: Path, n: int = 1) -> Path:
    db = state / "ulyssesd.db"
    with open_store(db) as st:
        for i in range(n):
            st.create_run(f"r{i}", spec={"pad": "x" * 3000}, run_dir=f"/r{i}")
            st.record_incident(f"r{i}", attempt=1, symptom="crash", step=i)
        st.maintenance()
    return db


def test_healthy_store_reads(tmp_path):
    _db_with_runs(tmp_path)
    r = _ctl(tmp_path, "incidents")
    assert r.returncode == 0, r.stderr


def test_missing_database(tmp_path):
    _one_line(_ctl(tmp_path, "status"), NO_DB, "no database")
    _one_line(_ctl(tmp_path, "db", "current"), NO_DB, "no database")


def test_random_bytes_truncated_emptied(tmp_path):
    db = _db_with_runs(tmp_path)
    good = db.read_bytes()
    db.write_bytes(os.urandom(len(good)))
    _one_line(_ctl(tmp_path, "status"), DAMAGED, "not an SQLite database")
    _one_line(_ctl(tmp_path, "db", "current"), DAMAGED)
    db.write_bytes(good[: len(good) // 2 + 7])
    r = _ctl(tmp_path, "incidents")
    _one_line(r, DAMAGED)
    (tmp_path / "backups").mkdir()
    (tmp_path / "backups" / "ulyssesd-20260101T000000.000Z.db").write_bytes(good)
    db.write_bytes(b"")
    _one_line(_ctl(tmp_path, "status"), DAMAGED, "emptied")


def test_damage_found_mid_command(tmp_path):
    db = _db_with_runs(tmp_path, n=60)
    with db.open("r+b") as fh:  # header and schema page intact: the open succeeds, the query hits garbage
        fh.seek(8192)
        fh.write(os.urandom(128 * 1024))
    r = _ctl(tmp_path, "incidents")
    _one_line(r, DAMAGED, "damaged")
    r = _ctl(tmp_path, "incidents", "--json")
    assert r.returncode == DAMAGED and '"exit_code": 21' in r.stdout and "Traceback" not in r.stderr


def test_schema_mismatch(tmp_path):
    upgrade(tmp_path / "ulyssesd.db", "0001")
    _one_line(_ctl(tmp_path, "status"), SCHEMA, "ulyssesctl db upgrade")


def test_locked_database(tmp_path):
    db = _db_with_runs(tmp_path)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE runs SET state_reason = 'held' WHERE id = 'r0'")  # exclusive lock held from here
    try:
        r = _ctl(tmp_path, "incidents")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _one_line(r, BUSY, "locked")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_permission_denied(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    _db_with_runs(state)
    os.chmod(state, 0o750)  # root's 0750 state dir: uid 65534 may not enter it
    os.chmod(tmp_path, 0o755)
    out: dict[str, int] = {}
    # Imported here: after setuid the child cannot read this interpreter's tree under /root.
    from ulyssesd.daemon.operator.ctl import main
    from ulyssesd.daemon.store import errors, migrate, opener, repository  # noqa: F401

    def as_nobody() -> None:
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 2)
                os._exit(main(["--state-dir", str(state), "incidents"]))
            except BaseException:  # noqa: BLE001
                os._exit(99)
        out["rc"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    t = threading.Thread(target=as_nobody)
    t.start()
    t.join(60)
    assert out.get("rc") == PERM, out
