"""Checkpoint verification at load, serial vs chunked and parallel (CPU).

Writes one tag of `--files` shards totalling `--gib` GiB of random bytes, commits a manifest with chunk digests,
then times `validate_tag` (best and median of `--repeat`, cases interleaved): the v1 way (whole-file sha256, the same tag with its chunk
fields removed) and chunked with 1, 2, ... `--threads` workers. The shards are in the page cache after the
write, as after a recent save (what the disk adds is not measured here). Prints one JSON line per case.

    .venv/bin/python bench/verify_bench.py --gib 1 --files 1 --threads 2 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ulyssesd.training import checkpoint as ck


def _once(tag: Path, threads: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all threads): CPU / wall says how many cores the run really got."""
    t0, c0 = time.perf_counter(), time.process_time()
    ok, reason = ck.validate_tag(tag, verify_checksums=True, threads=threads)
    if not ok:
        raise SystemExit(f"verification failed: {reason}")
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="total size of the tag in GiB (keep <= 1 on a small box)")
    ap.add_argument("--files", type=int, default=1, help="number of shards the bytes are split into")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="largest thread count timed")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per case")
    ap.add_argument("--dir", default=None, help="where to write the tag (default: a temp dir, removed after)")
    args = ap.parse_args()
    if args.gib <= 0 or args.files < 1 or args.threads < 1 or args.repeat < 1:
        raise SystemExit("--gib must be > 0 and --files, --threads, --repeat >= 1")
    root = Path(tempfile.mkdtemp(prefix="verify-bench-", dir=args.dir))
    try:
        tag = root / ck.tag_for_step(1)
        tag.mkdir()
        total = int(args.gib * (1 << 30))
        block = os.urandom(16 << 20)
        for i in range(args.files):
            left = total // args.files
            with open(tag / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as fh:
                while left > 0:
                    left -= fh.write(block[:min(left, len(block))])
        t0 = time.perf_counter()
        ck.write_manifest(tag, 1, 1.0, 0, 1)
        base = {"gib": args.gib, "files": args.files, "cpus": os.cpu_count(), "chunk_mib": ck.DIGEST_CHUNK_BYTES >> 20}
        print(json.dumps({**base, "case": "write_manifest (whole + chunk digests, one read)",
                          "seconds": round(time.perf_counter() - t0, 3)}))
        # The v1 case: the same bytes (hard links, one page cache) under a manifest without chunk fields.
        v1 = root / ck.tag_for_step(2)
        v1.mkdir()
        for f in tag.iterdir():
            if f.name != ck.MANIFEST_NAME:
                os.link(f, v1 / f.name)
        data = json.loads((tag / ck.MANIFEST_NAME).read_text())
        data["step"], data["tag"], data["v"] = 2, v1.name, 1
        for meta in data["files"].values():
            meta.pop("chunk_bytes", None), meta.pop("chunk_sha256", None), meta.pop("chunk_list_sha256", None)
        (v1 / ck.MANIFEST_NAME).write_text(json.dumps(data))
        cases = {"v1 manifest, whole-file sha256": (v1, args.threads)} | {
            f"chunked, {n} thread(s)": (tag, n) for n in range(1, args.threads + 1)}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(args.repeat):   # interleaved, so load from other processes hits every case alike
            for name, (where, n) in cases.items():
                runs[name].append(_once(where, n))
        serial = min(runs["v1 manifest, whole-file sha256"])[0]
        for name, times in runs.items():
            best, cpu = min(times)
            print(json.dumps({**base, "case": name, "best_s": round(best, 3), "median_s": round(
                statistics.median(t for t, _ in times), 3), "GB_per_s_best": round(total / 1e9 / best, 3),
                "speedup_vs_v1_best": round(serial / best, 2), "cores_used_best": round(cpu / best, 2)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
