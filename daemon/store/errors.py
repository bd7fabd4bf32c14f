"""Errors the store raises; all derive from StoreError so callers can catch one type."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store error."""


class NoDatabaseError(StoreError):
    """Read-only open of a database file that does not exist (or has no schema) yet."""


class ReadOnlyStoreError(StoreError):
    """A write method was called on a store opened read-only."""


class SchemaMismatchError(StoreError):
    """The database's Alembic revision is not the one this code expects."""


class NotFoundError(StoreError, LookupError):
    """The run/incident/action/... asked for does not exist."""


class InvalidValueError(StoreError, ValueError):
    """A value (enum string, timestamp, ...) was rejected before reaching the database."""


class CorruptStoreError(StoreError):
    """The database file is damaged, truncated, emptied or not an SQLite database at all."""


class StoreBusyError(StoreError):
    """The database stayed locked past the busy timeout (another process holds an exclusive lock)."""


class StorePermissionError(StoreError, PermissionError):
    """This uid may not read the database (or create the -shm file SQLite needs next to it)."""


_CORRUPT = ("file is not a database", "malformed", "database corrupt", "disk image", "not an sqlite")
_BUSY = ("database is locked", "database is busy", "database table is locked")
_PERM = ("unable to open database file", "readonly database", "attempt to write a readonly", "permission denied",
         "access permission denied")
_SCHEMA = ("no such table", "no such column")


def classify(exc: BaseException, path: object = None) -> StoreError | None:
    """The StoreError an sqlite3/SQLAlchemy/OS error stands for, with a one-line message naming `path`
    and what to do; None when `exc` is not a store problem (a bug: let it surface)."""
    if isinstance(exc, StoreError):
        return exc
    where = f"database at {path}" if path is not None else "database"
    if isinstance(exc, PermissionError):
        return StorePermissionError(f"{where}: permission denied ({exc.strerror or exc}); read it as the service "
                                    f"user or a member of its group (the file is 0640, its directory 0750)")
    orig = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the DBAPI error
    text = str(orig).splitlines()[0].strip().lower() if str(orig) else type(orig).__name__.lower()
    mod = type(orig).__module__
    if not (mod.startswith("sqlite3") or mod.startswith("sqlalchemy") or isinstance(orig, OSError)):
        return None
    if any(k in text for k in _CORRUPT):
        return CorruptStoreError(f"{where} is damaged ({text}); the daemon restores its newest backup at start "
                                 f"(state dir backups/); `sqlite3 FILE 'PRAGMA integrity_check'` shows the damage")
    if any(k in text for k in _BUSY):
        return StoreBusyError(f"{where} is locked by another process ({text}); retry in a moment")
    if any(k in text for k in _PERM):
        return StorePermissionError(f"{where}: cannot open it ({text}); check read access to the file and write "
                                    f"access to its directory (SQLite creates a -shm file beside a WAL database)")
    if any(k in text for k in _SCHEMA):
        return SchemaMismatchError(f"{where} does not have this code's schema ({text}): run `ulyssesctl db upgrade`")
    return None
