"""CPU cost of the host-memory checkpoint tier's parts (training/recovery/host_tier.py), without DeepSpeed:
the copy a capture makes (checkpoint.host_snapshot, plain memory), the manifest's crc32s (background thread
pool), the verification before a restore (the same crc32s again) and the clone a restore hands DeepSpeed.

    python bench/host_tier_cpu.py [--mib 512] [--out DIR]

Writes host_tier_cpu.json (seconds and GB/s per part) under --out (default $OUT or .) and prints it.
The whole-job figures (DeepSpeed's save_checkpoint into memory, the in-process restore) are the
`memory_snapshot` and `in_process_restart` events of the 2-rank job (tests/training/test_in_process_restart.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ulyssesd.training.checkpoint.snapshot import _map_tensors, host_snapshot
from ulyssesd.training.recovery.host_tier import CRC_THREADS, HostTier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB (fp32 tensors of 16 MiB)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    n = max(1, a.mib // 16)
    state = {"optimizer_state_dict": {f"p{i}": torch.randn(4 << 20) for i in range(n)}, "step": 7}
    nbytes = n * (16 << 20)
    res: dict[str, object] = {"bytes": nbytes, "threads": CRC_THREADS, "cpus": os.cpu_count(),
                              "torch_threads": torch.get_num_threads()}

    def timed(name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        s = time.perf_counter() - t0
        res[f"{name}_s"] = round(s, 4)
        res[f"{name}_GBps"] = round(nbytes / s / 1e9, 3)
        return out

    snap = timed("capture_copy", lambda: host_snapshot(state, pin_memory=False))
    tier = HostTier(rank=0)
    tier.tag, tier.step, tier.files = "step-00000001", 1, {"optim.pt": snap}
    timed("manifest_crc32", tier._digest)
    assert timed("verify", tier.verify) is None
    timed("restore_clone", lambda: _map_tensors(snap, lambda t: t.clone()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_tier_cpu.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
