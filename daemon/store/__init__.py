"""The incident store: SQLAlchemy models, Alembic migrations, repository API over SQLite (WAL).

Public API (imported lazily so `ulyssesd.daemon.store.enums` stays cheap — no SQLAlchemy import)::

    from ulyssesd.daemon.store import open_store, Store, StoreError, NoDatabaseError
    store = open_store(db_path)                  # daemon: upgrades to head, WAL writer
    store = open_store(db_path, readonly=True)   # ulyssesctl: read-only, works while the daemon writes
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "open_store": "opener",
    "Store": "repository.store",
    "flat_diff": "repository.incidents",
    "upgrade_to_head": "migrate",
    "current_revision": "migrate",
    "head_revision": "migrate",
    "downgrade": "migrate",
    "db_upgrade": "cli",
    "db_current": "cli",
    "db_status": "cli",
    "StoreError": "errors",
    "NoDatabaseError": "errors",
    "ReadOnlyStoreError": "errors",
    "SchemaMismatchError": "errors",
    "NotFoundError": "errors",
    "InvalidValueError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
