"""The database file itself: its identity, online backup, reconnect, integrity check and WAL checkpoint."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ulyssesd.daemon.clock import SYSTEM

from ..engine import BUSY_TIMEOUT_MS, make_engine
from ..permissions import private_file
from ..records import MaintenanceResult
from .base import StoreBase, file_id_of

CHECKPOINT_BUSY_MS = 1000


class UpkeepRepository(StoreBase):
    """The file under the tables: is it still ours, copy it while writing, reconnect, check, checkpoint."""

    # -- file identity, online backup ------------------------------------------------------------------
    def file_problem(self) -> str | None:
        """None while `path` is still the file this store writes; else what happened to it (one stat)."""
        now = file_id_of(self.path)
        if now is None:
            return f"database file {self.path} was deleted while the daemon had it open"
        if now != self.file_id:
            return f"database file {self.path} was replaced by another file (inode {self.file_id} -> {now})"
        return None

    def backup_into(self, dest: str | Path, *, pages_per_step: int = 256) -> None:
        """Online copy of the whole database into `dest` (a new file, mode 0640) with SQLite's backup API.

        Consistent while the daemon writes (the copy restarts if a write lands mid-copy, which with a few
        MB and 256-page steps finishes in milliseconds). Works on a store whose file was deleted: the open
        connection still reads the old inode, which is how `recovery.mend_replaced_file` saves its history.
        """
        dest = Path(dest)
        private_file(dest)
        raw = self._engine.raw_connection()
        try:
            target = sqlite3.connect(str(dest))
            try:
                raw.driver_connection.backup(target, pages=pages_per_step)  # type: ignore[union-attr]
            finally:
                target.close()
        finally:
            raw.close()

    def rebind(self) -> None:
        """Reconnect to `path` (after the file was re-created there): new engine, new file identity."""
        old = self._engine
        old.dispose()
        self._bind(make_engine(self.path, readonly=self.readonly))

    # -- maintenance -------------------------------------------------------------------------------------
    def maintenance(self, *, quick: bool = False) -> MaintenanceResult:
        """`PRAGMA integrity_check` (or quick_check) + `wal_checkpoint(TRUNCATE)`; for the scheduler.

        Runs outside any transaction on a raw connection (checkpointing inside a transaction is an error).
        A reader holding an old snapshot makes the checkpoint give up after ~1 s with `wal_busy=1`
        (retried next time) rather than stall the daemon's writes. In read-only mode only the integrity
        check runs.
        """
        t0 = SYSTEM.monotonic()
        wal = Path(f"{self.path}-wal")
        wal_before = wal.stat().st_size if wal.exists() else 0
        raw = self._engine.raw_connection()
        try:
            cur = raw.cursor()
            rows = cur.execute("PRAGMA quick_check" if quick else "PRAGMA integrity_check").fetchall()
            integrity = [str(r[0]) for r in rows]
            busy = frames = done = 0
            if not self.readonly:
                # A TRUNCATE checkpoint blocks new writers while it waits for readers; wait at most
                # CHECKPOINT_BUSY_MS (well under the writers' busy_timeout) and report busy instead.
                cur.execute(f"PRAGMA busy_timeout = {CHECKPOINT_BUSY_MS}")
                try:
                    busy, frames, done = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                finally:
                    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cur.close()
        finally:
            raw.close()
        return MaintenanceResult(
            ok=integrity == ["ok"], integrity=integrity, wal_busy=int(busy), wal_frames=int(frames),
            wal_checkpointed=int(done), db_bytes=os.path.getsize(self.path),
            wal_bytes_before=wal_before, wal_bytes_after=wal.stat().st_size if wal.exists() else 0, seconds=round(SYSTEM.monotonic() - t0, 4),
        )
