"""Activation memory of the product's GPT, measured against the planner's activation items, on one GPU.

Why: at 1M tokens the planner under-predicted the measured peak by 9.7 GiB (device call 20). This runs the
real model (plain torch, no DeepSpeed: ZeRO's items are not in question) with the 1M spec's levers but few
layers, at several lengths, and reports per length: the measured peak above parameters + grads, the planner's
activation items at the peak phase, and what is alive at the measured peak (torch's allocator trace, grouped
by the innermost frame of this checkout's code). A gap that grows with the length is a per-token item.

    python3 bench/gpu_act_mem.py --layers 4 --keep-last 2 --seqs 131072,262144,524288,1048576   # H200, 260 s
    BENCH_CPU=1 python bench/gpu_act_mem.py --layers 2 --keep-last 1 --seqs 512 --mlp-chunk 128 --loss-chunk 128

Prints one JSON line per length.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.planner import Cluster, plan
from ulyssesd.training.spec import JobSpec

OWN = ("/training/", "/ulyssesd/")
# The planner's activation items (training/planner/cost_model.py `_activation_items`), by name prefix.
ACTIVATION_ITEMS = ("checkpointed", "recomputed", "activations", "kept attention", "block backward", "TiledMLP",
                    "final norm", "logits", "inputs, labels")


def job_for(args: argparse.Namespace, seq: int) -> JobSpec:
    cpu = bool(os.environ.get("BENCH_CPU"))
    return JobSpec.model_validate({
        "model": {"preset": "tiny" if cpu else "gpt-1b", "num_layers": args.layers, "max_seq_len": seq,
                  "offload_checkpoints": True, "offload_keep_last": args.keep_last,
                  "mlp_chunk_tokens": args.mlp_chunk, "qkv_copy": True, "rotary_fused": False,
                  "compile_blocks": False, "checkpoint_keep_attention": False},
        "precision": {"dtype": "fp32" if cpu else "bf16"},
        "train": {"seq_len": seq, "micro_batch_size": 1, "activation_checkpoint_every": 1,
                  "loss_chunk_tokens": args.loss_chunk, "device": "cpu" if cpu else "cuda"},
    })


def frame_of(frames: list[dict]) -> str:
    """The innermost frame in this checkout's code (else the innermost frame at all)."""
    for f in frames:
        if any(o in f["filename"] for o in OWN):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']}" if frames else "?"


def live_at_peak(snapshot: dict, base_live: int) -> tuple[int, list[tuple[str, int, int]]]:
    """Replay the allocator trace: the peak of live bytes and what was alive then, grouped by frame."""
    live: dict[int, tuple[int, str]] = {}
    cur, peak, at_peak = base_live, base_live, {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], frame_of(e.get("frames", [])))
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size
        groups[where][1] += 1
    top = sorted(((w, b, n) for w, (b, n) in groups.items()), key=lambda x: -x[1])[:14]
    return peak, top


def step(model: GPT, seq: int, dev: str) -> None:
    ids = torch.randint(0, model.cfg.vocab_size, (1, seq), device=dev)
    pos = torch.arange(seq, device=dev)[None]
    model(ids, pos, ids).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--seqs", default="131072,262144,524288")
    ap.add_argument("--mlp-chunk", type=int, default=16384)
    ap.add_argument("--loss-chunk", type=int, default=8192)
    # Off by default: on torch 2.11 + CUDA, recording with stacks="python" made the checkpointed loss chunk's
    # recompute raise "SystemError: cross_entropy_loss returned NULL" (device call 21).
    ap.add_argument("--trace", type=int, default=0, help="record the allocator trace (what is alive at the peak)")
    args = ap.parse_args()
    cpu = bool(os.environ.get("BENCH_CPU"))
    dev = "cpu" if cpu else "cuda"
    seqs = [int(s) for s in args.seqs.split(",")]
    job = job_for(args, max(seqs))
    dtype = torch.float32 if cpu else torch.bfloat16
    model = GPT(job.resolved_model(), "sdpa" if cpu else "auto", checkpoint_every=1,
                loss_chunk_tokens=args.loss_chunk).to(dev, dtype).train()
    step(model, min(seqs), dev)      # warm: grads allocated, cuDNN plans built, host blocks pinned once
    for seq in seqs:
        j = job_for(args, seq)
        p = plan(j, Cluster.preset("h200-141g", gpus_per_node=1, nodes=1, host_mem_gib=128.0), search=False)
        rec: dict = {"seq": seq, "layers": args.layers, "keep_last": args.keep_last,
                     "planner_items": {it.name: [round(it.bytes / 2**30, 3), list(it.phases)] for it in p.items
                                       if it.where == "gpu"},
                     "planner_phase_gib": {k: round(v / 2**30, 3) for k, v in p.phase_bytes.items()}}
        if not cpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if args.trace:
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        t = time.perf_counter()
        step(model, seq, dev)
        if not cpu:
            torch.cuda.synchronize()
            rec["step_s"] = round(time.perf_counter() - t, 2)
            rec["base_gib"] = round(base / 2**30, 3)
            rec["measured_act_peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            # the planner's activation items at the backward phase (everything but parameters and grads)
            act = sum(it.bytes for it in p.items if it.where == "gpu" and "backward" in it.phases
                      and it.name.startswith(ACTIVATION_ITEMS))
            rec["planner_act_backward_gib"] = round(act / 2**30, 3)
            if args.trace:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                peak, top = live_at_peak(snap, base)
                rec["trace_peak_gib"] = round((peak - base) / 2**30, 3)
                rec["alive_at_peak"] = [[w, round(b / 2**30, 3), n] for w, b, n in top]
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
