"""How long `ulyssesctl report` takes over a long run's telemetry, and how much memory it holds.

Writes a synthetic telemetry file of N step lines (two attempts, the second resuming 1,000 steps back) and
times `analyse_telemetry` (both streaming passes, sampling and goodput), then its peak Python heap.
Usage: python bench/report_scale.py [N=300000]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

from ulyssesd.daemon.operator.report import analyse_telemetry


def main(n: int) -> None:
    t0 = 1764600000.0
    half = n // 2
    path = Path(tempfile.mkdtemp(prefix="report-scale-")) / "telemetry.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            attempt, step = (1, i + 1) if i < half else (2, i - 1000)
            fh.write(json.dumps({"kind": "step", "step": step, "loss": 2.0 + 1 / (i + 1), "time": t0 + i * 1.2,
                                 "attempt": attempt, "step_time_s": 1.1, "step_time_max_s": 1.2,
                                 "tokens_per_s": 50000.0, "mem_allocated_gib": 70.0,
                                 "mem_max_allocated_gib": 71.0}) + "\n")
    attempts = [SimpleNamespace(number=1, started_at=datetime.fromtimestamp(t0 - 30, UTC), ended_at=None),
                SimpleNamespace(number=2, started_at=datetime.fromtimestamp(t0 + half * 1.2, UTC), ended_at=None)]
    start = time.perf_counter()
    series, good = analyse_telemetry(path, attempts, [])
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    analyse_telemetry(path, attempts, [])
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"lines": n, "file_mb": round(path.stat().st_size / 1e6, 1), "seconds": round(elapsed, 2),
                      "peak_python_heap_mb": round(peak / 1e6, 2), "points": [len(s.points) for s in series],
                      "redone_restart_s": round(good.redone_restart_s, 1)}))
    path.unlink()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300_000)
