"""Real processes: a writer records incidents in a loop while a reader uses the CLI's read-only store."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from ulyssesd.daemon.store import open_store

N = 200


@pytest.mark.slow  # ~6 s on an idle 2-core box, ~20 s under load
def test_writer_and_readonly_reader_processes(store, run_id, db_path, start_worker, tmp_path):
    store.close()  # the writer process is "the daemon"
    stopfile = tmp_path / "writer-done"
    reader = start_worker("read", db_path, run_id, 90, stopfile)
    writer = start_worker("write", db_path, run_id, N, 50)  # + WAL checkpoint(TRUNCATE) every 50
    w_out, w_err = writer.communicate(timeout=120)
    stopfile.touch()
    r_out, r_err = reader.communicate(timeout=120)
    assert writer.returncode == 0, w_err
    assert reader.returncode == 0, r_err
    assert "database is locked" not in w_err + r_err

    committed = [int(x) for x in w_out.split()]
    assert committed == list(range(1, N + 1))
    summary = json.loads(r_out.strip().splitlines()[-1])
    print("reader summary:", summary)
    assert summary["errors"] == [] and summary["n_errors"] == 0
    assert summary["regressions"] == 0 and summary["gaps"] == 0  # a snapshot is always a prefix
    assert summary["iterations"] > 20
    assert summary["final_count"] == summary["max_count"] == N  # its last read (writer done) saw all
    assert summary["distinct_counts"] >= 3  # it saw intermediate states: reads overlapped the writes

    with open_store(db_path, readonly=True) as ro:
        assert [i.id for i in ro.list_incidents(run_id=run_id)] == committed  # nothing lost
        assert ro.maintenance().ok


def test_busy_timeout_waits_for_a_held_write_lock(store, run_id, db_path):
    """Another connection holds the write lock for ~1 s: our write waits (busy_timeout) and succeeds,
    where a connection without a busy timeout fails with `database is locked` (negative control)."""
    holder = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(1.0, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        impatient = sqlite3.connect(db_path, timeout=0, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            impatient.execute("BEGIN IMMEDIATE")
        impatient.close()
        t0 = time.monotonic()
        inc = store.record_incident(run_id, attempt=1, symptom="hang", step=1)
        waited = time.monotonic() - t0
    finally:
        release.join()
        holder.close()
    assert inc == 1 and 0.5 < waited < 5.0


def test_maintenance_thread_while_main_thread_writes(store, run_id):
    """The daemon's APScheduler runs maintenance() in a worker thread while the main loop writes."""
    errors: list[BaseException] = []
    results = []

    def maint() -> None:
        try:
            for _ in range(10):
                results.append(store.maintenance(quick=True))
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    t = threading.Thread(target=maint)
    t.start()
    ids = [store.record_incident(run_id, attempt=1, symptom="slow_step", step=i) for i in range(60)]
    t.join(timeout=60)
    assert errors == [] and len(results) == 10 and all(r.ok for r in results)
    assert ids == list(range(1, 61)) and len(store.list_incidents()) == 60


def test_checkpoint_gives_up_quickly_behind_a_long_reader(store, run_id, db_path):
    """A reader parked on an old snapshot (e.g. a slow `ulyssesctl`) must not stall the daemon: the TRUNCATE
    checkpoint reports busy after ~1 s, and writes during and after it succeed."""
    for i in range(20):
        store.record_incident(run_id, attempt=1, symptom="slow_step", step=i)
    reader = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM incidents").fetchone()[0] == 20  # snapshot held
    for i in range(20, 40):
        store.record_incident(run_id, attempt=1, symptom="slow_step", step=i)

    writes: list[float] = []

    def write_during() -> None:
        time.sleep(0.2)
        t0 = time.monotonic()
        store.record_incident(run_id, attempt=1, symptom="hang", step=0)
        writes.append(time.monotonic() - t0)

    t = threading.Thread(target=write_during)
    t.start()
    t0 = time.monotonic()
    res = store.maintenance(quick=True)
    took = time.monotonic() - t0
    t.join(timeout=30)
    reader.execute("COMMIT")
    reader.close()
    assert res.ok and res.wal_busy == 1 and took < 4.0
    assert len(writes) == 1 and writes[0] < 4.0
    assert len(store.list_incidents()) == 41
    assert store.maintenance().wal_busy == 0  # reader gone: the next run truncates
