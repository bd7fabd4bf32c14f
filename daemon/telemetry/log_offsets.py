"""Where reading each attempt's log stopped (`{run_dir}/telemetry-stdout.offsets.json`), and whether the log
still continues there.

Per attempt: the byte offset, the log's inode and the last bytes before the offset (`tail`, hex). A log that
was truncated, replaced or rewritten outside the daemon (logrotate's copytruncate, an editor, a job that
reopens its log with "w") no longer holds those bytes there; reading on from the old offset would then start
mid-line in other text, or skip the new lines up to it. The reader starts that log over from its start instead
(the steps already recorded are dropped by the parser, which starts after the attempt's last recorded step)
and says so. An offsets file that cannot be read is said too: nothing falls back silently.

The file is replaced whole (a per-process temp name + rename) and not fsynced: a lost last write leaves an
older position, whose bytes still match, so the next daemon re-reads a few lines and drops their steps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ulyssesd.training.durable import temp_path_for

TAIL_BYTES = 64  # how many bytes before the offset identify the place reading stopped


@dataclass
class LogPosition:
    """How far one attempt's log was read."""

    offset: int = 0
    inode: int | None = None    # None: not known (a file written before inodes were kept, or never read)
    tail: bytes = b""           # the last bytes before `offset` (at most TAIL_BYTES)

    def to_json(self) -> dict[str, object]:
        return {"offset": self.offset, "inode": self.inode, "tail": self.tail.hex()}


def load(path: Path, attempt: int) -> tuple[LogPosition, str | None]:
    """This attempt's position, and why it could not be read (None when it could, or when there is none yet:
    a first read starts at 0 quietly)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return LogPosition(), None
    except (OSError, ValueError) as exc:
        return LogPosition(), f"the offsets file {path} cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict):
        return LogPosition(), f"the offsets file {path} holds {type(data).__name__}, not an object per attempt"
    entry = data.get(str(attempt))
    if entry is None:
        return LogPosition(), None
    pos = _entry(entry)
    if pos is None:
        return LogPosition(), f"the offsets file {path} has an invalid entry for attempt {attempt}: {entry!r:.200}"
    return pos, None


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(entry: object) -> LogPosition | None:
    if isinstance(entry, int) and _is_count(entry):
        return LogPosition(entry)   # the older form: an offset alone (nothing to check it against)
    if not isinstance(entry, dict) or not _is_count(entry.get("offset")):
        return None
    inode, tail = entry.get("inode"), entry.get("tail") or ""
    if not (inode is None or _is_count(inode)) or not isinstance(tail, str):
        return None
    try:
        raw = bytes.fromhex(tail)
    except ValueError:
        return None
    return LogPosition(entry["offset"], inode, raw[-TAIL_BYTES:])


def save(path: Path, attempt: int, pos: LogPosition) -> None:
    """Replace the offsets file whole with this attempt's position (the other attempts' kept as they are):
    a per-process temp name (two writers, e.g. a daemon that has not yet noticed its successor, never write
    into one temp file and rename the other's half) + rename."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[str(attempt)] = pos.to_json()
    tmp = temp_path_for(path)
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def moved_on(pos: LogPosition, st: os.stat_result, before: bytes | None) -> str | None:
    """Why the log no longer continues where reading stopped, or None when it does. `before` is what the
    file holds now in the `len(pos.tail)` bytes before the offset (None: not read, the file is too short)."""
    if pos.inode is not None and st.st_ino != pos.inode:
        return f"was replaced by another file (inode {pos.inode} -> {st.st_ino})"
    if st.st_size < pos.offset:
        return f"is shorter ({st.st_size} bytes) than where reading stopped ({pos.offset}): truncated or rotated"
    if before is not None and before != pos.tail:
        return f"no longer holds the text read before byte {pos.offset}: rewritten"
    return None


def tail_after(tail: bytes, consumed: bytes) -> bytes:
    """The position's new tail after reading `consumed` more bytes."""
    return (tail + consumed)[-TAIL_BYTES:] if len(consumed) < TAIL_BYTES else consumed[-TAIL_BYTES:]
