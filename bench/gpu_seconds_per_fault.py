"""Issue 33's "Done when" rows that the job answers by itself, on one GPU (gpt-1b, 16K tokens, the shipped
configs/gpt-1b-1xh200.toml): blocked seconds per save with a save every 10 steps (first saves included), and the
seconds lost to an exception in a step and to a NaN, both restored in-process from the host-memory tier.

Runs the bare job (torchrun, one rank per GPU, no daemon) with the same steps (`--runs` picks; default all):
- `base`: async saves every 10 steps, host snapshots every `--memory-interval` steps, no fault;
- `exception`: the same with a `raise` fault at `--fault-step` (before the step's first collective);
- `mid_step`: a `raise_mid_step` fault on the last rank (after the forward, before the backward): the process
  group is torn down and rebuilt, the engine built again, the host tier loaded (`group_rebuilt`);
- `nan`: the same with a `nan_loss` fault at `--fault-step`;
- `sigkill_shm` / `sigkill_disk`: a `sigkill` of the last rank at `--fault-step`, then the bare relaunch (attempt 2,
  a new torchrun, as the daemon's relaunch minus its detection) with the shared-memory copy of the host tier on /
  off: `relaunch` gives the seconds from the kill to the relaunch's first step, the tag it resumed from and the
  steps redone.
Figures (from each run's telemetry, kept under --out with the logs):
- per save: `checkpoint_saved.blocked_seconds` (the async save's hold), the `memory_snapshot` seconds of the
  same step, their sum, `staging`/`deferred_steps` from `checkpoint_saving`; the row passes when every sum is <= 2 s;
- per fault: lost_vs_base = (last step time - `started` time) of the fault run minus the same in `base`; and
  lost_in_run = that wall span minus the sum of the step times of the distinct steps (each step's last record):
  the issue's "wall time minus productive step time, redone steps included"; plus the `in_process_restart` event.
Not covered here (they need the daemon): the daemon's detection of a SIGKILL, a hang, and the 8-minute run with a random
fault every ~90 s; bench/gpu_ckpt21.py and bench/chaos.py run those, with `[checkpoint] memory_tier` added.

    python bench/gpu_seconds_per_fault.py --out $OUT/faults [--steps 60] [--fault-step 37] [--seq 16384]
    python bench/gpu_seconds_per_fault.py --out /tmp/x --smoke    # the tiny CPU job, 2 ranks (checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_common import read_records  # noqa: E402

DAEMON_SECTIONS = ("run", "launcher", "detectors", "remediation", "daemon", "slurm", "restart")
#: The runs, each with its fault kind.
RUNS: dict[str, str | None] = {"base": None, "exception": "raise", "mid_step": "raise_mid_step", "nan": "nan_loss",
                               "sigkill_shm": "sigkill", "sigkill_disk": "sigkill"}


def job_dict(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        return {"model": {"preset": "tiny"}, "parallel": {"sequence_parallel_size": 2}, "precision": {"dtype": "fp32"},
                "train": {"seq_len": 64, "warmup_steps": 2, "device": "cpu", "seed": 7}}
    import tomllib

    spec = tomllib.loads((REPO / args.config).read_text())
    for key in DAEMON_SECTIONS:
        spec.pop(key, None)
    spec["train"]["seq_len"] = args.seq
    return spec


def run_job(name: str, spec: dict[str, Any], args: argparse.Namespace, out: Path, attempt: int = 1) -> dict[str, Any]:
    from ulyssesd.training.spec import job_spec_from_dict

    rd = out / name
    rd.mkdir(parents=True, exist_ok=True)
    cfg = rd / "config.json"
    cfg.write_text(job_spec_from_dict(spec).to_json())
    nproc = 2 if args.smoke else args.nproc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "ulyssesd.training", "--config", str(cfg), "--run-dir", str(rd), "--attempt", str(attempt)]
    env = {**os.environ, **({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if args.smoke else
                            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})}
    env.pop("ULYSSESD_RUN_DIR", None)
    t0 = time.time()
    with open(rd / f"job-{attempt}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=args.timeout).returncode
    return {"name": name, "rc": rc, "seconds": round(time.time() - t0, 2), "records": read_records(rd / "telemetry.jsonl")}


def events(recs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in recs if r.get("kind") == "event" and r.get("event") == name]


def wall_and_productive(recs: list[dict[str, Any]]) -> tuple[float, float, int]:
    started = events(recs, "started")[0]["time"]
    steps = [r for r in recs if r.get("kind") == "step"]
    last: dict[int, float] = {}
    for r in steps:
        last[r["step"]] = float(r.get("step_time_max_s") or r["step_time_s"])
    return steps[-1]["time"] - started, sum(last.values()), len(steps)


def save_rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    snaps = {e["step"]: e["seconds"] for e in events(recs, "memory_snapshot")}
    saving = {e["tag"]: e for e in events(recs, "checkpoint_saving")}
    rows = []
    for e in events(recs, "checkpoint_saved"):
        blocked = float(e.get("blocked_seconds", e.get("seconds", 0.0)))
        gate = saving.get(e["tag"], {})
        rows.append({"tag": e["tag"], "step": e["step"], "blocked_seconds": blocked,
                     "memory_snapshot_seconds": snaps.get(e["step"], 0.0),
                     "total_blocked_seconds": round(blocked + snaps.get(e["step"], 0.0), 3),
                     "staging": gate.get("staging"), "deferred_steps": gate.get("deferred_steps", 0),
                     "snapshot_pool": e.get("snapshot_pool"), "waited_for_previous_seconds":
                     e.get("waited_for_previous_seconds")})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out") + "/seconds_per_fault")
    ap.add_argument("--config", default="configs/gpt-1b-1xh200.toml")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-step", type=int, default=37)
    ap.add_argument("--memory-interval", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU job (2 ranks, gloo): checks the script only")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.fault_step = min(args.steps, 12), min(args.fault_step, 9)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = job_dict(args)
    base.setdefault("train", {}).update(steps=args.steps)
    base["checkpoint"] = {**base.get("checkpoint", {}), "interval_steps": 10, "save_at_end": False, "keep_last": 2,
                          "async_save": True, "save_defer_max_steps": 5, "memory_tier": True, "in_process_restart": True,
                          "memory_interval_steps": args.memory_interval}
    result: dict[str, Any] = {"args": vars(args), "runs": {}}
    walls: dict[str, float] = {}
    last_rank = (2 if args.smoke else args.nproc) - 1
    for name in [r for r in RUNS if r in args.runs.split(",")]:
        fault = RUNS[name]
        spec = json.loads(json.dumps(base))
        spec["faults"] = [{"kind": fault, "at_step": args.fault_step, "rank": last_rank if fault in (
            "raise_mid_step", "sigkill") else 0}] if fault else []
        if name.startswith("sigkill"):
            spec["checkpoint"]["memory_shm"] = name == "sigkill_shm"
            result["runs"][name] = relaunch_row(name, spec, args, out)
            (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
            continue
        run = run_job(name, spec, args, out)
        recs = run.pop("records")
        row: dict[str, Any] = {**run}
        if run["rc"] == 0 and events(recs, "started"):
            wall, productive, nrec = wall_and_productive(recs)
            walls[name] = wall
            row.update(wall_s=round(wall, 3), productive_s=round(productive, 3),
                       lost_in_run_s=round(wall - productive, 3), step_records=nrec,
                       in_process_restart=events(recs, "in_process_restart"),
                       saves=save_rows(recs), memory_snapshots=events(recs, "memory_snapshot"),
                       deferred=events(recs, "checkpoint_deferred"))
            if name != "base" and "base" in walls:
                row["lost_vs_base_s"] = round(wall - walls["base"], 3)
        result["runs"][name] = row
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    base_row = result["runs"].get("base", {})
    saves = base_row.get("saves", [])
    result["summary"] = {
        "max_blocked_per_save_s": max((s["total_blocked_seconds"] for s in saves), default=None),
        "saves": len(saves),
        "blocked_le_2s": bool(saves) and all(s["total_blocked_seconds"] <= 2.0 for s in saves),
        **{f"{k}_lost_vs_base_s": result["runs"].get(k, {}).get("lost_vs_base_s") for k in ("exception", "mid_step", "nan")},
        **{f"{k}_lost_in_run_s": result["runs"].get(k, {}).get("lost_in_run_s")
           for k in ("base", "exception", "mid_step", "nan")},
        **{f"{k}_path": [e.get("path") for e in result["runs"].get(k, {}).get("in_process_restart", [])]
           for k in ("exception", "mid_step", "nan")},
        **{f"{k}_relaunch": {f: result["runs"].get(k, {}).get(f) for f in ("kill_to_first_step_s", "resumed_from",
                                                                           "redone_steps")}
           for k in ("sigkill_shm", "sigkill_disk")},
    }
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(r.get("rc") == 0 for r in result["runs"].values()) else 1


def relaunch_row(name: str, spec: dict[str, Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The killed attempt, then the bare relaunch (attempt 2): seconds from the kill to its first step."""
    first = run_job(name, spec, args, out)
    second = run_job(name, spec, args, out, attempt=2)
    recs = second.pop("records")
    first.pop("records")
    kill = [e for e in events(recs, "fault_injected") if e.get("fault") == "sigkill" and e.get("attempt") == 1]
    started = [e for e in events(recs, "started") if e.get("attempt") == 2]
    steps2 = [r for r in recs if r.get("kind") == "step" and r.get("attempt") == 2]
    steps1 = [r["step"] for r in recs if r.get("kind") == "step" and r.get("attempt") == 1]
    row: dict[str, Any] = {"name": name, "rc": second["rc"], "killed_rc": first["rc"],
                           "seconds": round(first["seconds"] + second["seconds"], 2)}
    if kill and started and steps2:
        row.update(kill_to_first_step_s=round(steps2[0]["time"] - kill[0]["time"], 3),
                   resumed_from=started[0].get("resumed_from"), start_step=started[0].get("start_step"),
                   redone_steps=max(steps1, default=0) - int(started[0].get("start_step") or 0),
                   startup=started[0].get("startup"),
                   shm=events(recs, "memory_snapshot_restored") + events(recs, "memory_snapshot_unused"))
    return row


if __name__ == "__main__":
    sys.exit(main())
