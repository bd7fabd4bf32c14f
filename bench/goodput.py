"""Goodput model of the seed's 176B run (issue #21): ETTR against the checkpoint interval, and its optimum.

    .venv/bin/python bench/goodput.py [--spec configs/gpt-176b-8xa100.toml] [--weeks 4] [--json out.json]

The planner picks the configuration: the spec as written when it fits, else the planner's cheapest change
that fits (its first suggestion), plus the 32-GPU suggestion the issue names when the planner lists it. For each,
two save modes: blocking and asynchronous (both measured on 1x H200, scaled by checkpoint bytes per node; the
async figures from device calls 13-14 of 2026-12-02). The model itself is `ulyssesd.remediation.goodput` (its docstring has the formula
and the sources); every input printed here says where it comes from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ulyssesd.daemon.operator.ctl_plan import allocator_headroom, effective_ds_config
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.remediation.goodput import (
    ASYNC_MEASURED,
    HOUR,
    LLAMA3_SOURCE,
    MEASURED,
    checkpoint_bytes,
    daly_interval,
    ettr,
    failure_rate_per_gpu_hour,
    optimal_interval,
    scaled_inputs,
    simulate,
    young_interval,
)
from ulyssesd.training.planner import Cluster, apply_overrides, plan

ROOT = Path(__file__).resolve().parent.parent
SWEEP_HOURS = (0.5, 1, 3, 6, 12, 24, 48, 96, 192)
SIM_SEEDS = 4   # Monte Carlo repetitions at the optimum (a check of the closed form, not an input)


def configurations(spec_path: Path) -> list[dict[str, Any]]:
    """(name, params, nodes, gpus) of the configurations to model, each re-planned to confirm it fits."""
    run_spec = load_run_spec(spec_path)
    launcher = run_spec.launcher
    cluster = Cluster.preset("a100-80g", gpus_per_node=launcher.nproc_per_node, nodes=launcher.nnodes)
    ds = effective_ds_config(run_spec, cluster.world_size)
    base = plan(run_spec.job, cluster, ds, allocator_headroom=allocator_headroom(run_spec))
    params = float(base.summary["params"])
    if base.fits:
        picks = [("as written", {})]
    else:
        picks = [("planner's cheapest fit: " + " + ".join(base.suggestions[0].changes),
                  base.suggestions[0].overrides)]
        picks += [("issue's example: " + " + ".join(s.changes), s.overrides) for s in base.suggestions[1:]
                  if s.overrides.get("cluster.nodes", 0) * cluster.gpus_per_node == 32][:1]
    out = []
    for name, overrides in picks:
        job, cl, ds2 = apply_overrides(run_spec.job, cluster, ds, overrides)
        again = plan(job, cl, ds2, search=False, allocator_headroom=allocator_headroom(run_spec))
        out.append({"name": name, "params": params, "nodes": cl.nodes, "gpus": cl.world_size,
                    "fits": again.fits, "gpu_required_gib": again.gpu_required / 2**30,
                    "host_required_gib": again.host_required / 2**30, "cluster": cl.describe()})
    return out


def model(conf: dict[str, Any], async_save: bool) -> dict[str, Any]:
    x = scaled_inputs(conf["params"], conf["nodes"], conf["gpus"], async_save=async_save)
    best, best_ettr = optimal_interval(x)
    sims = [simulate(best, x, horizon_s=2000 * x.mtbf_s, seed=s) for s in range(SIM_SEEDS)]
    return {"mode": "async (measured)" if async_save else "blocking (measured)",
            "block_s": x.block_s, "write_s": x.write_s, "restart_s": x.restart_s, "mtbf_h": x.mtbf_s / HOUR,
            "young_h": young_interval(x) / HOUR, "daly_h": daly_interval(x) / HOUR, "optimum_h": best / HOUR,
            "ettr_optimum": best_ettr, "ettr_simulated": sum(sims) / len(sims),
            "sweep": {h: ettr(h * HOUR, x) for h in SWEEP_HOURS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", type=Path, default=ROOT / "configs/gpt-176b-8xa100.toml")
    ap.add_argument("--weeks", type=float, default=4.0, help="run length (for the expected interruptions)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)
    rate = failure_rate_per_gpu_hour()
    print(f"failure rate: {rate:.3e} interruptions per GPU-hour  <- {LLAMA3_SOURCE}")
    for group, inputs in (("measured", MEASURED), ("async, measured", ASYNC_MEASURED)):
        for k, v in inputs.items():
            print(f"  {group} {k} = {v.value:g}  <- {v.source}")
    rows = []
    for conf in configurations(args.spec):
        tb = checkpoint_bytes(conf["params"]) / 1e12
        print(f"\n{conf['name']}\n  {conf['cluster']}; {conf['params'] / 1e9:.1f}B params, tag {tb:.2f} TB "
              f"({tb / conf['nodes']:.2f} TB per node); planner: fits={conf['fits']}, GPU "
              f"{conf['gpu_required_gib']:.1f} GiB, host {conf['host_required_gib']:.0f} GiB/node; "
              f"expected interruptions in {args.weeks:g} weeks: {args.weeks * 7 * 24 * rate * conf['gpus']:.2f}")
        print(f"  {'mode':<20} {'block s':>8} {'write s':>8} {'restart s':>9} {'MTBF h':>8} {'Young h':>8} "
              f"{'Daly h':>7} {'opt h':>7} {'ETTR opt':>9} {'ETTR sim':>9}  " +
              " ".join(f"{h:>6g}h" for h in SWEEP_HOURS))
        for async_save in (False, True):
            r = model(conf, async_save)
            rows.append({**conf, **r})
            print(f"  {r['mode']:<20} {r['block_s']:8.0f} {r['write_s']:8.0f} {r['restart_s']:9.0f} "
                  f"{r['mtbf_h']:8.0f} {r['young_h']:8.2f} {r['daly_h']:7.2f} {r['optimum_h']:7.2f} "
                  f"{r['ettr_optimum']:9.2%} {r['ettr_simulated']:9.2%}  "
                  + " ".join(f"{v:7.2%}" for v in r["sweep"].values()))
    if args.json:
        args.json.write_text(json.dumps({"rate_per_gpu_hour": rate, "rows": rows}, indent=2, default=str))
    return 0 if all(math.isfinite(r["ettr_optimum"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
