"""What the daemon calls: `open_daemon_store` at start (probe, restore, re-derive, record), and mid-run
`mend_replaced_file` (deleted or replaced under the open store) and `mend_damaged_file` (damaged in place)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ulyssesd.training.durable import fsync_dir

from ..enums import TERMINAL_RUN_STATES
from ..errors import NotFoundError
from ..migrate import upgrade_to_head
from ..opener import open_store
from ..permissions import tighten
from .adopt import adopt_run_dir, record_recovery, settle_adopted_state
from .backups import BACKUP_DIR_NAME, Restore, list_backups, move_aside, restore_newest_backup, stamp
from .probe import header_problem, probe_db_file
from .rederive import rederive_run

if TYPE_CHECKING:
    from ..repository.store import Store


@dataclass
class OpenedStore:
    """What `open_daemon_store` opened, what it restored (None: the file was sound), the incidents it recorded."""

    store: Store
    restore: Restore | None
    incidents: list[int]


def open_daemon_store(db_path: str | os.PathLike[str], state_dir: str | os.PathLike[str], *,
                      spec_source: str | None = None, say: Any = None) -> OpenedStore:
    """The daemon's `open_store`: probe the file, restore the newest sound backup if it is damaged,
    re-derive every unfinished run from its directory, record what was recovered."""
    say = say or (lambda msg: None)
    db = Path(db_path).expanduser().resolve()
    state = Path(state_dir)
    problem = probe_db_file(db)
    if problem is None and not db.exists() and list_backups(state / BACKUP_DIR_NAME):
        problem = "the database file is missing although backups exist (deleted while no daemon ran?)"
    restore = None
    if problem is not None:
        restore = restore_newest_backup(db, state / BACKUP_DIR_NAME, problem)
        say(f"WARNING: database {db} is damaged ({problem}); kept as {', '.join(restore.damaged_kept_as)}; "
            + (f"restored backup {restore.backup} (taken {restore.backup_taken})" if restore.backup
               else "no sound backup: starting an empty database"))
    store = open_store(db)
    incidents: list[int] = []
    if restore is None:
        return OpenedStore(store, None, incidents)
    if restore.backup is None:
        # Nothing sound to start from: an empty store. Run directories are NOT adopted behind the operator's
        # back; creating a run is refused until they are re-adopted (--run-id) or archived (UnknownRunDirs).
        return OpenedStore(store, restore, incidents)
    runs_root = state / "runs"
    for run_dir in sorted(p for p in runs_root.iterdir() if p.is_dir()) if runs_root.is_dir() else []:
        try:
            run = store.get_run(run_dir.name)
        except NotFoundError:
            same_spec = spec_source is not None and _same_bytes(run_dir / "spec.toml", Path(spec_source))
            run = adopt_run_dir(store, run_dir, run_dir.name,
                                spec_path=str(Path(spec_source).resolve()) if spec_source and same_spec else None)
        if run.state in TERMINAL_RUN_STATES:
            continue
        what = rederive_run(store, run.id, Path(run.run_dir or run_dir))
        settle_adopted_state(store, run, what)
        what.update(restore.__dict__)
        summary = (f"database damaged ({problem}); "
                   + (f"restored backup {Path(restore.backup).name} taken {restore.backup_taken}"
                      if restore.backup else "no sound backup, run re-created from its directory")
                   + f"; re-derived from {run.run_dir}: {len(what['config_versions'])} config version(s), "
                   f"{len(what['checkpoints'])} checkpoint(s), {len(what['attempts'])} attempt(s), telemetry "
                   f"cursor {'at step ' + str(what['last_step']) if what['telemetry_cursor'] else 'unchanged'}; "
                   "incidents and actions recorded after the backup are not in the store (telemetry.jsonl and "
                   "the attempt logs still hold them)")
        incidents.append(record_recovery(store, run.id, what, summary))
        say(f"store recovery for run {run.id}: {summary}")
    return OpenedStore(store, restore, incidents)


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def mend_replaced_file(store: Store) -> str | None:
    """Mid-run: the database file was deleted or replaced under the open store. Copy the open
    connection's (complete) database to a new file at the path, reconnect, return what happened;
    None when the file is fine. A foreign file found at the path is moved aside, not overwritten."""
    problem = store.file_problem()
    if problem is None:
        return None
    db = Path(store.path)
    tmp = db.with_name(f".{db.name}.recreate.tmp")
    tmp.unlink(missing_ok=True)
    store.backup_into(tmp)
    if db.exists():
        os.replace(db, Path(f"{db}.foreign-{stamp()}"))
    # Closing the old connections checkpoints into the deleted inode and removes the -wal/-shm names;
    # only then may the new file take the path (a leftover -wal must never be applied to it).
    store.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, db)
    tighten(db)
    fsync_dir(db.parent)
    store.rebind()
    return problem


def mend_damaged_file(store: Store, state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Mid-run: the open database's file was damaged (header_problem). First try the open connection
    (its WAL and cache may still hold a sound database: nothing lost); if its copy is not sound, restore
    the newest sound backup. The damaged file is moved aside either way; the store is reconnected.
    Returns {problem, recovered_from, damaged_kept_as, lost_since} or None when the file is fine."""
    problem = header_problem(store.path)
    if problem is None:
        return None
    db = Path(store.path)
    tmp = db.with_name(f".{db.name}.salvage.tmp")
    tmp.unlink(missing_ok=True)
    try:
        store.backup_into(tmp)
        salvaged = probe_db_file(tmp) is None
    except Exception:  # noqa: BLE001 - the open connection cannot read it either: use a backup
        salvaged = False
    try:
        store.close()
    except Exception:  # noqa: BLE001 - closing a damaged database may fail; its file is set aside anyway
        pass
    if salvaged:
        kept = move_aside(db, "damaged")
        os.replace(tmp, db)
        tighten(db)
        fsync_dir(db.parent)
        out = {"problem": problem, "recovered_from": "the daemon's open connection", "damaged_kept_as": kept,
               "lost_since": None}
    else:
        tmp.unlink(missing_ok=True)
        r = restore_newest_backup(db, Path(state_dir) / BACKUP_DIR_NAME, problem)
        out = {"problem": problem, "recovered_from": r.backup or "nothing (no sound backup: empty database)",
               "damaged_kept_as": r.damaged_kept_as, "lost_since": r.backup_taken,
               "skipped_backups": r.skipped_backups}
        if r.backup is None:
            upgrade_to_head(db)
    store.rebind()
    return out
