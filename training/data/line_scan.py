"""Streaming checks of a text input's lines for ulysses-preprocess: a line's ends found and its length bounded
without ever holding the line (a 200 MB JSONL line took 22 GB of RSS when read whole), and byte offsets turned
into line numbers for the error that names them; and the workers' tie to their parent process."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

_SCAN = 1 << 20  # bytes read at a time while looking for a line's end


class PreprocessError(ValueError):
    """Bad input (unreadable, malformed JSON, empty document, missing key) or bad options."""


def line_end(fh: Any, pos: int, size: int, max_line: int, path: Path) -> int:
    """The offset just past the end of the line that holds byte `pos` (its newline, else EOF), reading
    `_SCAN` bytes at a time; PreprocessError when more than `max_line` bytes pass without a newline."""
    fh.seek(pos)
    at = pos
    while at < size:
        block = fh.read(min(_SCAN, size - at))
        nl = block.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(block)
        if at - pos > max_line:
            _too_long(fh, path, _line_start(fh, pos), max_line)
    return size


def _too_long(fh: Any, path: Path, line_start: int, max_line: int) -> None:
    raise PreprocessError(f"{path}:{line_number(str(path), line_start)}: a line longer than {max_line} bytes "
                          f"(--max-document-mb {max_line / (1 << 20):g}); split the document or raise "
                          f"--max-document-mb (tokenizing needs about 100x its size in memory)")


def _line_start(fh: Any, pos: int) -> int:
    """The offset of the start of the line holding byte `pos` (scanning backwards in blocks)."""
    while pos > 0:
        back = max(0, pos - _SCAN)
        fh.seek(back)
        nl = fh.read(pos - back).rfind(b"\n")
        if nl >= 0:
            return back + nl + 1
        pos = back
    return 0


def check_lines(fh: Any, start: int, end: int, max_line: int, path: Path) -> None:
    """PreprocessError naming the first line in [start, end) longer than max_line bytes (its newline not
    counted); streaming, `_SCAN` bytes at a time."""
    fh.seek(start)
    pos = line_start = start
    while pos < end:
        block = fh.read(min(_SCAN, end - pos))
        if not block:
            break
        first = block.find(b"\n")
        if first < 0:
            pos += len(block)
            if pos - line_start > max_line:
                _too_long(fh, path, line_start, max_line)
            continue
        if pos + first - line_start > max_line:
            _too_long(fh, path, line_start, max_line)
        if max_line < len(block):  # lines wholly inside the block may be too long too (a small bound)
            prev = first
            nxt = block.find(b"\n", prev + 1)
            while nxt >= 0:
                if nxt - prev - 1 > max_line:
                    _too_long(fh, path, pos + prev + 1, max_line)
                prev, nxt = nxt, block.find(b"\n", nxt + 1)
        line_start = pos + block.rfind(b"\n") + 1
        pos += len(block)
    if end - line_start > max_line:
        _too_long(fh, path, line_start, max_line)


def line_number(path: str, byte_offset: int) -> int:
    count = 0
    with open(path, "rb") as fh:
        left = byte_offset
        while left > 0:
            block = fh.read(min(_SCAN, left))
            if not block:
                break
            count += block.count(b"\n")
            left -= len(block)
    return count + 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG), so a SIGKILLed
    preprocess leaves no worker running; exit now if the parent is already gone (it died before the call).
    Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:
            os._exit(1)
