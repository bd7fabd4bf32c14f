"""Open only regular files among those a job or a user controls (its telemetry file, logs, stack dumps,
checkpoint directory): a FIFO, a device or a socket put at such a path would block `open()` or `read()` for ever
and wedge the daemon or `ulyssesctl`. The open itself never blocks (O_NONBLOCK), and a path that is not a regular
file raises `NotRegularFile`, an `OSError`, so every caller's existing "unreadable" path reports it."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Any


class NotRegularFile(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a socket, a directory): it is not read."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """`open(path, mode)` for reading, without blocking, of a regular file only; anything else raises
    `NotRegularFile` naming what it is (its `strerror` reads "is a FIFO, not a regular file; not read")."""
    if any(c in mode for c in "wax+"):
        raise ValueError(f"open_regular reads only; mode {mode!r} writes")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise NotRegularFile(errno.EINVAL, f"is {_kind(st_mode)}, not a regular file; not read", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | os.PathLike[str]) -> bytes:
    """`Path(path).read_bytes()` of a regular file only (`NotRegularFile` otherwise)."""
    with open_regular(path, "rb") as fh:
        return fh.read()


def read_regular_text(path: str | os.PathLike[str], errors: str = "strict") -> str:
    """`Path(path).read_text()` (UTF-8) of a regular file only (`NotRegularFile` otherwise)."""
    with open_regular(path, "r", encoding="utf-8", errors=errors) as fh:
        return fh.read()


def is_regular(path: Path) -> bool:
    """Whether `path` is a regular file (following links); False for anything else or when it cannot be stat'ed."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (OSError, ValueError):
        return False


def set_aside_if_not_regular(path: Path, now: float) -> tuple[bool, str | None]:
    """Make `path` usable as a file the daemon itself appends to (its derived telemetry): when something that is
    no regular file sits there (a directory a bad restore script made, a FIFO), it is renamed aside to
    `<name>.not-a-file-<time>` (nothing is deleted) so the file can be created again. Returns (usable, what to
    say): (True, None) when the path is absent or a regular file; (False, why) when it could not be set aside."""
    try:
        st_mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return True, None
    except OSError as exc:
        return False, f"{path} cannot be stat'ed ({type(exc).__name__}: {exc})"
    if stat.S_ISREG(st_mode):
        return True, None
    aside = path.with_name(f"{path.name}.not-a-file-{int(now)}")
    try:
        os.rename(path, aside)
    except OSError as exc:
        return False, (f"{path} is {_kind(st_mode)}, not a regular file, and could not be moved aside "
                       f"({type(exc).__name__}: {exc}): remove it; nothing is written there until then")
    return True, f"{path} was {_kind(st_mode)}, not a regular file: moved aside to {aside.name} and created again"
