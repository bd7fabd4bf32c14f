"""Replay throughput: time `ulyssesctl replay`'s path (read file line by line → parse → engine) over N
synthetic telemetry records (default 1,000,000) and record the figure in bench/RESULTS.md.

    .venv/bin/python bench/replay_bench.py [--records 1000000] [--stdlib-json] [--write-results]

The parser uses orjson when it is installed (optional) and the stdlib json otherwise; --stdlib-json forces
the latter. Both figures go into the results section (one row each).
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

from ulyssesd.daemon.ctl_offline import BadLine, read_records
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


def run(records: int) -> dict:
    steps = int(records / (1 + 2 / 500))  # trace() adds two checkpoint events every 500 steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.jsonl"
        n = make_file(path, steps)
        size = path.stat().st_size
        bad: list[BadLine] = []
        t0, c0 = time.perf_counter(), time.process_time()
        items = sum(1 for _ in replay(read_records(path, bad)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"records": n, "bytes": size, "items": items, "bad": len(bad), "wall_s": wall, "cpu_s": cpu,
            "json": "orjson" if records_mod._fast_loads is not json.loads else "json (stdlib)",
            "records_per_s": n / wall, "load_avg_1m": os.getloadavg()[0]}


def _row(r: dict) -> str:
    return (f"| {r['records']:,} | {r['json']} | {r['wall_s']:.1f} s | {r['cpu_s']:.1f} s | "
            f"{r['records'] / r['cpu_s']:,.0f} | {r['load_avg_1m']:.1f} |")


def write_results(r: dict, cmd: str) -> None:
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    # Keep the other parser's row from an earlier run, replace this parser's.
    rows = [ln for ln in (old.group(0).splitlines() if old else [])
            if ln.startswith("| 1") and ln.count("|") == 7 and f"| {r['json']} |" not in ln]
    rows.append(_row(r))
    body = (f"{SECTION}\n\n"
            f"`{cmd}` — replay of {r['records']:,} synthetic telemetry records ({r['bytes'] / 2**20:.0f} MiB JSONL, "
            f"read line by line, parsed, all detectors + engine; {r['items']} findings/decisions):\n\n"
            f"| records | JSON parser | wall | CPU | records/s (CPU) | load avg |\n|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n"
            f"Machine: 2-core CPU dev box ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}), shared with other jobs "
            f"(load average {r['load_avg_1m']:.1f} at the end); date {today}. CPU time is the less noisy figure; "
            f"orjson is optional (`pip install orjson`); without it the stdlib parser is used.\n")
    text = pattern.sub(lambda _m: body + "\n", text) if old else text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--write-results", action="store_true", help="Update the section in bench/RESULTS.md.")
    ap.add_argument("--stdlib-json", action="store_true", help="Parse with the stdlib json even if orjson is there.")
    args = ap.parse_args()
    if args.stdlib_json:
        records_mod._fast_loads = json.loads
    r = run(args.records)
    print(json.dumps(r, indent=1))
    if args.write_results:
        flag = " --stdlib-json" if args.stdlib_json else ""
        write_results(r, f"python bench/replay_bench.py --records {args.records}{flag} --write-results")


if __name__ == "__main__":
    main()
