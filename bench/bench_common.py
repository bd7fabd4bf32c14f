"""What the bench scripts share: reading a telemetry file as raw dicts, finding a run's training ranks."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

MAX_LINE_CHARS = 1 << 20


def read_records(path: Path) -> list[dict]:
    """Every JSON object line of a JSONL file; unreadable files and garbage lines are skipped (benchmarks
    read files that are still being written and that chaos runs corrupt on purpose)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if len(line) > MAX_LINE_CHARS:  # a poison line of the chaos runs: no record is this long
            continue
        try:
            d = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def rank_pids(run_dir: Path) -> list[tuple[int, int]]:
    """(rank, pid) of the run's live training ranks, sorted (rank -1 when its environment is unreadable)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ulyssesd.training" in cmd and str(run_dir) in cmd and "torch.distributed.run" not in cmd \
                and "job_wrapper" not in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            try:
                rank = int(p.environ().get("RANK", "-1"))
            except (psutil.Error, ValueError):
                rank = -1
            out.append((rank, p.pid))
    return sorted(out)
