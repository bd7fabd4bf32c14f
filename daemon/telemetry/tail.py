"""The newest step records of a run's telemetry file, read backwards from its end (`ulyssesctl status`,
`runs`): a long run's file is gigabytes and its newest steps are in the last few kilobytes."""

from __future__ import annotations

import json
import os
from typing import Any

from ulyssesd.daemon.safety.regular_file import open_regular

#: How far back from the file's end the newest steps are looked for (at most), and how much per read.
TAIL_READ_BYTES = 256 * 1024
TAIL_BLOCK_BYTES = 32 * 1024


def recent_steps_from_telemetry(run_dir: str | None, limit: int = 20,
                                spec: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The newest `limit` step records in the run's telemetry file (telemetry.jsonl, or the one its spec's
    [telemetry] names: stdout-derived, a custom path), oldest first (read from its end; works with the daemon
    down)."""
    if not run_dir:
        return []
    from ulyssesd.daemon.telemetry.log_source import telemetry_file_of

    path = telemetry_file_of(run_dir, spec)
    found: list[dict[str, Any]] = []
    try:
        with open_regular(path, "rb") as fh:
            # Backwards from the end, one block at a time, until `limit` steps are found or TAIL_READ_BYTES are
            # read: a long run's file is gigabytes and the newest steps are in its last few kilobytes.
            end = fh.seek(0, os.SEEK_END)
            pos, carry = end, b""
            while pos > 0 and end - pos < TAIL_READ_BYTES and len(found) < limit:
                size = min(TAIL_BLOCK_BYTES, pos)
                pos -= size
                fh.seek(pos)
                lines = (fh.read(size) + carry).split(b"\n")
                carry = lines.pop(0) if pos > 0 else b""  # its start is in the block before
                for line in reversed(lines):
                    if _step_of(line, found) and len(found) >= limit:
                        break
            if pos == 0 and carry:
                _step_of(carry, found)
    except OSError:
        return []
    return found[:limit][::-1]


def _step_of(line: bytes, found: list[dict[str, Any]]) -> bool:
    """Append `line`'s record to `found` when it is a step record; True when it was."""
    if not line.strip():
        return False
    try:
        d = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):  # garbage or a hostile deeply nested line: not a step
        return False
    if isinstance(d, dict) and d.get("kind") == "step":
        found.append(d)
        return True
    return False
