"""The daemon's ingest of a telemetry backlog, through the real supervisor (its tick, reader, engine and store)
on the tests' fake OS (no processes, a clock that does not move: only the ingest's own cost is timed).

Two cases, each `n` step records (the run's store first filled with `incidents` incidents, one action each):
- `live_backlog_s`: a running attempt whose job wrote `n` records the daemon has not read yet (it was down, or
  the job outran it): ticks until the cursor reaches the file's end; `ticks` is how many that took.
- `adopt_replay_s`: a fresh daemon adopting that run: `start()` warms the engine on the `n` records already
  processed (the daemon's restart path) before it supervises again.
Then `idle_tick_ms`: the mean of 50 ticks with nothing new to read (the daemon's steady cost per tick).
Each phase is timed in wall seconds and in this process's CPU seconds (`*_cpu_s`: comparable across the shared
box's load, which stretches the wall figures); `adopt_from_snapshot` says whether the adoption restored the
engine snapshot (daemon/telemetry/engine_snapshot.py) instead of replaying every record.

    .venv/bin/python bench/ingest_bench.py [N=1000000] [DIR] [INCIDENTS=0]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))


def _write_backlog(path: Path, n: int, t0: float, attempt: int) -> None:
    line = ('{"v": 1, "kind": "step", "step": %d, "loss": %.6f, "grad_norm": %.4f, "lr": 0.0003, "time": %.3f, '
            '"attempt": %d, "step_time_s": %.4f, "step_time_max_s": %.4f, "tokens": 4096, "tokens_per_s": %.1f, '
            '"mem_allocated_gib": 61.5, "mem_max_allocated_gib": 70.25, "samples": [%d, %d], "config_version": 1}\n')
    with path.open("a", buffering=8 << 20) as fh:
        for lo in range(1, n + 1, 100_000):
            fh.write("".join(line % (s, 2.0 + 8.0 / (s + 10) + (s * 7919 % 97) * 1e-4, 0.5 + (s % 11) * 0.01,
                                     t0 - (n - s) * 0.1, attempt, 0.1 + (s % 5) * 0.001, 0.101 + (s % 5) * 0.001,
                                     4096 / 0.1, s - 1, s) for s in range(lo, min(n, lo + 99_999) + 1)))


def _fill_incidents(db: Path, run_id: str, k: int) -> None:
    import sqlite3

    con = sqlite3.connect(db)
    with con:
        con.executemany("INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status, "
                        "detected_at, updated_at) VALUES (?, 1, ?, 'slow_step', 'warning', 'bench', '{}', 'resolved', "
                        "'2026-12-01 00:00:00', '2026-12-01 00:00:00')", [(run_id, -1 - i) for i in range(k)])
        con.execute("INSERT INTO actions (run_id, incident_id, kind, parameters, config_diff, mode, observe_only, "
                    "applied_at, outcome) SELECT run_id, id, 'alert', '{}', '{}', 'none', 0, updated_at, 'effective' "
                    "FROM incidents")
    con.close()


def ingest_backlog(root: Path, n: int, incidents: int = 0) -> dict[str, object]:
    from test_daemon_unit_fakeos import FakeOS
    from uls_daemon_helpers import fake_spec

    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    if root.exists():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True)
    # The product's detector defaults (the tests' fake spec shrinks the windows for speed).
    spec = load_run_spec(fake_spec(root, steps=10 * n, interval=10 * n,
                                   detectors={"window": 100, "warmup_steps": 20, "hang_timeout_floor_s": 600.0}))
    fos = FakeOS()
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos)
    sup.start()
    if incidents:
        _fill_incidents(spec.daemon.resolved_db_path(), sup.run_id, incidents)
    with sup.telemetry_path.open("a") as fh:
        fh.write(json.dumps({"v": 1, "kind": "event", "event": "started", "step": 0, "attempt": sup.attempt,
                             "time": fos.time() - n * 0.1 - 1}) + "\n")
    _write_backlog(sup.telemetry_path, n, fos.time(), sup.attempt)
    size = sup.telemetry_path.stat().st_size
    start, cpu, ticks = time.perf_counter(), time.process_time(), 0
    while sup.reader is not None and sup.reader.cursor.offset < size:
        sup.tick()
        ticks += 1
    live, live_cpu = time.perf_counter() - start, time.process_time() - cpu
    cursor = sup.store.get_telemetry_cursor(sup.run_id)
    result: dict[str, object] = {"records": n, "file_mb": round(size / 1e6, 1), "live_backlog_s": round(live, 1),
                                 "live_backlog_cpu_s": round(live_cpu, 1),
                                 "us_per_record_cpu": round(live_cpu / n * 1e6, 1),
                                 "ticks": ticks, "last_step": sup.last_step, "cursor_at_end": cursor.offset == size,
                                 "state": sup.state.value, "incidents_in_store": incidents}
    start = time.perf_counter()
    for _ in range(50):
        sup.tick()
    result["idle_tick_ms"] = round((time.perf_counter() - start) / 50 * 1e3, 2)
    sup.store.close()
    start, cpu = time.perf_counter(), time.process_time()
    again = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos)
    again.start()
    result["adopt_replay_s"] = round(time.perf_counter() - start, 1)
    result["adopt_replay_cpu_s"] = round(time.process_time() - cpu, 1)
    result["adopt_from_snapshot"] = getattr(getattr(again, "snapshots", None), "restored_from", None) is not None
    result["adopted_last_step"] = again.last_step
    again.store.close()
    return result


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/ulyssesd-ingest-bench")
    print(json.dumps(ingest_backlog(root, n, int(sys.argv[3]) if len(sys.argv) > 3 else 0)))
