"""GPU throughput / memory benchmark of the real training job (run on the lent H200s).

Each case = the base spec + dotted overrides; it is launched exactly as the daemon launches the job
(torchrun + `python -m ulyssesd.training`), and its own telemetry is the measurement:
median step time over the steps after warm-up, tokens/s, TF/s per GPU and MFU per
docs/DEEPSPEED_NOTES.md (causal-corrected model FLOPs, recompute not counted, / 989 TF/s), and the
peak `mem_max_allocated_gib` over ranks. Results: one JSON line per case on stdout and in --out.

    python bench/gpu_bench.py --nproc 2 --steps 12 --out $OUT/bench.jsonl \
        --case 'name=7b-32k-ckpt1 model.preset=gpt-7b train.seq_len=32768 train.activation_checkpoint_every=1'

A case with `program=reference` runs the plain DeepSpeed GPT of bench/reference_gpt.py on the same spec
instead of the product (same timing, same MFU), so a comparison can run in one device call.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomllib
from bench_common import read_records

H200_BF16_DENSE_TFLOPS = 989.0


def model_flops_per_step(m: dict[str, Any], seq_len: int, tokens_per_step: int) -> float:
    """(6·N_non-embedding + 6·V·h)·T + 6·L·h·S²·(T/S): the reference README's definition, causal attention."""
    h, layers, v, f = m["hidden_size"], m["num_layers"], m["vocab_size"], m["ffn_hidden_size"]
    mlp_mats = 3 if m["mlp"] == "swiglu" else 2
    n_non_emb = layers * (4 * h * h + mlp_mats * h * f)
    sequences = tokens_per_step / seq_len
    return (6 * n_non_emb + 6 * v * h) * tokens_per_step + 6 * layers * h * seq_len * seq_len * sequences


def set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def to_toml(d: dict[str, Any], prefix: str = "") -> str:
    scalars, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            scalars.append(f"{k} = {json.dumps(v)}")
    out = ""
    if prefix and scalars:
        out += f"[{prefix}]\n"
    out += "".join(s + "\n" for s in scalars)
    for k, v in tables:
        out += to_toml(v, f"{prefix}.{k}" if prefix else k)
    return out


