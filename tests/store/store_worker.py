"""Worker processes for the store's concurrency and crash tests (run as a script, not collected).

Modes:
  write DB RUN N [CHECKPOINT_EVERY]   record N incidents; print each id right after its commit
  read DB RUN SECONDS STOPFILE        read-only loop until STOPFILE exists (then one last read) or
                                      SECONDS pass; print one JSON summary line at the end
  open-txn DB RUN K                   commit K incidents, then hold an uncommitted big transaction
                                      (spilling to the WAL), print IN_TXN, sleep until killed
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

from ulyssesd.daemon.store import open_store


def write(db: str, run: str, n: int, checkpoint_every: int = 0) -> None:
    store = open_store(db)
    for i in range(n):
        inc_id = store.record_incident(run, attempt=1, symptom="loss_spike", step=i, severity="warning",
                                       evidence={"i": i, "pad": "x" * 200})
        print(inc_id, flush=True)
        if checkpoint_every and (i + 1) % checkpoint_every == 0:
            store.maintenance(quick=True)
    store.close()


def read(db: str, run: str, seconds: float, stopfile: str) -> None:
    deadline = time.monotonic() + seconds
    stop = Path(stopfile)
    final_round = False
    errors: list[str] = []
    iterations = max_count = regressions = gaps = 0
    last = 0
    seen_counts: set[int] = set()
    while time.monotonic() < deadline and not final_round:
        final_round = stop.exists()  # the writer is done: read once more, then report
        try:
            # A fresh read-only store each few rounds: `ulyssesctl` opens one per command.
            with open_store(db, readonly=True) as ro:
                for _ in range(5):
                    rows = ro.list_incidents(run_id=run)
                    ids = [r.id for r in rows]
                    if ids != list(range(1, len(ids) + 1)):
                        gaps += 1
                    if len(ids) < last:
                        regressions += 1
                    last = len(ids)
                    seen_counts.add(last)
                    max_count = max(max_count, last)
                    if ids:
                        ro.get_incident(ids[-1])
                    iterations += 1
        except Exception as e:  # report, never hide: the test asserts this list is empty
            errors.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"iterations": iterations, "max_count": max_count, "regressions": regressions,
                      "gaps": gaps, "final_count": last, "distinct_counts": len(seen_counts), "errors": errors[:20], "n_errors": len(errors)}), flush=True)


def open_txn(db: str, run: str, k: int) -> None:
    store = open_store(db)
    for i in range(k):
        print(store.record_incident(run, attempt=1, symptom="hang", step=i), flush=True)
    store.close()
    # Raw connection on purpose: a transaction big enough that SQLite spills uncommitted pages to the WAL.
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA cache_size = 20")
    conn.execute("BEGIN IMMEDIATE")
    now = "2026-01-01 00:00:00.000000"
    for i in range(3000):
        conn.execute(
            "INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status,"
            " detected_at, updated_at) VALUES (?, 2, ?, 'crash', 'critical', ?, '{}', 'open', ?, ?)",
            (run, i, "u" * 500, now, now),
        )
    print("IN_TXN", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    mode, db, run, *rest = sys.argv[1:]
    if mode == "write":
        write(db, run, int(rest[0]), int(rest[1]) if len(rest) > 1 else 0)
    elif mode == "read":
        read(db, run, float(rest[0]), rest[1])
    elif mode == "open-txn":
        open_txn(db, run, int(rest[0]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
