"""A command job's declared length, and whether an exit 0 fell short of it.

The total is the newest step record's `total_steps` (the client's Reporter, an `N/M` step line, HF's
`max_steps`), else `[job] total_steps`; unknown otherwise (nothing is judged). An exit 0 is short of the total
when the last step plus the run's own logging stride (median step increment of the newest records: a job
that logs every 10 steps ends at 990 of 1000) is still below it; a 0-based count ending at total-1 is not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ulyssesd.daemon.safety.regular_file import open_regular

TAIL_BYTES = 256 * 1024


def _recent_steps(path: Path, limit: int = 20) -> list[dict[str, Any]]:
    try:
        with open_regular(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - TAIL_BYTES))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    found: list[dict[str, Any]] = []
    for line in reversed(lines):
        try:
            d = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(d, dict) and d.get("kind") == "step" and isinstance(d.get("step"), int):
            found.append(d)
            if len(found) >= limit:
                break
    return found[::-1]


def _positive(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def short_of_total(telemetry: Path, last_step: int | None, declared: int | None,
                   attempt: int | None = None) -> tuple[int, int] | None:
    """(last step, total) when an exit 0 at `last_step` is short of the run's declared total, else None."""
    recent = [r for r in _recent_steps(telemetry) if attempt is None or r.get("attempt") in (None, attempt)]
    total = (_positive(recent[-1].get("total_steps")) if recent else None) or _positive(declared)
    if total is None:
        return None
    last = last_step if last_step is not None else (recent[-1]["step"] if recent else 0)
    steps = [r["step"] for r in recent]
    incs = sorted(b - a for a, b in zip(steps, steps[1:], strict=False) if b > a)
    stride = incs[len(incs) // 2] if incs else 1
    return (last, total) if last + max(1, stride) < total else None
