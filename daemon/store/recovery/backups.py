"""Backups of the store: written online (atomic, quick-checked, durable), listed, restored; a damaged file
moved aside for a human."""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.training.durable import durable_replace, fsync_dir

from ..errors import StoreError
from ..permissions import private_dir, private_file, tighten
from .probe import probe_db_file

if TYPE_CHECKING:
    from ..repository.store import Store

BACKUP_DIR_NAME = "backups"
BACKUP_GLOB = "ulyssesd-*.db"


def stamp() -> str:
    """UTC time to the millisecond, as it goes into backup and set-aside file names (sorts by time)."""
    t = SYSTEM.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def list_backups(backups_dir: Path) -> list[Path]:
    """Backups, newest first (the names sort by time)."""
    return sorted(backups_dir.glob(BACKUP_GLOB), reverse=True) if backups_dir.is_dir() else []


def _copy_db(src: Path, dest: Path) -> None:
    """SQLite-level copy of `src` into the new file `dest` (mode 0640), left in rollback-journal mode so
    the copy is one self-contained file (the daemon's engine turns WAL back on)."""
    private_file(dest)
    s = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    try:
        d = sqlite3.connect(str(dest))
        try:
            s.backup(d)
            d.execute("PRAGMA journal_mode = DELETE")
        finally:
            d.close()
    finally:
        s.close()


def write_backup(store: Store, backups_dir: str | os.PathLike[str], keep: int = 4) -> Path:
    """Online backup of `store` into `backups_dir` (atomic rename; a copy that fails quick_check is
    discarded and raises StoreError); keeps the newest `keep`. Returns the new backup's path."""
    bdir = private_dir(backups_dir)
    final = bdir / f"ulyssesd-{stamp()}.db"
    tmp = bdir / f".{final.name}.tmp"
    try:
        store.backup_into(tmp)
        c = sqlite3.connect(str(tmp))
        try:
            c.execute("PRAGMA journal_mode = DELETE")
        finally:
            c.close()
        problem = probe_db_file(tmp)
        if problem is not None:
            raise StoreError(f"backup copy {tmp} is not sound ({problem}); the previous backups are kept")
        durable_replace(tmp, final)
        tighten(final)
    finally:
        tmp.unlink(missing_ok=True)
    for old in list_backups(bdir)[max(1, keep):]:
        old.unlink(missing_ok=True)
    for stale in bdir.glob(".ulyssesd-*.tmp"):  # left by a daemon killed mid-backup
        stale.unlink(missing_ok=True)
    return final


@dataclass
class Restore:
    """What `restore_newest_backup` did."""

    problem: str
    damaged_kept_as: list[str]
    backup: str | None = None
    backup_taken: str | None = None
    skipped_backups: list[str] = field(default_factory=list)


def restore_newest_backup(db_path: Path, backups_dir: Path, problem: str) -> Restore:
    """Move the damaged database aside and put the newest sound backup in its place (none: no file)."""
    out = Restore(problem=problem, damaged_kept_as=move_aside(db_path, "damaged"))
    for b in list_backups(backups_dir):
        why = probe_db_file(b)
        if why is not None:
            out.skipped_backups.append(f"{b.name}: {why}")
            continue
        tmp = db_path.with_name(f".{db_path.name}.restore.tmp")
        tmp.unlink(missing_ok=True)
        _copy_db(b, tmp)
        os.replace(tmp, db_path)
        fsync_dir(db_path.parent)
        out.backup = str(b)
        out.backup_taken = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(b.stat().st_mtime))
        break
    return out



def move_aside(db: Path, what: str) -> list[str]:
    """Rename the database and its -wal/-shm to `{db}.{what}-STAMP*` (kept for a human); the new names."""
    when = stamp()
    kept = []
    for suffix in ("", "-wal", "-shm"):
        f = Path(f"{db}{suffix}")
        if f.exists():
            aside = Path(f"{db}.{what}-{when}{suffix}")
            os.replace(f, aside)
            kept.append(str(aside))
    return kept
