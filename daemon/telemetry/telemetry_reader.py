"""Tail `{run_dir}/telemetry.jsonl` by byte offset + inode.

- Only complete lines are consumed; a partial last line (the job is mid-write) waits for its newline.
- A new inode (file replaced) or a file shorter than the cursor (truncated) restarts at offset 0.
- Garbage lines are logged (first few verbatim, with their byte offset) and counted, never raised: one bad
  line must not stop supervision of a multi-day run. That includes a parser bug (any exception), not only
  RecordError.
- Bounds: one `read()` reads at most `MAX_BATCH_BYTES`. A line longer than `records.MAX_LINE_BYTES` is
  never buffered: the reader scans forward for its newline over as many reads as it takes (the cursor stays
  at the line's start meanwhile), then counts it as one garbage line and moves the cursor past it.
- The cursor (inode, offset) is what the store persists; a re-adopting daemon resumes exactly there. It is
  always after the last line consumed, good or bad, so a restart never re-reads a line that was skipped.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.safety.regular_file import open_regular
from ulyssesd.remediation.records import MAX_LINE_BYTES, Record, RecordError, parse_line

log = get_logger("ulyssesd.telemetry")

MAX_BATCH_BYTES = 4 << 20  # bound one read's work on a huge backlog (> MAX_LINE_BYTES: a line fits a batch)
#: How long one tick may go on reading a backlog, batch after batch (the daemon's other work waits meanwhile;
#: one batch per 1 s tick made a 5-million-record backlog take minutes of sleeping alone).
DRAIN_BUDGET_S = 2.0


@dataclass
class Cursor:
    inode: int
    offset: int


class TelemetryReader:
    def __init__(self, path: Path, cursor: Cursor | None = None, max_logged_garbage: int = 5,
                 max_batch_bytes: int = MAX_BATCH_BYTES, max_line_bytes: int = MAX_LINE_BYTES):
        self.path = Path(path)
        self.cursor = cursor or Cursor(inode=0, offset=0)
        self.garbage_lines = 0
        self.max_logged_garbage = max_logged_garbage
        self.garbage_samples: list[tuple[int, str]] = []  # (byte offset, error) of the logged bad lines
        self.max_batch_bytes = max(max_batch_bytes, max_line_bytes + 1)  # a line of the maximum length fits
        self.max_line_bytes = max_line_bytes
        # While skipping an over-long line: how far past the cursor (its start) the newline search got.
        self._skip_scanned: int | None = None
        #: True when the last `read()` stopped at its byte bound with more of the file behind it: a backlog,
        #: which the caller may drain with more reads in the same tick (`ingest.drain`).
        self.behind = False
        #: True while the path is not a regular file (a FIFO put there): it is not read, and said once.
        self.not_regular = False

    @property
    def scanned_to(self) -> int:
        """The furthest byte offset examined (past the cursor while an over-long line is being skipped):
        a caller draining the file stops when neither this nor the cursor moves."""
        return self.cursor.offset + (self._skip_scanned or 0)

    def _garbage(self, offset: int, error: str) -> None:
        self.garbage_lines += 1
        if self.garbage_lines <= self.max_logged_garbage:
            self.garbage_samples.append((offset, error))
            log.warning("garbage telemetry line skipped", path=str(self.path), offset=offset, error=error,
                        count=self.garbage_lines)

    def read(self) -> list[tuple[Record, int]]:
        """New complete records since the cursor, each with the byte offset just after it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if not stat.S_ISREG(st.st_mode):  # a FIFO put there would block open() for ever: reported, not read
            if not self.not_regular:
                log.warning("telemetry file is not a regular file (a FIFO, a device?); not read until it is one",
                            path=str(self.path), mode=stat.filemode(st.st_mode))
            self.not_regular = True
            return []
        self.not_regular = False
        if self.cursor.inode and st.st_ino != self.cursor.inode:
            log.warning("telemetry file replaced; reading from the start", path=str(self.path),
                        old_inode=self.cursor.inode, new_inode=st.st_ino)
            self.cursor = Cursor(st.st_ino, 0)
            self._skip_scanned = None
        elif st.st_size < self.cursor.offset:
            log.warning("telemetry file truncated; reading from the start", path=str(self.path),
                        offset=self.cursor.offset, size=st.st_size)
            self.cursor = Cursor(st.st_ino, 0)
            self._skip_scanned = None
        self.cursor.inode = st.st_ino
        self.behind = False
        if st.st_size == self.cursor.offset:
            return []
        try:
            fh = open_regular(self.path, "rb")
        except OSError:  # replaced by something else since the stat: the next read sees what it is
            return []
        with fh:
            if self._skip_scanned is not None and not self._skip_long_line(fh):
                self.behind = True
                return []  # still inside the over-long line
            fh.seek(self.cursor.offset)
            chunk = fh.read(self.max_batch_bytes)
        self.behind = len(chunk) == self.max_batch_bytes and self.cursor.offset + len(chunk) < st.st_size
        out: list[tuple[Record, int]] = []
        pos = self.cursor.offset
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                if len(chunk) - start > self.max_line_bytes:  # an over-long line: skip it without buffering
                    self._skip_scanned = len(chunk) - start
                break  # partial last line: wait for the rest
            raw = chunk[start:nl]
            end_offset = pos + nl + 1
            start = nl + 1
            self.cursor.offset = end_offset  # past this line whatever it holds: never re-read a bad line
            if not raw.strip():
                continue
            if len(raw) > self.max_line_bytes:  # complete but over-long: the same verdict as one skipped
                self._garbage(pos + nl - len(raw), f"line is {len(raw)} bytes long; telemetry lines are at "
                                                   f"most {self.max_line_bytes}")
                continue
            try:
                rec = parse_line(raw.decode("utf-8", errors="replace"))
            except RecordError as exc:
                self._garbage(pos + nl - len(raw), str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - a parser bug must cost one line, not the supervisor
                log.exception("telemetry parser failed on a line; skipped", path=str(self.path),
                              offset=pos + nl - len(raw))
                self._garbage(pos + nl - len(raw), f"internal parser error: {type(exc).__name__}")
                continue
            out.append((rec, end_offset))
        # Leave the cursor after the last *processed* line; the caller persists it after acting.
        return out

    def _skip_long_line(self, fh) -> bool:
        """Scan on for the newline ending the over-long line at the cursor (one batch per call). True once it
        is found and the cursor moved past the line; False while the line goes on."""
        assert self._skip_scanned is not None
        start = self.cursor.offset
        fh.seek(start + self._skip_scanned)
        chunk = fh.read(self.max_batch_bytes)
        nl = chunk.find(b"\n")
        if nl < 0:
            self._skip_scanned += len(chunk)
            return False
        length = self._skip_scanned + nl
        self._skip_scanned = None
        self.cursor.offset = start + length + 1
        self._garbage(start, f"line is {length} bytes long; telemetry lines are at most {self.max_line_bytes}")
        return True
