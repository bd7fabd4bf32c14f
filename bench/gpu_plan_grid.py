"""The planner's fit verdict and the lever cost model checked against real runs (issue 30): a grid of gpt-1b
configurations around an 80 GB GPU's capacity edge, each run for a few steps in its own process.

Grid (24 configurations): sequence length {24K, 32K} x micro-batch {1, 2} x recompute {none, the first 6 of 24
blocks, every block; both with keep-attention} x tiled loss {off, 4K} (planner: 12 fit an H100, 12 do not, 7 of
them within 15 % of its 79 GiB), on `configs/gpt-1b-1xh200.toml` with compiled blocks and the fused rotary
off (no inductor compile per process), async saves off, one rank, accumulation 1. Each configuration runs the
real job (bench/gpu_bench.py `run_case`: `python -m ulyssesd.training`, its one rank started directly, or under
torchrun with `--launcher torchrun`) in its own process with a per-configuration timeout, so an OOM does not
poison the next; a shared bytecode cache (PYTHONPYCACHEPREFIX) spares later processes the compilation of the
lazy imports. One JSON line per configuration in
OUT/grid.jsonl: measured peak (`max_memory_allocated`, reserved), fit / OOM / error, median step time, and the
GPU's total memory (torch, read in a child process so this one holds no CUDA context).

On the lent GPU (H100 80 GB; 3 steps each: step 2 holds Adam's moments; no configuration starts after
--budget-s, those left are written as skipped). Estimated from the start-ups of bench/RESULTS.md (calls 11, 16):
~15 s per configuration + ~75 s of steps, ~7.5 minutes; not yet run:

    run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600,
        command="source bench/gpu_common.sh && python3 bench/gpu_plan_grid.py --out $OUT/grid --budget-s 520")

Scoring, on the CPU, from those lines (the planner and the cost model of this checkout):

    python bench/gpu_plan_grid.py --score DIR      # fit/no-fit accuracy, peak error, step-time error

CPU dry run of the runner (tiny model, 2 configurations): DS_ACCELERATOR=cpu python bench/gpu_plan_grid.py
--out /tmp/grid-dry --seqs 256 --limit 2 --extra 'model.preset=tiny train.device=cpu train.fused_adam=false'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomllib
from gpu_bench import run_case, set_dotted

BASE = str(Path(__file__).resolve().parents[1] / "configs" / "gpt-1b-1xh200.toml")
SEQS = (24576, 32768)
MICRO_BATCHES = (1, 2)
# none; the first 6 of 24 blocks recomputed; every block - both with keep-attention (the fix search's settings)
RECOMPUTE = ("none", "first6", "all")
TILED = (0, 4096)
FIXED = ["model.compile_blocks=false", "model.rotary_fused=false", "checkpoint.async_save=false",
         "train.gradient_accumulation_steps=1", "env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def grid(seqs: tuple[int, ...] = SEQS, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out = []
    for seq, mb, rc, tl in itertools.product(seqs, MICRO_BATCHES, RECOMPUTE, TILED):
        name = f"s{seq // 1024}k-mb{mb}" if seq >= 1024 else f"s{seq}-mb{mb}"
        name += f"-rc{rc}-tl{tl}"
        ov = [f"name={name}", f"train.seq_len={seq}", f"train.micro_batch_size={mb}", f"train.loss_chunk_tokens={tl}",
              f"train.activation_checkpoint_every={1 if rc == 'all' else 0}",
              f"model.checkpoint_keep_attention={'false' if rc == 'none' else 'true'}", *FIXED, *extra]
        if rc == "first6":
            ov.append("train.activation_checkpoint_layers=6")
        out.append({"name": name, "seq": seq, "mb": mb, "recompute": rc, "tiled": tl, "overrides": ov})
    # Interleave so that a cut by the budget leaves both sequence lengths and both recompute modes measured.
    return sorted(out, key=lambda c: (c["mb"], c["tiled"], c["recompute"], c["seq"]))


def gpu_total_gib() -> float | None:
    """The GPU's memory as the jobs see it: ULYSSESD_GPU_MEMORY_CAP_GIB when set (an H200 capped to stand in
    for an 80 GB card: the jobs' allocator is capped there, training/train.py `cap_gpu_memory`), else torch's."""
    cap = os.environ.get("ULYSSESD_GPU_MEMORY_CAP_GIB")
    if cap:
        return float(cap)
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)"
    try:
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                    check=True).stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def outcome(res: dict[str, Any], steps: int) -> str:
    tail = res.get("log_tail", "")
    if res.get("rc") == 0 and res.get("steps_done", 0) >= steps:
        return "fit"
    if "OutOfMemoryError" in tail or "out of memory" in tail.lower():
        return "oom"
    return "timeout" if res.get("rc") == "timeout" else "error"


def run_grid(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # Later processes reuse the first one's bytecode (the carried wheels are installed without .pyc): start-up
    # compiled torch._dynamo/inductor/sympy in every process otherwise (bench/RESULTS.md, device call 11).
    os.environ.setdefault("PYTHONPYCACHEPREFIX", "/tmp/pycache")
    (out / "grid.jsonl").write_text("")   # a fresh grid per call
    shutil.rmtree(a.workdir, ignore_errors=True)   # a warm machine keeps /tmp: no earlier call's runs
    deadline = time.time() + a.budget_s
    base = tomllib.loads(Path(a.base).read_text())
    set_dotted(base, "train.device", "cuda")
    total = gpu_total_gib()
    configs = grid(tuple(int(x) for x in a.seqs.split(",")), tuple(a.extra.split()))[:a.limit or None]
    for cfg in configs:
        left = deadline - time.time()
        if left < a.min_case_s:
            line = {**cfg, "skipped": f"budget: {left:.0f} s left"}
        else:
            res = run_case(base, list(cfg["overrides"]), 1, a.steps, Path(a.workdir), min(a.case_timeout_s, left),
                           direct=a.launcher == "direct")
            line = {**cfg, **res, "outcome": outcome(res, a.steps), "gpu_total_gib": total, "steps": a.steps,
                    "base": str(a.base)}
        print(json.dumps({k: line.get(k) for k in ("name", "outcome", "skipped", "peak_mem_gib", "median_step_s",
                                                    "wall_s")}), flush=True)
        with open(out / "grid.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
    return 0


# ------------------------------------------------------------------------------------------------ scoring
def predict(line: dict[str, Any]) -> dict[str, Any]:
    """The planner's verdict and peak for the configuration's exact spec, on a GPU of the measured size, and the
    lever cost model's extra step time (recompute + tiled loss; accumulation 1, so no micro-batch split)."""
    from ulyssesd.training.ds_config import build_ds_config
    from ulyssesd.training.planner import EXPANDABLE_HEADROOM, Cluster, GiB, plan
    from ulyssesd.training.planner.step_cost import recompute_cost, tiled_loss_cost
    from ulyssesd.training.spec import job_spec_from_dict

    base = Path(line.get("base") or BASE)
    spec = tomllib.loads((base if base.exists() else Path(BASE)).read_text())
    for item in line["overrides"]:
        key, _, raw = item.partition("=")
        if key in ("name",) or key.startswith("env."):
            continue
        try:
            val = json.loads(raw)
        except json.JSONDecodeError:
            val = raw
        set_dotted(spec, key, val)
    spec.pop("restart", None)   # the grid runs the bare job: no warm standby on the GPU
    job = job_spec_from_dict(spec)
    ds, _ = build_ds_config(job, 1)
    cl = Cluster(gpus_per_node=1, gpu_mem_gib=float(line.get("gpu_total_gib") or 79.11), host_mem_gib=1024.0)
    p = plan(job, cl, ds, search=False, allocator_headroom=EXPANDABLE_HEADROOM)
    m = job.resolved_model()
    n = job.train.activation_checkpoint_layers if job.train.activation_checkpoint_layers is not None else (
        m.num_layers if job.train.activation_checkpoint_every else 0)
    cost = recompute_cost(m, n, bool(m.checkpoint_keep_attention))
    if job.train.loss_chunk_tokens:
        cost += tiled_loss_cost(m, job.train.seq_len).fraction
    return {"fits": p.fits, "peak_gib": p.gpu_peak_allocated / GiB, "required_gib": p.gpu_required / GiB,
            "step_cost": cost}


