"""`open_store`: the one way to get a Store (writer for the daemon, read-only for ulyssesctl)."""

from __future__ import annotations

from pathlib import Path

from ulyssesd.daemon.clock import SYSTEM, Clock

from .engine import make_engine
from .errors import CorruptStoreError, NoDatabaseError, SchemaMismatchError, classify
from .migrate import current_revision, head_revision, known_revisions, upgrade_to_head
from .repository.store import Store


def open_store(db_path: str | Path, readonly: bool = False, *, migrate: bool = True, clock: Clock = SYSTEM) -> Store:
    """Open the store at `db_path`.

    Writer (daemon): creates the file if needed and, with `migrate`, upgrades it to head first.
    Read-only (ulyssesctl): the file must exist and be at this code's head revision; works while the
    daemon writes (WAL) and while it is down. Errors name the path and what to do. `clock` stamps its rows (the
    daemon's clock seam: `ulyssesd simulate` passes the simulated one).
    """
    path = Path(db_path).expanduser().resolve()
    try:
        if readonly:
            if not path.exists():
                raise NoDatabaseError(f"no database at {path} — has ulyssesd run?")
            _check_file(path)
        elif migrate:
            upgrade_to_head(path)
        rev, head = current_revision(path), head_revision()
    except Exception as exc:
        err = classify(exc, path)
        if err is None:
            raise
        raise err from exc
    if rev is None:
        raise NoDatabaseError(f"database at {path} has no schema yet — has ulyssesd run? "
                              f"(or run `ulyssesctl db upgrade`)")
    if rev != head:
        if rev in known_revisions():
            hint = "run `ulyssesctl db upgrade` (or start ulyssesd, which upgrades at start)"
        else:
            hint = "it was written by a newer ulyssesd; upgrade this installation"
        raise SchemaMismatchError(f"database at {path} is at revision {rev}, this code expects {head}: {hint}")
    return Store(make_engine(path, readonly=readonly), path, readonly=readonly, clock=clock)


def _check_file(path: Path) -> None:
    """Cheap checks before SQLite sees the file (readers): its header, and an emptied file beside backups."""
    with path.open("rb") as fh:  # PermissionError -> StorePermissionError (classify)
        header = fh.read(16)
    if not header:
        if any((path.parent / "backups").glob("ulyssesd-*.db")):
            raise CorruptStoreError(f"database at {path} is empty (0 bytes) although backups exist: it was emptied; "
                                    f"the daemon restores its newest backup at start")
        return  # a brand-new file: "no schema yet" below
    if header != b"SQLite format 3\x00":
        raise CorruptStoreError(f"{path} is not an SQLite database (first bytes {header!r}); the daemon restores "
                                f"its newest backup at start (state dir backups/)")
