"""A warm standby's preload on one shard: the preload (read + sha256) and a load + copy served three ways.

    DS_ACCELERATOR=cpu .venv/bin/python bench/standby_preload.py [--gib 1] [--rounds 3]

Writes a ZeRO-3-named model shard of `--gib` GiB (8 float32 tensors, torch.save) into a temp checkpoint
tag with its manifest, then times, best of `--rounds` each, interleaved:

- preload before issue 21's fix: `read_bytes()` then one sha256 pass over the bytes;
- preload now: `training.standby.Preload.read` (64 MiB chunks hashed as they land, into a memfd);
- load + copy into buffers held already (what DeepSpeed does with a loaded partition): from disk (the file is
  in the page cache: the hardest case for a preload), from the old preload (`torch.load(io.BytesIO(data))`),
  from the new one (what `Preload.serve` does: `torch.load` of the memfd with `mmap=True`, MAP_SHARED), and
  from disk mapped (what every resume now does for a file no preload holds: `training.startup.mapped_loads`,
  `torch.load(mmap=True)` of the file, MAP_PRIVATE).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ulyssesd.training import checkpoint as ckpt
from ulyssesd.training.standby import Preload


def _best(fn: Callable[[], object], rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def _mapped_load(path: Path) -> dict:
    with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):  # as training.startup.mapped_loads
        return torch.load(str(path), map_location="cpu", weights_only=False, mmap=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the shard in GiB")
    ap.add_argument("--rounds", type=int, default=3, help="repetitions of each measurement (best is shown)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        tag = root / ckpt.tag_for_step(4)
        tag.mkdir(parents=True)
        shard = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        per = int(args.gib * 2**30 / 4 / 8)
        torch.save({"module": {f"w{i}": torch.randn(per) for i in range(8)}}, shard)
        ckpt.write_manifest(tag, 4, 1.0, 4, 1)
        ckpt.point_latest_to(root, tag.name)
        sha = ckpt.read_manifest(tag)["files"][shard.name]["sha256"]
        dst = {k: torch.empty_like(v) for k, v in torch.load(shard, weights_only=False)["module"].items()}

        def old_preload() -> bytes:
            data = shard.read_bytes()
            assert hashlib.sha256(data).hexdigest() == sha
            return data

        def consume(sd: dict) -> None:
            for k, v in sd["module"].items():
                dst[k].copy_(v)

        t_old = _best(old_preload, args.rounds)
        t_new = _best(lambda: Preload.read(root, 0).release(), args.rounds)  # type: ignore[union-attr]
        data, pre = old_preload(), Preload.read(root, 0)
        assert pre is not None
        fd = pre.files[str(shard.resolve())].fd
        ways = {
            "disk": lambda: consume(torch.load(str(shard), map_location="cpu", weights_only=False)),
            "old preload (BytesIO)": lambda: consume(torch.load(io.BytesIO(data), map_location="cpu",
                                                                weights_only=False)),
            "new preload (memfd mmap)": lambda: consume(torch.load(f"/proc/self/fd/{fd}", map_location="cpu",
                                                                   weights_only=False, mmap=True)),
            "disk, mapped (mapped_loads)": lambda: consume(_mapped_load(shard)),
        }
        best = {k: float("inf") for k in ways}
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            for _ in range(args.rounds):
                for k, fn in ways.items():
                    best[k] = min(best[k], _best(fn, 1))
        pre.release()
    print(f"shard {args.gib:.2f} GiB, load average {os.getloadavg()[0]:.1f}")
    print(f"preload (read + sha256): before {t_old:.2f} s, now {t_new:.2f} s")
    for k, v in best.items():
        print(f"load + copy, {k}: {v:.3f} s")


if __name__ == "__main__":
    main()
