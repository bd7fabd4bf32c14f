"""What a simulated week costs: seeded runs of `ulyssesd simulate` in one process (a warm-up run first, so imports
are not counted), their supervisor ticks, wall seconds, and wall seconds per simulated week; optionally the
cProfile of the product's functions (daemon/, training/, remediation/) by cumulative time.

    .venv/bin/python bench/sim_tick_cost.py [--seeds 0:12] [--days 7] [--profile 25] [--out DIR]

Prints one JSON line (and writes it to DIR/sim_tick_cost.json): runs, ticks, simulated days, wall_s, ms_per_tick,
s_per_sim_week. Compare trees on the same box back to back: other processes only add time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from pathlib import Path

from ulyssesd.daemon.sim.cli import _quiet
from ulyssesd.daemon.sim.runner import SimConfig, run_seed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:12", help="first:end (end excluded)")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--profile", type=int, default=0, help="print this many product functions by cumulative time")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.seeds.split(":"))
    _quiet()
    run_seed(10**6, SimConfig(days=0.2))  # imports, the first store's migrations: not a week's cost
    prof = cProfile.Profile(time.process_time) if a.profile else None  # CPU time: a loaded box adds none
    t0, cpu0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    results = [run_seed(s, SimConfig(days=a.days)) for s in range(lo, hi)]
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ticks = sum(r.ticks for r in results)
    days = sum(r.sim_s for r in results) / 86_400.0
    doc = {"runs": len(results), "seeds": a.seeds, "days_each": a.days, "ticks": ticks,
           "simulated_days": round(days, 2), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
           "ms_per_tick": round(1000 * cpu / max(ticks, 1), 2),
           "cpu_s_per_sim_week": round(cpu / days * 7, 2) if days else None,
           "violations": sum(1 for r in results if not r.ok), "profiled": bool(prof),
           "load_avg": os.getloadavg()[0]}
    print(json.dumps(doc))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "sim_tick_cost.json").write_text(json.dumps(doc, indent=1) + "\n")
    if prof:
        st = pstats.Stats(prof)
        rows = [(v[3], v[1], f"{k[0].rsplit('/ulyssesd/', 1)[-1].rsplit('/s32/', 1)[-1]}:{k[1]}({k[2]})")
                for k, v in st.stats.items()  # type: ignore[attr-defined]
                if any(p in k[0] for p in ("/daemon/", "/training/", "/remediation/")) and "/sim/" not in k[0]]
        for ct, n, name in sorted(rows, reverse=True)[:a.profile]:
            print(f"{ct:8.3f} s {n:7d} calls  {name}")


if __name__ == "__main__":
    main()
