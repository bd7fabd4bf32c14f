"""What stalls a training stream while a checkpoint is taken to host memory (issue 21), on one GPU.

The main thread runs a GPU loop (bf16 matmuls, synchronized each iteration, like a training step's tail);
a background thread does one host-memory operation at a time on N GiB; for each: its wall time and the
main loop's worst iteration against its median (the stall it caused):
  pinned_alloc       torch.empty(pin_memory=True)              (cudaHostAlloc)
  register           torch.empty + fill_ + cudaHostRegister    (pin pageable memory in place)
  d2h_pageable       device -> pageable host copy on a side stream
  d2h_pinned         device -> pinned host copy on a side stream (buffer already pinned)
Then the writer's O_DIRECT shard write of N GiB against `dd oflag=direct` of the same size, same directory.

    python bench/gpu_pinned_probe.py --gib 4 --dir /tmp/x --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import torch


def loop_while(fn, warm_iters: int = 20) -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(warm_iters):
        (a @ a).sum().item()
    done = threading.Event()
    out: dict = {}

    def bg():
        t0 = time.perf_counter()
        try:
            out["result"] = fn()
        except Exception as exc:  # noqa: BLE001 - reported
            out["error"] = repr(exc)
        out["seconds"] = round(time.perf_counter() - t0, 3)
        done.set()

    base = []
    for _ in range(10):
        t = time.perf_counter()
        (a @ a).sum().item()
        base.append(time.perf_counter() - t)
    th = threading.Thread(target=bg)
    th.start()
    its = []
    while not done.is_set():
        t = time.perf_counter()
        (a @ a).sum().item()
        its.append(time.perf_counter() - t)
    th.join()
    med = statistics.median(base)
    out.update(loop_median_ms=round(1000 * med, 2), loop_worst_ms=round(1000 * max(its or [0]), 1),
               stall_s=round(sum(max(0.0, x - med) for x in its), 3), iterations=len(its))
    out.pop("result", None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/ulysses-probe")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    n = a.gib << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    keep: dict = {}
    res: dict = {"gib": a.gib}

    def pinned_alloc():
        keep["pinned"] = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def register():
        t = torch.empty(n, dtype=torch.uint8)
        t.fill_(0)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
        keep["registered"] = t
        return int(rc)

    def d2h(dst_key):
        def run():
            s = torch.cuda.Stream()
            dst = keep[dst_key] if dst_key else torch.empty(n, dtype=torch.uint8)
            with torch.cuda.stream(s):
                dst.copy_(dev, non_blocking=bool(dst_key))
            s.synchronize()
        return run

    for name, fn in (("pinned_alloc", pinned_alloc), ("register", register), ("d2h_pageable", d2h(None)),
                     ("d2h_pinned", d2h("pinned")), ("d2h_registered", d2h("registered"))):
        res[name] = loop_while(fn)
        res[name]["GBps"] = round(n / 1e9 / res[name]["seconds"], 3) if res[name].get("seconds") else None
        print(name, res[name], flush=True)
    from ulyssesd.training.checkpoint.saving import write_shard_direct

    f = os.path.join(a.dir, "dd.bin")
    t0 = time.perf_counter()
    subprocess.run(f"dd if=/dev/zero of={f} bs=64M count={a.gib * 16} oflag=direct status=none", shell=True, check=True)
    res["dd_direct_GBps"] = round(n / 1e9 / (time.perf_counter() - t0), 3)
    os.unlink(f)
    p = os.path.join(a.dir, "shard.pt")
    res["write_shard_direct"] = loop_while(lambda: write_shard_direct({"x": keep["pinned"]}, p))
    res["write_shard_direct"]["GBps"] = round(n / 1e9 / res["write_shard_direct"]["seconds"], 3)
    os.unlink(p)
    print(json.dumps(res), flush=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
