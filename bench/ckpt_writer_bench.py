"""The background checkpoint writer's speed against the disk's, per variant, in one run (issue 21).

Writes an N-GiB state (a few large tensors, like one rank's ZeRO optimizer shard) with the real writer
(`write_shard_direct`: O_DIRECT, chunk digests) and reports GB/s for each variant:

- digest mode: `whole` (the v2 writer: whole-file sha256 in one serial stream + the chunk digests) or
  `chunks` (v3: each byte hashed once, chunk digests in a pool of threads);
- source memory: `plain` (pageable), `pinned` (`Tensor.pin_memory()`, CUDA only), `registered` (the
  snapshot pool's pageable memory registered with cudaHostRegister, CUDA only);
- busy: with or without a GIL-heavy Python loop in another thread (as the training thread is);

plus `dd oflag=direct` of the same size into the same directory, and one sha256 stream's speed, so each
variant's fraction of the disk is measured in the same run. Variants the machine cannot run are skipped
(reported as such). CPU-runnable with a small --gib.

    .venv/bin/python bench/ckpt_writer_bench.py --dir /path/on/the/ckpt/disk --gib 16 --out results/x.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

TENSORS = 4   # a ZeRO shard is a few flat fp32 tensors (params, exp_avg, exp_avg_sq, ...)


def make_state(gib: float, source: str) -> tuple[dict[str, Any], Any]:
    """(state dict of TENSORS fp32 tensors totalling `gib` GiB in `source` memory, the pool to release or None)."""
    import torch

    n = int(gib * (1 << 30) / 4 / TENSORS)
    plain = {f"t{i}": torch.empty(n, dtype=torch.float32).fill_(i + 1.5) for i in range(TENSORS)}
    if source == "plain":
        return plain, None
    if source == "pinned":
        return {k: v.pin_memory() for k, v in plain.items()}, None
    from ulyssesd.training.checkpoint.snapshot import CudaHostRegistrar, SnapshotPool, snapshot_pool_bytes

    pool = SnapshotPool(snapshot_pool_bytes([plain], device_only=False), CudaHostRegistrar(0), pause_s=0.0).start()
    if not pool.wait_ready(600):
        raise RuntimeError(f"snapshot pool not ready: {pool.describe()}")
    out = {}
    for k, v in plain.items():
        view = pool.take(v)
        if view is None:
            raise RuntimeError("snapshot pool too small for the state")
        view.copy_(v)
        out[k] = view
    return out, pool


class Busy:
    """A thread that holds the GIL as a Python training loop does (pure-Python arithmetic, no releases)."""

    def __init__(self) -> None:
        self.stop, self.loops = threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="gil-busy")

    def _run(self) -> None:
        x = 0
        while not self.stop.is_set():
            for i in range(10_000):
                x += i * i
            self.loops += 1

    def __enter__(self) -> Busy:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def dd_direct(directory: Path, gib: float) -> dict[str, Any]:
    """`dd if=/dev/zero oflag=direct` of about `gib` GiB in 64 MiB blocks: the disk's sequential write speed."""
    f = directory / "ckpt_writer_bench.dd"
    count = max(1, int(gib * 16))
    try:
        proc = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "oflag=direct"],
                              capture_output=True, text=True, timeout=900)
    finally:
        f.unlink(missing_ok=True)
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", last)
    if proc.returncode != 0 or not m:
        return {"skipped": f"dd failed (rc {proc.returncode}): {last}"}
    return {"bytes": int(m.group(1)), "seconds": float(m.group(2)),
            "GBps": round(int(m.group(1)) / float(m.group(2)) / 1e9, 3), "dd": last}


def sha256_stream_gbps(mib: int = 1024) -> float:
    """One sha256 stream's speed on this CPU (the cap of the whole-file digest), GB/s."""
    data = os.urandom(1 << 20) * mib
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return round(len(data) / (time.perf_counter() - t0) / 1e9, 3)


def run_variant(directory: Path, state: dict[str, Any], mode: str, busy: bool) -> dict[str, Any]:
    from ulyssesd.training.checkpoint import shard_io

    path = directory / "ckpt_writer_bench.pt"
    loops = 0
    t0 = time.perf_counter()
    try:
        if busy:
            with Busy() as b:
                size, _ = shard_io.write_shard_direct(state, path, mode=mode)
            loops = b.loops
        else:
            size, _ = shard_io.write_shard_direct(state, path, mode=mode)
        seconds = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": size, "seconds": round(seconds, 3), "GBps": round(size / seconds / 1e9, 3),
            **({"busy_loops": loops} if busy else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="directory on the checkpoint disk to write into")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the state written per variant, GiB")
    ap.add_argument("--modes", default="whole,chunks", help="digest modes, comma-separated (whole, chunks)")
    ap.add_argument("--sources", default="plain,pinned,registered",
                    help="source memory, comma-separated (plain, pinned, registered; the last two need CUDA)")
    ap.add_argument("--busy", default="off,on", help="GIL-busy thread: off, on or both (comma-separated)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all variants (interleaved)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here too")
    a = ap.parse_args(argv)
    if a.gib <= 0 or a.repeat < 1:
        ap.error("--gib must be > 0 and --repeat >= 1")
    modes, sources = a.modes.split(","), a.sources.split(",")
    busies = [{"off": False, "on": True}[b] for b in a.busy.split(",")]
    if not set(modes) <= {"whole", "chunks"} or not set(sources) <= {"plain", "pinned", "registered"}:
        ap.error(f"unknown mode or source in --modes {a.modes!r} / --sources {a.sources!r}")
    a.dir.mkdir(parents=True, exist_ok=True)
    import torch

    from ulyssesd.training.checkpoint import shard_io

    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": os.uname().nodename,
        "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "gib": a.gib, "dir": str(a.dir),
        "chunk_hash_threads": shard_io.CHUNK_HASH_THREADS, "direct_buffers": shard_io.DIRECT_BUFFERS,
        "sha256_1stream_GBps": sha256_stream_gbps(), "dd_direct": dd_direct(a.dir, a.gib), "variants": {}}
    dd = res["dd_direct"].get("GBps")
    print(f"dd oflag=direct: {dd} GB/s; one sha256 stream: {res['sha256_1stream_GBps']} GB/s; "
          f"load {res['loadavg_1m']:.2f} on {res['cpus']} cpus", flush=True)
    for source in sources:
        if source != "plain" and not torch.cuda.is_available():
            res["variants"][source] = {"skipped": "needs CUDA"}
            print(f"{source}: skipped (needs CUDA)", flush=True)
            continue
        state, pool = make_state(a.gib, source)
        try:
            for _ in range(a.repeat):
                for mode in modes:
                    for busy in busies:
                        name = f"{mode}/{source}/{'busy' if busy else 'idle'}"
                        r = run_variant(a.dir, state, mode, busy)
                        r["vs_dd"] = round(r["GBps"] / dd, 3) if dd else None
                        res["variants"].setdefault(name, []).append(r)
                        print(f"{name:28s} {r['GBps']:6.3f} GB/s  ({r['vs_dd']} of dd)  {r['seconds']} s",
                              flush=True)
                        save(a.out, res)   # after each variant: a run cut by a timeout keeps what it measured
        finally:
            del state
            if pool is not None:
                pool.release()
    save(a.out, res)
    return 0


def save(out: Path | None, res: dict[str, Any]) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
