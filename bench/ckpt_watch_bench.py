"""What watching a command job's checkpoint dir costs (daemon/job/checkpoint_files.py, issue 28).

Writes N checkpoint folders of F small torch.save files each (a sharded save's file count) and times:
one full look (every entry examined: signatures + zip end records), one look of the running watch once every
checkpoint is reported (they are skipped), and `resume_point` as a launch calls it (newest first, two looks of
the chosen one with its 0.2 s wait). Medians of a few repeats, JSON on stdout (or --out).

    .venv/bin/python bench/ckpt_watch_bench.py --dir /path/on/the/ckpt/disk --checkpoints 50 --files 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ulyssesd.daemon.job.checkpoint_files import WatchConfig, look, resume_point


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--checkpoints", type=int, default=50)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-watch-"))
    state = {"w": torch.zeros(64)}
    for s in range(1, args.checkpoints + 1):
        d = root / f"step_{s * 100:06d}"
        d.mkdir()
        for r in range(args.files):
            torch.save(state, d / f"rank{r:03d}.pt")
    names = {p.name for p in root.iterdir()}
    result = {
        "checkpoints": args.checkpoints, "files_per_checkpoint": args.files, "dir": str(root),
        "full_look_ms": _median_ms(lambda: look(root), args.repeats),
        "watch_look_all_reported_ms": _median_ms(lambda: look(root, skip=names), args.repeats),
        "launch_resume_point_ms": _median_ms(lambda: resume_point(WatchConfig(root=root)), max(1, args.repeats // 2)),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
