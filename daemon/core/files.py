"""Tolerant reads of the files a job leaves behind (its log, stack dumps): a missing file reads as empty."""

from __future__ import annotations

import os
from pathlib import Path

from ulyssesd.daemon.safety.regular_file import open_regular

LOG_TAIL_BYTES = 64 * 1024


def _read_tail(path: Path, nbytes: int = LOG_TAIL_BYTES, start: int | None = None) -> str:
    try:
        with open_regular(path, "rb") as fh:
            if start is not None:
                fh.seek(start)
                return fh.read(nbytes).decode("utf-8", errors="replace")
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
