"""Programmatic Alembic: upgrade/downgrade/current without alembic.ini and without touching logging.

The daemon calls `upgrade_to_head` at start (via `open_store`); operators use `ulyssesctl db upgrade|current`.
Migrations run with foreign_keys=OFF (SQLite batch mode drops and recreates tables; with FKs on, the drop
would cascade into child tables) and end with `PRAGMA foreign_key_check`, which must come back empty.
"""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from ulyssesd.migrations import SCRIPT_LOCATION

from .engine import make_engine
from .errors import StoreError


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic Config built in code; `connection` is handed to env.py."""
    cfg = Config()  # no ini file: nothing for fileConfig to read
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head_revision() -> str:
    """The newest revision shipped with this code (fixed for the process: read the scripts once)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships revisions
        raise StoreError(f"no Alembic revisions under {SCRIPT_LOCATION}")
    return head


@functools.cache
def known_revisions() -> frozenset[str]:
    """Every revision id shipped with this code (fixed for the process)."""
    return frozenset(s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions())


def _run(db_path: str | Path, fn, *args) -> None:
    engine = make_engine(db_path, foreign_keys=False)
    try:
        with engine.connect() as conn:
            fn(alembic_config(conn), *args)
            conn.commit()
        with engine.connect() as conn:
            bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if bad:
                raise StoreError(f"foreign key violations after migrating {db_path}: {bad[:10]}")
    finally:
        engine.dispose()


def current_revision(db_path: str | Path) -> str | None:
    """The database's revision (None for an empty/unversioned DB). Read-only; the DB must exist."""
    engine = make_engine(db_path, readonly=True)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def upgrade(db_path: str | Path, revision: str = "head") -> str | None:
    """Upgrade (creating the file if needed) to `revision`; returns the revision now current."""
    _run(db_path, command.upgrade, revision)
    return current_revision(db_path)


def upgrade_to_head(db_path: str | Path) -> str:
    """Bring the DB to head; a no-op when already there. Returns the head revision."""
    rev = upgrade(db_path, "head")
    assert rev is not None
    return rev


def downgrade(db_path: str | Path, revision: str) -> str | None:
    """Downgrade to `revision` ("base" = empty schema); returns the revision now current."""
    _run(db_path, command.downgrade, revision)
    return current_revision(db_path)