def run_case(base: dict[str, Any], overrides: list[str], nproc: int, steps: int, workdir: Path,
             timeout_s: float, direct: bool = False) -> dict[str, Any]:
    spec = json.loads(json.dumps(base))
    name = "case"
    program = ["-m", "ulyssesd.training"]
    env = dict(os.environ)
    for item in overrides:
        key, _, raw = item.partition("=")
        if key == "name":
            name = raw
            continue
        if key == "steps":  # per-case step count
            steps = int(raw)
            continue
        if key == "timeout":  # per-case wall-clock limit, seconds
            timeout_s = float(raw)
            continue
        if key == "program":  # program=reference: the plain DeepSpeed GPT of bench/reference_gpt.py
            if raw != "reference":
                raise SystemExit(f"case {name!r}: program={raw!r}; only program=reference is known")
            program = [str(Path(__file__).with_name("reference_gpt.py"))]
            continue
        if key.startswith("env."):  # process environment, e.g. env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
            env[key[4:]] = raw
            continue
        set_dotted(spec, key, parse_value(raw))
    set_dotted(spec, "train.steps", steps)
    set_dotted(spec, "checkpoint.interval_steps", 10**9)
    spec.setdefault("checkpoint", {}).setdefault("save_at_end", False)  # no 96 GB write per case
    run_dir = workdir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.toml"
    spec_path.write_text(to_toml(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *program, "--spec", str(spec_path), "--run-dir", str(run_dir), "--attempt", "1"]
    if direct and nproc == 1:   # one rank started directly: no torchrun interpreter (~5 s of torch import less)
        cmd = [sys.executable, *program, "--spec", str(spec_path), "--run-dir", str(run_dir), "--attempt", "1"]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    t0 = time.time()
    with open(run_dir / "log.txt", "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the whole session of this case
            proc.wait()
            rc = "timeout"
    wall = time.time() - t0
    tel = run_dir / "telemetry.jsonl"
    steps_rec = [r for r in read_records(tel) if r.get("kind") == "step"]
    result: dict[str, Any] = {"name": name, "overrides": overrides, "rc": rc, "wall_s": round(wall, 1),
                              "steps_done": len(steps_rec)}
    if program[0] == "-m":
        result.update(_prediction(spec, nproc))
    else:
        result["program"] = "reference"

    started = [r for r in read_records(tel) if r.get("event") == "started"]
    if started and steps_rec:
        result["first_step_after_start_s"] = round(steps_rec[0]["time"] - started[0]["time"], 1)
    if rc != 0 or len(steps_rec) < 3:
        result["log_tail"] = (run_dir / "log.txt").read_text()[-3000:]
    if steps_rec:
        from ulyssesd.training.spec import DAEMON_SECTIONS, JobSpec

        job = JobSpec.model_validate({k: v for k, v in spec.items() if k not in DAEMON_SECTIONS})
        m = job.resolved_model().model_dump()
        # Step 1 pays lazy optimizer-state allocation and cuDNN/NCCL warm-up.
        warm = steps_rec[2:] if len(steps_rec) > 4 else (steps_rec[1:] or steps_rec)
        if len(steps_rec) == 1:
            result["single_step_includes_warmup"] = True  # a 1-step case (very long sequences): slower than steady
        step_s = statistics.median(r.get("step_time_max_s") or r["step_time_s"] for r in warm)
        tokens = warm[-1]["tokens"]
        flops = model_flops_per_step(m, job.train.seq_len, tokens)
        tflops_per_gpu = flops / step_s / nproc / 1e12
        result.update({
            "seq_len": job.train.seq_len, "tokens_per_step": tokens, "median_step_s": round(step_s, 3),
            "tokens_per_s": round(tokens / step_s, 1), "tflops_per_gpu": round(tflops_per_gpu, 1),
            "mfu_pct": round(100 * tflops_per_gpu / H200_BF16_DENSE_TFLOPS, 1),
            "peak_mem_gib": max((r.get("mem_max_allocated_gib") or 0) for r in steps_rec),
            "reserved_gib": max((r.get("mem_reserved_gib") or 0) for r in steps_rec),
            "final_loss": steps_rec[-1]["loss"],
        })
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prediction(spec: dict[str, Any], nproc: int) -> dict[str, Any]:
    """The planner's predicted peak for this exact case (issue 8: compare with the measured peak)."""
    try:
        from ulyssesd.training.ds_config import build_ds_config
        from ulyssesd.training.planner import Cluster, predict_peak_gib
        from ulyssesd.training.spec import job_spec_from_dict

        job = job_spec_from_dict(spec)
        ds, _ = build_ds_config(job, nproc)
        cluster = Cluster.preset("h200-141g", gpus_per_node=nproc, nodes=1, host_mem_gib=128.0 * nproc / 2)
        return {"predicted_peak_gib": round(predict_peak_gib(job, cluster, ds), 2)}
    except Exception as exc:  # the benchmark must not die on a planner problem
        return {"prediction_error": f"{type(exc).__name__}: {exc}"[:300]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="configs/gpt-7b-2xh200.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--case", action="append", default=[], help="space-separated key=value overrides")
    ap.add_argument("--workdir", default=os.environ.get("BENCH_WORKDIR", "/tmp/ulysses-bench"))
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--out", default=None)
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds; a case is not started unless its timeout ends before this")
    args = ap.parse_args()
    with open(args.base, "rb") as fh:
        base = tomllib.load(fh)
    for case in args.case:
        items = shlex.split(case)
        case_timeout = next((float(i.split("=", 1)[1]) for i in items if i.startswith("timeout=")), args.timeout_s)
        if args.deadline is not None and time.time() + min(case_timeout, 90) > args.deadline:
            res = {"name": next((i[5:] for i in items if i.startswith("name=")), "case"), "skipped": "deadline"}
            print(json.dumps(res), flush=True)
            continue
        if args.deadline is not None:
            # Never run past the device call's own limit: cut the case short instead.
            items = [i for i in items if not i.startswith("timeout=")]
            items.append(f"timeout={max(30.0, min(case_timeout, args.deadline - time.time()))}")
        res = run_case(base, items, args.nproc, args.steps, Path(args.workdir), args.timeout_s)
        line = json.dumps(res)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
