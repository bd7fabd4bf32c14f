"""Replay throughput: time `ulyssesctl replay`'s path (read file line by line → parse → engine) over N
synthetic telemetry records (default 1,000,000) and record the figure in bench/RESULTS.md.

    .venv/bin/python bench/replay_bench.py [--records 1000000] [--parser auto|orjson|json] [--write-results]

Step lines are decoded by msgspec when it is installed, everything else (and every line without msgspec) by
orjson, or the stdlib json without orjson. --parser orjson / json forces the fallback paths (--stdlib-json
is the old spelling of --parser json). Each parser's figure is one row of the results section; CPU time is
the figure that counts (the dev box is shared, so wall time depends on the other jobs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import tempfile
import time
from pathlib import Path

from ulyssesd.daemon.operator.ctl_offline import BadLine, read_records
from ulyssesd.remediation import records as records_mod
from ulyssesd.remediation.replay import replay
from ulyssesd.remediation.synthetic import Injection, TraceSpec, trace

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Replay throughput"


def make_file(path: Path, steps: int) -> int:
    # A few faults so the engine also exercises its decision path, not only the quiet one.
    spec = TraceSpec(steps=steps, seed=1, injections=[Injection("nan", steps // 3),
                                                      Injection("slow_rank", steps // 2, 300, 1.6)])
    n = 0
    with path.open("w") as fh:
        for d in trace(spec):
            fh.write(json.dumps(d, separators=(",", ":")) + "\n")
            n += 1
    return n


def parser_name() -> str:
    rest = "orjson" if records_mod._fast_loads is not json.loads else "json (stdlib)"
    return f"msgspec + {rest}" if records_mod._step_decode is not None else rest


def run(records: int) -> dict:
    steps = int(records / (1 + 2 / 500))  # trace() adds two checkpoint events every 500 steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.jsonl"
        n = make_file(path, steps)
        size = path.stat().st_size
        bad: list[BadLine] = []
        load0 = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        items = sum(1 for _ in replay(read_records(path, bad)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"records": n, "bytes": size, "items": items, "bad": len(bad), "wall_s": wall, "cpu_s": cpu,
            "json": parser_name(), "records_per_s_cpu": n / cpu, "records_per_s_wall": n / wall,
            "load_avg_1m": max(load0, os.getloadavg()[0])}


def _row(r: dict) -> str:
    return (f"| {r['records']:,} | {r['json']} | {r['wall_s']:.1f} s | {r['cpu_s']:.1f} s | "
            f"{r['records'] / r['cpu_s']:,.0f} | {r['load_avg_1m']:.1f} | {r['date']} |")


# Before issue 5's throughput work (commit bf974e5): the same command, kept for comparison.
BEFORE = """\
| records | JSON parser | wall | CPU | records/s (CPU) | load avg | date |
|---|---|---|---|---|---|---|
| 1,000,000 | orjson | 44.3 s | 30.0 s | 33,364 | 3.9 | 2026-11-29 |
| 1,000,000 | json (stdlib) | 73.1 s | 50.0 s | 20,013 | 3.9 | 2026-11-29 |
| 999,985 | orjson (re-run beside the new code, busier box) | — | 37.7 s | 26,519 | ~9 | 2026-11-29 |
"""

# Where the time goes (100k records; cProfile before, pyinstrument after) and what changed; see the section.
NOTES = """\
Where the time went before (100k records, cProfile): parsing ~40 % (orjson.loads, then `_fast_step`'s dict →
tuple → type checks → dataclass, ~10 us/record together), the engine and its 8 detectors ~50 % (one call each
per record; loss oscillation's deque bookkeeping, the loss-spike MAD's Python list comprehension every 25
steps, three `RollingMedian.add` calls, `tick` → `HangDetector.check` two calls per record), file reading and
the replay loop ~10 %. Changes, each checked against the golden replay fixture
(tests/fixtures/replay/golden_20k.json, recorded with the old code: identical findings, decisions, evidence):
msgspec decodes a plain step line straight into a typed struct (no dict; lines it rejects take the old path,
property-tested equal) — parse ~10 → ~3-5 us/record; detector observers bound once; engine bookkeeping skipped
when there is nothing to track; `tick` answers the common no-hang case inline; the MAD with C-level
`map`/`sorted`; `RollingMedian.add` one comparison; loss-spike readiness cached; overflow-storm and
throughput/slow-step quiet paths without helper calls. Interleaved A/B on 100k records (old tree vs new,
alternating, same minute): 3.4 s vs 2.1 s CPU, 1.6x; on this 1M file back to back at load ~6 (bench's
default parser): 29.6 s vs 17.6 s CPU (33.7k → 56.8k records/s, 1.7x).