def score(d: Path) -> dict[str, Any]:
    lines = [json.loads(x) for x in (d / "grid.jsonl").read_text().splitlines() if x.strip()]
    rows = []
    for ln in lines:
        if ln.get("skipped") or ln.get("outcome") not in ("fit", "oom"):
            rows.append({"name": ln["name"], "excluded": ln.get("skipped") or ln.get("outcome")})
            continue
        pr = predict(ln)
        row = {"name": ln["name"], "seq": ln["seq"], "mb": ln["mb"], "measured": ln["outcome"],
               "predicted_fit": pr["fits"], "right": pr["fits"] == (ln["outcome"] == "fit"),
               "predicted_peak_gib": round(pr["peak_gib"], 2), "predicted_required_gib": round(pr["required_gib"], 2),
               "step_cost": pr["step_cost"]}
        if ln["outcome"] == "fit":
            row.update(measured_peak_gib=ln.get("peak_mem_gib"), median_step_s=ln.get("median_step_s"),
                       peak_err=(pr["peak_gib"] - ln["peak_mem_gib"]) / ln["peak_mem_gib"])
        rows.append(row)
    judged = [r for r in rows if "right" in r]
    fitted = [r for r in judged if r["measured"] == "fit"]
    # Cost model: per (seq, micro-batch), each fitting configuration against the cheapest-by-the-model fitting one
    # of the same shape: predicted (1 + cost) / (1 + cost_ref) vs the measured step-time ratio.
    cost_errs = []
    for key in {(r["seq"], r["mb"]) for r in fitted}:
        group = [r for r in fitted if (r["seq"], r["mb"]) == key and r.get("median_step_s")]
        if len(group) < 2:
            continue
        ref = min(group, key=lambda r: r["step_cost"])
        for r in group:
            if r is ref:
                continue
            pred = (1 + r["step_cost"]) / (1 + ref["step_cost"])
            meas = r["median_step_s"] / ref["median_step_s"]
            r["step_ratio_pred"], r["step_ratio_meas"] = round(pred, 4), round(meas, 4)
            r["step_err"] = (pred - meas) / meas
            cost_errs.append(abs(r["step_err"]))
    summary = {
        "configs": len(lines), "judged": len(judged),
        "verdict_accuracy": (sum(r["right"] for r in judged) / len(judged)) if judged else None,
        "wrong": [r["name"] for r in judged if not r["right"]],
        "peak_abs_err_max": max((abs(r["peak_err"]) for r in fitted), default=None),
        "peak_abs_err_mean": statistics.mean(abs(r["peak_err"]) for r in fitted) if fitted else None,
        "step_cost_abs_err_max": max(cost_errs, default=None),
        "step_cost_abs_err_mean": statistics.mean(cost_errs) if cost_errs else None,
    }
    return {"summary": summary, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output dir (grid.jsonl is appended there)")
    ap.add_argument("--score", metavar="DIR", help="score DIR/grid.jsonl on the CPU instead of running")
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--steps", type=int, default=3, help="steps per configuration (peak needs step 2: Adam's moments)")
    ap.add_argument("--budget-s", type=float, default=520.0, help="no configuration starts after this many seconds")
    ap.add_argument("--case-timeout-s", type=float, default=90.0)
    ap.add_argument("--min-case-s", type=float, default=25.0, help="do not start a configuration with less left")
    ap.add_argument("--workdir", default="/tmp/ulysses-plan-grid")
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)), help="sequence lengths, comma-separated")
    ap.add_argument("--extra", default="", help="more overrides for every configuration, space-separated k=v "
                    "(CPU dry run: 'model.preset=tiny train.device=cpu train.fused_adam=false')")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N configurations (dry runs)")
    ap.add_argument("--launcher", choices=("direct", "torchrun"), default="direct",
                    help="direct: the one rank started with RANK/WORLD_SIZE/MASTER_* set (no torchrun interpreter: "
                         "~5 s less per configuration); torchrun: as the daemon launches it")
    a = ap.parse_args()
    if a.score:
        res = score(Path(a.score))
        print(json.dumps(res, indent=1, default=str))
        return 0
    if not a.out:
        ap.error("--out DIR (or --score DIR)")
    return run_grid(a)


if __name__ == "__main__":
    sys.exit(main())
