"""What stalls a training stream while a checkpoint is taken to host memory (issue 21), on one GPU.

The main thread runs a GPU loop (bf16 matmuls, synchronized each iteration, like a training step's tail);
a background thread does one host-memory operation at a time on N GiB; for each: its wall time and the
main loop's worst iteration against its median (the stall it caused):
  pinned_alloc       torch.empty(pin_memory=True)              (cudaHostAlloc)
  register           torch.empty + fill_ + cudaHostRegister    (pin pageable memory in place)
  d2h_pageable       device -> pageable host copy on a side stream
  d2h_pinned         device -> pinned host copy on a side stream (buffer already pinned)
Then the writer's O_DIRECT shard write of N GiB against `dd oflag=direct` of the same size, same directory.
`--register-chunks-mib 256,1024,4096` instead: N GiB of pageable memory, filled, then cudaHostRegister'ed chunk by
chunk in the background thread (how a registered snapshot pool is built at attempt start); per chunk size: the
fill, each chunk's register time and the GPU loop's stall while it ran, the unregister.

    python bench/gpu_pinned_probe.py --gib 4 --dir /tmp/x --out probe.json
    python bench/gpu_pinned_probe.py --gib 17 --register-chunks-mib 256,1024,4096 --out chunks.json
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


def register_in_chunks(gib: int, chunk_mib: int) -> dict:
    """N GiB of pageable memory filled, then registered chunk by chunk in a background thread while the main
    thread runs the GPU loop; each chunk's register time and the loop's excess time inside its window."""
    n, chunk = gib << 30, chunk_mib << 20
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        (a @ a).sum().item()
    base = []
    for _ in range(20):
        t = time.perf_counter()
        (a @ a).sum().item()
        base.append(time.perf_counter() - t)
    med = statistics.median(base)
    marks: list[tuple[str, float, float, int]] = []
    done = threading.Event()
    keep: dict = {}

    def bg():
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        buf = torch.empty(n, dtype=torch.uint8)
        buf.fill_(0)   # first touch: the pages exist before they are pinned
        marks.append(("fill", t0, time.perf_counter(), 0))
        base_ptr, off = buf.data_ptr(), 0
        while off < n:
            size = min(chunk, n - off)
            t0 = time.perf_counter()
            rc = int(cudart.cudaHostRegister(base_ptr + off, size, 0))
            marks.append(("register", t0, time.perf_counter(), rc))
            off += size
        t0 = time.perf_counter()
        off = 0
        while off < n:
            cudart.cudaHostUnregister(base_ptr + off)
            off += min(chunk, n - off)
        marks.append(("unregister", t0, time.perf_counter(), 0))
        keep["buf"] = buf
        done.set()

    its: list[tuple[float, float]] = []
    th = threading.Thread(target=bg)
    th.start()
    while not done.is_set():
        t = time.perf_counter()
        (a @ a).sum().item()
        its.append((t, time.perf_counter()))
    th.join()
    keep.clear()

    def stall(t0: float, t1: float) -> tuple[float, float]:   # excess of the iterations ending in [t0, t1]
        xs = [e - s for s, e in its if t0 <= e <= t1 + med]
        return sum(max(0.0, x - med) for x in xs), max(xs or [0.0])

    reg = [m for m in marks if m[0] == "register"]
    per = []
    for _, t0, t1, rc in reg:
        st, worst = stall(t0, t1)
        per.append({"s": round(t1 - t0, 4), "stall_s": round(st, 4), "worst_iter_ms": round(1000 * worst, 1), "rc": rc})
    res = {"gib": gib, "chunk_mib": chunk_mib, "chunks": len(reg), "loop_median_ms": round(1000 * med, 2)}
    for name in ("fill", "unregister"):
        m = next(x for x in marks if x[0] == name)
        st, worst = stall(m[1], m[2])
        res[name] = {"s": round(m[2] - m[1], 3), "stall_s": round(st, 3), "worst_iter_ms": round(1000 * worst, 1)}
    res["register_total_s"] = round(sum(x["s"] for x in per), 3)
    res["register_stall_total_s"] = round(sum(x["stall_s"] for x in per), 3)
    res["register_s_per_gib"] = round(res["register_total_s"] / gib, 4)
    res["per_chunk_s_median"] = round(statistics.median(x["s"] for x in per), 4)
    res["per_chunk_stall_max_s"] = max(x["stall_s"] for x in per)
    res["worst_iter_ms"] = max(x["worst_iter_ms"] for x in per)
    res["register_errors"] = sum(1 for x in per if x["rc"])
    res["per_chunk"] = per if len(per) <= 80 else per[:40] + per[-10:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/ulysses-probe")
    ap.add_argument("--out", required=True)
    ap.add_argument("--register-chunks-mib", default="", help="comma list: only the chunked-register probe")
    a = ap.parse_args()
    if a.register_chunks_mib:
        chunked = {"gib": a.gib, "runs": []}
        for mib in (int(x) for x in a.register_chunks_mib.split(",")):
            r = register_in_chunks(a.gib, mib)
            chunked["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "per_chunk"}), flush=True)
            with open(a.out, "w") as fh:   # after each size: a cut call keeps what it measured
                json.dump(chunked, fh, indent=1)
        return 0
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
