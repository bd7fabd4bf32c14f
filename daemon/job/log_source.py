"""`[telemetry] source = "stdout"`: telemetry for a job that only prints logs.

Each tick, before the telemetry reader runs, the attempt's log (`{run_dir}/logs/attempt-{N}.log`, which the
daemon already captures) is read from where the last tick stopped; complete lines go through the log parsers
(`ulyssesd.remediation.log_telemetry`) and the records they yield are appended to
`{run_dir}/telemetry-stdout.jsonl`, which the ordinary telemetry reader then tails (same cursor, store,
detectors and replay as a job that writes its own telemetry). The log offset of each attempt is kept in
`telemetry-stdout.offsets.json` so a re-adopting daemon neither re-reads nor skips lines.
A record's `time` is the line's own timestamp or the time the daemon read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ulyssesd.client.contract import encode_record
from ulyssesd.remediation.log_telemetry import LogTelemetryParser

STDOUT_TELEMETRY_NAME = "telemetry-stdout.jsonl"
OFFSETS_NAME = "telemetry-stdout.offsets.json"
MAX_READ_BYTES = 4 << 20  # bound one tick's work on a huge backlog
MAX_LINE_BYTES = 1 << 20  # a longer "line" (binary junk, a progress bar that never ends) is skipped


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
        self.parser = LogTelemetryParser(attempt=attempt, config_version=config_version)
        self.offset = self._load_offset()
        self.skipped_long_lines = 0

    def _offsets_path(self) -> Path:
        return self.run_dir / OFFSETS_NAME

    def _load_offset(self) -> int:
        try:
            data = json.loads(self._offsets_path().read_text())
            return int(data.get(str(self.attempt), 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    def _save_offset(self) -> None:
        path = self._offsets_path()
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[str(self.attempt)] = self.offset
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

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
                out.write("".join(encode_record(r) + "\n" for r in records))
                out.flush()
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
