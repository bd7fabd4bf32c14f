"""SQLite engines for the store: a WAL writer (the daemon) and read-only readers (ulyssesctl).

Why each setting:
- WAL: readers never block the writer and vice versa; `ulyssesctl` can read while the daemon writes.
- synchronous=NORMAL: in WAL mode a committed transaction survives a process crash (SIGKILL); only an
  OS crash/power loss may drop the last few commits — the database stays consistent either way.
- busy_timeout: a connection waits (bounded) for a lock instead of failing with `database is locked`.
- BEGIN IMMEDIATE for writers: take the write lock at the start of a transaction, so a read→write upgrade
  can never fail with SQLITE_BUSY (which busy_timeout does not retry).
- foreign_keys=ON for normal use; OFF while migrating (batch migrations drop/recreate tables, which with
  FKs on would cascade-delete child rows) followed by `PRAGMA foreign_key_check`.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event, pool

from .errors import NoDatabaseError
from .permissions import private_dir, private_file, tighten

BUSY_TIMEOUT_MS = 5000


def _json_default(obj: Any) -> Any:
    item = getattr(obj, "item", None)  # numpy scalar
    if callable(item):
        return item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def _json_dumps(obj: Any) -> str:
    return json.dumps(obj, default=_json_default)


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        uri = f"file:{quote(str(path))}?mode=ro"
        # An operator in the ulyssesd group who cannot write the state dir cannot create the -shm file
        # SQLite needs for a WAL database once the daemon has shut down cleanly (no -wal/-shm left):
        # then no writer exists, so opening the file as immutable is safe and is the only way to read it.
        wal = path.with_name(path.name + "-wal")
        if not wal.exists() and not os.access(path.parent, os.W_OK):
            uri += "&immutable=1"
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    else:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    # We emit BEGIN ourselves (see module doc); stop sqlite3's implicit transaction handling.
    conn.isolation_level = None
    return conn


def make_engine(db_path: str | Path, *, readonly: bool = False, foreign_keys: bool = True) -> Engine:
    """Engine with our pragmas. Writer mode creates the file (and parent dir); read-only requires it."""
    path = Path(db_path).expanduser().resolve()
    if readonly:
        if not path.exists():
            raise NoDatabaseError(f"no database at {path} — has ulyssesd run?")
    else:
        # Our modes, not the umask's: the file exists (0640) before SQLite opens it, and SQLite gives its
        # -wal/-shm files the database file's mode.
        private_dir(path.parent)
        if not path.exists():
            private_file(path)
        tighten(path)

    engine = create_engine(
        "sqlite+pysqlite://",
        creator=lambda: _connect(path, readonly),
        # The URL is in-memory style (we connect through `creator`), so pick the file-DB pool explicitly.
        poolclass=pool.QueuePool,
        pool_size=2,
        max_overflow=2,
        pool_pre_ping=False,
        # Evidence may carry numpy scalars / paths; store them as plain JSON values rather than fail.
        json_serializer=_json_dumps,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cur.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
            if not readonly:
                # journal_mode is persistent in the file; setting it needs write access.
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute("PRAGMA synchronous = NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Reads (execution option `ulyssesd_read`) take no write lock; writes take it up front.
        deferred = readonly or conn.get_execution_options().get("ulyssesd_read", False)
        conn.exec_driver_sql("BEGIN" if deferred else "BEGIN IMMEDIATE")

    return engine
