"""A writer SIGKILLed mid-transaction leaves a database that passes integrity_check and holds every
committed row (and none of the uncommitted ones)."""

from __future__ import annotations

import os
import signal
import sqlite3
import time

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import Symptom


def _integrity(db_path) -> str:
    with sqlite3.connect(db_path) as c:
        return c.execute("PRAGMA integrity_check").fetchone()[0]


def _read_ids_until(proc, n: int, timeout: float = 60.0) -> list[int]:
    ids: list[int] = []
    deadline = time.monotonic() + timeout
    while len(ids) < n:
        assert time.monotonic() < deadline, "worker too slow"
        line = proc.stdout.readline()
        assert line, f"worker exited early: {proc.stderr.read()}"
        ids.append(int(line))
    return ids


def test_sigkill_in_open_transaction(store, run_id, db_path, start_worker):
    store.close()
    proc = start_worker("open-txn", db_path, run_id, 25)
    committed = _read_ids_until(proc, 25)
    assert proc.stdout.readline().strip() == "IN_TXN"
    wal = db_path.with_name(db_path.name + "-wal")
    assert wal.stat().st_size > 500_000  # the uncommitted transaction really reached the WAL
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    # Read-only first (the CLI after a daemon crash), then the writer (daemon restart) recovers.
    with open_store(db_path, readonly=True) as ro:
        rows = ro.list_incidents(run_id=run_id)
    assert [r.id for r in rows] == committed
    assert {r.symptom for r in rows} == {Symptom.hang}  # none of the 3000 uncommitted 'crash' rows
    assert _integrity(db_path) == "ok"
    with open_store(db_path) as st:
        assert st.maintenance().ok
        assert st.record_incident(run_id, attempt=3, symptom="crash", step=1) == committed[-1] + 1


def test_sigkill_at_a_random_point_of_a_write_loop(store, run_id, db_path, start_worker):
    store.close()
    proc = start_worker("write", db_path, run_id, 100_000)
    reported = _read_ids_until(proc, 150)
    time.sleep(0.05)  # somewhere inside later commits
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    reported += [int(x) for x in proc.stdout.read().split()]  # lines already in the pipe

    assert _integrity(db_path) == "ok"
    with open_store(db_path, readonly=True) as ro:
        present = [i.id for i in ro.list_incidents(run_id=run_id)]
    # Every id reported after its commit is there; at most one more (committed, killed before printing).
    assert set(reported) <= set(present)
    assert len(present) - len(reported) in (0, 1)
    assert present == list(range(1, len(present) + 1))
