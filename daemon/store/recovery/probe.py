"""Is a database file sound? The integrity probe at start and the cheap per-tick header check."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ulyssesd.daemon.clock import SYSTEM

#: Wall-clock bound of the integrity probe at start (a quick_check of a few MB takes milliseconds).
PROBE_BUDGET_S = 30.0
SQLITE_HEADER = b"SQLite format 3\x00"


def header_bytes_problem(header: bytes, size: int) -> str | None:
    """What the first 100 bytes and the size say is wrong (emptied, not SQLite, truncated), or None."""
    if size == 0:
        return "the database file is empty (0 bytes): it was emptied or truncated"
    if not header.startswith(SQLITE_HEADER):
        return f"not an SQLite database (first bytes {header[:16]!r})"
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    if len(header) < 100 or page < 512 or size % page:
        return f"truncated: {size} bytes is not a whole number of {page}-byte pages"
    return None


def probe_db_file(path: str | os.PathLike[str], budget_s: float = PROBE_BUDGET_S) -> str | None:
    """None if `path` is missing or a readable SQLite database that passes `PRAGMA quick_check` within
    `budget_s`; otherwise what is wrong, in words. Opens the file like the daemon will (read-write: a
    hot WAL left by a crash is recovered, as any open would)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            header = fh.read(100)
    except FileNotFoundError:
        return None
    bad = header_bytes_problem(header, size)
    if bad is not None:
        return bad
    deadline = SYSTEM.monotonic() + budget_s
    try:
        conn = sqlite3.connect(str(p), timeout=5.0)
    except sqlite3.Error as exc:
        return f"cannot open: {exc}"
    try:
        conn.set_progress_handler(lambda: SYSTEM.monotonic() > deadline, 10_000)
        rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
        if rows != ["ok"]:
            return f"quick_check found damage: {'; '.join(rows[:5])}"
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            # Not proof of damage: a huge file on a slow disk. Say so and carry on (maintenance re-checks).
            return None
        return f"{exc}"
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        return f"{exc}"
    finally:
        conn.close()
    return None



def header_problem(path: str | os.PathLike[str]) -> str | None:
    """The cheap per-tick check (one 100-byte read): None while the file still looks like an SQLite
    database; else what is wrong (emptied, overwritten header, not a whole number of pages)."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(100)
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        return None  # file_problem() reports a missing file
    except OSError as exc:
        return f"unreadable: {exc}"
    bad = header_bytes_problem(header, size)
    return None if bad is None else f"under the running daemon: {bad}"

