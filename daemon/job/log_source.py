"""`[telemetry] source = "stdout"`: telemetry for a job that only prints logs.

Each tick, before the telemetry reader runs, the attempt's log (`{run_dir}/logs/attempt-{N}.log`, which the
daemon already captures) is read from where the last tick stopped; complete lines go through the log parsers
(`ulyssesd.remediation.log_telemetry`) and the records they yield are appended to
`{run_dir}/telemetry-stdout.jsonl`, which the ordinary telemetry reader then tails (same cursor, store,
detectors and replay as a job that writes its own telemetry). The log offset of each attempt is kept in
`telemetry-stdout.offsets.json` so a re-adopting daemon neither re-reads nor skips lines; should that file
be behind (its last write lost), the lines re-read yield no second record: the parser starts after the last
step this attempt already has in the output file. A record's `time` is the line's own timestamp or the time
the daemon read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ulyssesd.client.contract import encode_record
from ulyssesd.remediation.log_telemetry import LogTelemetryParser
from ulyssesd.training.durable import temp_path_for

STDOUT_TELEMETRY_NAME = "telemetry-stdout.jsonl"
OFFSETS_NAME = "telemetry-stdout.offsets.json"
MAX_READ_BYTES = 4 << 20  # bound one tick's work on a huge backlog
MAX_LINE_BYTES = 1 << 20  # a longer "line" (binary junk, a progress bar that never ends) is skipped
RESUME_TAIL_BYTES = 1 << 20  # how much of the output file's end is searched for the attempt's last step


def stdout_source(config: dict[str, Any]) -> bool:
    """Whether a job config asks for telemetry from the job's log."""
    tel = config.get("telemetry") or {}
    return isinstance(tel, dict) and tel.get("source") == "stdout"


class LogSource:
    """Tail one attempt's log into the run's stdout telemetry file."""

    def __init__(self, run_dir: Path, attempt: int, config_version: int | None = None):
        self.run_dir = Path(run_dir)
        self.attempt = attempt
        self.log_path = self.run_dir / "logs" / f"attempt-{attempt}.log"
        self.out_path = self.run_dir / STDOUT_TELEMETRY_NAME
        self.offset = self._load_offset()
        self.parser = LogTelemetryParser(attempt=attempt, config_version=config_version,
                                         after_step=self._last_emitted_step())
        self.skipped_long_lines = 0
        self._torn_tail = self._ends_mid_line()

    def _offsets_path(self) -> Path:
        return self.run_dir / OFFSETS_NAME

    def _load_offset(self) -> int:
        try:
            data = json.loads(self._offsets_path().read_text())
            return int(data.get(str(self.attempt), 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    def _last_emitted_step(self) -> int | None:
        """The last step record of this attempt in the output file (its end: the current attempt's records
        are the newest), None when there is none."""
        try:
            with open(self.out_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.out_path) - RESUME_TAIL_BYTES))
                tail = fh.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(tail):
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the first, cut line of the tail, or a torn last one
            if isinstance(rec, dict) and rec.get("kind") == "step" and rec.get("attempt") == self.attempt \
                    and isinstance(rec.get("step"), int):
                return rec["step"]
        return None

    def _ends_mid_line(self) -> bool:
        """Whether the output file ends in a torn record (an append cut short): the next append then starts
        on a new line, so that the fragment stays one bad line and does not swallow the next record."""
        try:
            with open(self.out_path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                return fh.read(1) != b"\n"
        except OSError:  # absent or empty
            return False

    def _save_offset(self) -> None:
        """Replace the offsets file whole: a per-process temp name (two writers, e.g. a daemon that has not
        yet noticed its successor, never write into one temp file and rename the other's half) + rename.

        No fsync, though this runs every tick that read lines: the offset only bounds how much is re-read.
        Should the rename or the write be lost (power loss), the file holds an older offset, the next
        daemon re-reads those lines and the parser drops them (it starts after this attempt's last step in
        the output file, see `_last_emitted_step`); only steps whose output append was lost with it are
        missing, which the telemetry reader and the detectors take as a gap, as after any restart."""
        path = self._offsets_path()
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[str(self.attempt)] = self.offset
        tmp = temp_path_for(path)
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def pump(self, now: float) -> int:
        """Parse the log lines written since the last call; returns how many records were appended."""
        try:
            size = os.path.getsize(self.log_path)
        except OSError:
            return 0
        if size < self.offset:  # the log was truncated or replaced: start over
            self.offset = 0
        if size == self.offset:
            return 0
        with open(self.log_path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read(MAX_READ_BYTES)
        end = chunk.rfind(b"\n")
        if end < 0:
            if len(chunk) >= MAX_LINE_BYTES:  # no newline in a huge chunk: skip it, do not stall
                self.offset += len(chunk)
                self.skipped_long_lines += 1
                self._save_offset()
            return 0
        lines = chunk[:end + 1].split(b"\n")
        records = []
        for raw in lines:
            if len(raw) > MAX_LINE_BYTES:
                self.skipped_long_lines += 1
                continue
            if raw:
                records.extend(self.parser.feed(raw.decode("utf-8", errors="replace"), now=now))
        if records:
            with open(self.out_path, "a", encoding="utf-8") as out:
                out.write(("\n" if self._torn_tail else "") + "".join(encode_record(r) + "\n" for r in records))
                out.flush()
            self._torn_tail = False
        self.offset += end + 1
        self._save_offset()
        return len(records)


def pump(sup: Any) -> None:
    """The supervisor's hook: keep a LogSource for the current attempt and pump it (no-op for other jobs)."""
    if not stdout_source(sup.config) or not sup.attempt:
        return
    src = getattr(sup, "_log_source", None)
    if src is None or src.attempt != sup.attempt or src.run_dir != sup.run_dir:
        src = LogSource(sup.run_dir, sup.attempt, sup.config_version)
        sup._log_source = src
    src.pump(sup.os.time())
