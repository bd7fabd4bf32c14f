"""Tail `{run_dir}/telemetry.jsonl` by byte offset + inode.

- Only complete lines are consumed; a partial last line (the job is mid-write) waits for its newline.
- A new inode (file replaced) or a file shorter than the cursor (truncated) restarts at offset 0.
- Garbage lines are logged (first few verbatim) and counted, never raised: one bad line must not stop
  supervision of a multi-day run.
- The cursor (inode, offset) is what the store persists; a re-adopting daemon resumes exactly there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ulyssesd.daemon.logging import get_logger
from ulyssesd.remediation.records import Record, RecordError, parse_line

log = get_logger("ulyssesd.telemetry")

MAX_BATCH_BYTES = 4 << 20  # bound one tick's work on a huge backlog


@dataclass
class Cursor:
    inode: int
    offset: int


class TelemetryReader:
    def __init__(self, path: Path, cursor: Cursor | None = None, max_logged_garbage: int = 5):
        self.path = Path(path)
        self.cursor = cursor or Cursor(inode=0, offset=0)
        self.garbage_lines = 0
        self.max_logged_garbage = max_logged_garbage

    def read(self) -> list[tuple[Record, int]]:
        """New complete records since the cursor, each with the byte offset just after it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self.cursor.inode and st.st_ino != self.cursor.inode:
            log.warning("telemetry file replaced; reading from the start", path=str(self.path),
                        old_inode=self.cursor.inode, new_inode=st.st_ino)
            self.cursor = Cursor(st.st_ino, 0)
        elif st.st_size < self.cursor.offset:
            log.warning("telemetry file truncated; reading from the start", path=str(self.path),
                        offset=self.cursor.offset, size=st.st_size)
            self.cursor = Cursor(st.st_ino, 0)
        self.cursor.inode = st.st_ino
        if st.st_size == self.cursor.offset:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.cursor.offset)
            chunk = fh.read(MAX_BATCH_BYTES)
        out: list[tuple[Record, int]] = []
        pos = self.cursor.offset
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break  # partial last line: wait for the rest
            raw = chunk[start:nl]
            end_offset = pos + nl + 1
            start = nl + 1
            if not raw.strip():
                self.cursor.offset = end_offset
                continue
            try:
                rec = parse_line(raw.decode("utf-8", errors="replace"))
            except RecordError as exc:
                self.garbage_lines += 1
                if self.garbage_lines <= self.max_logged_garbage:
                    log.warning("garbage telemetry line skipped", path=str(self.path), offset=end_offset - len(raw) - 1,
                                error=str(exc), count=self.garbage_lines)
                self.cursor.offset = end_offset
                continue
            out.append((rec, end_offset))
            self.cursor.offset = end_offset
        # Leave the cursor after the last *processed* line; the caller persists it after acting.
        return out