Where it goes now (pyinstrument, 100k records): parsing 17 % (msgspec decode 4 %, `StepRecord.__init__` 3 %),
`RemediationEngine.observe` 78 % — its own loop 13 %, loss oscillation 12 %, loss spike 9 %, memory 8 %, slow
step 7 %, throughput 7 %, overflow 6 %, bookkeeping 4 %, straggler 4 %, NaN 3 %, hang 3 % — the replay loop
5 %. No single hot spot is left: it is ~12 Python calls and their attribute traffic per record, ~1 us per
detector on this box (a bare Python call costs ~0.1-0.3 us here, 3-5x a desktop). The issue's target (<= 10 s
CPU for 1M) is NOT met on this box: it needs fewer Python calls per record, e.g. detectors that consume a batch
of records per call (the engine then needs each detector's `active` per record for the EXPLAINED_BY rule), or
compiling remediation/ with mypyc (a build change).
"""


def write_results(r: dict, cmd: str) -> None:
    r["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    # Keep the other parsers' rows of the "after" table from earlier runs, replace this parser's.
    after = old.group(0).split("After", 1)[-1] if old and "After" in old.group(0) else ""
    rows = [ln for ln in after.splitlines()
            if ln.startswith("| ") and ln.count("|") == 8 and not ln.startswith("| records")
            and f"| {r['json']} |" not in ln]
    rows.append(_row(r))
    head = "| records | JSON parser | wall | CPU | records/s (CPU) | load avg | date |\n|---|---|---|---|---|---|---|\n"
    body = (f"{SECTION}\n\n"
            f"`{cmd}` (rows: `--parser auto`, `orjson`, `json`) — replay of {r['records']:,} synthetic telemetry "
            f"records ({r['bytes'] / 2**20:.0f} MiB JSONL with an injected NaN and a slow-rank period; read line by "
            f"line, parsed, all detectors + engine, as `ulyssesctl replay --json` minus printing; {r['items']} "
            f"findings/decisions, identical before and after). CPU = `time.process_time()` of the replay loop.\n\n"
            f"Before (commit bf974e5):\n\n{BEFORE}\nAfter (issue 5 throughput work):\n\n{head}"
            + "\n".join(rows) + "\n\n" + NOTES + "\n"
            f"Machine: 2-core CPU dev box ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}), shared with other helpers' test runs "
            f"(load average column: the 1-minute load during the run); CPU time is the less noisy figure, but on "
            f"this box it still varies ~±25 % with the load. msgspec and orjson are optional: without msgspec "
            f"every line goes through orjson (or the stdlib json without orjson).\n")
    text = pattern.sub(lambda _m: body + "\n", text) if old else text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--write-results", action="store_true", help="Update the section in bench/RESULTS.md.")
    ap.add_argument("--parser", choices=("auto", "orjson", "json"), default="auto",
                    help="auto: msgspec for step lines when installed; orjson / json: force that fallback path.")
    ap.add_argument("--stdlib-json", action="store_true", help="Same as --parser json.")
    args = ap.parse_args()
    if args.stdlib_json:
        args.parser = "json"
    if args.parser in ("orjson", "json"):
        records_mod._step_decode = None
    if args.parser == "json":
        records_mod._fast_loads = json.loads
    r = run(args.records)
    print(json.dumps(r, indent=1))
    if args.write_results:
        write_results(r, f"python bench/replay_bench.py --records {args.records} [--parser P] --write-results")


if __name__ == "__main__":
    main()
