"""Durable file writes of the training side: the one place that knows how a file replaces another safely.

A reader (the daemon, a resuming job, `ulyssesctl`) sees either the old file or the complete new one, even
after a crash or power loss: write a hidden temp file next to the target, fsync it, rename it over the
target, then fsync the directory so the rename itself is on disk. Stdlib only (the checkpoint helpers that
use it are imported without torch).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def fsync_dir(path: str | Path) -> None:
    """Make a rename or unlink inside `path` durable. Best effort: some filesystems refuse to open or fsync a
    directory, and the rename is still atomic there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    """The hidden, per-process temp name a write of `path` goes through (same directory: same filesystem)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    """`write(binary file)` into a hidden temp file, fsync, rename over `path`, fsync the directory.
    On any failure the temp file is removed and `path` is left as it was."""
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda fh: fh.write(text.encode("utf-8")))


def durable_replace(tmp: str | Path, final: str | Path) -> None:
    """Publish a temp file that was streamed elsewhere (closed by its writer): fsync it, rename it over
    `final`, fsync the directory."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)
