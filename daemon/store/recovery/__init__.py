"""A store that survives damage: integrity probe at start, online backups, restore, re-derivation.

The database is the daemon's memory of a run, but not the primary record of the training: each run
directory holds its telemetry (`telemetry.jsonl`), its checkpoints (each with a manifest), its config
versions (`configs/vN.json`), its attempts' logs and exit files. So when the database is damaged
(random bytes, truncated, emptied to 0 bytes) the daemon, at start:

1. moves the damaged file (and its -wal/-shm) aside as `ulyssesd.db.damaged-STAMP*` (kept for a human);
2. copies the newest backup that passes `PRAGMA quick_check` into place (SQLite backup API);
3. re-derives, for every unfinished run, what the run directory holds and the backup may lack: config
   versions, checkpoints (from their manifests), attempts (logs, exit files, a live job found by its
   environment marker) and the telemetry cursor (end of the last complete line, so steps processed
   after the backup are not acted upon twice);
4. records a `store_damaged` incident per run saying what was restored and what was re-derived.

Mid-run, a database file deleted or replaced under the daemon (`Store.file_problem()`, one stat per
tick) is re-created from the still-open connection (nothing lost) before anything else is written.

Backups: `{state_dir}/backups/ulyssesd-STAMP.db`, written with the backup API into a temp file,
quick-checked, fsynced, renamed (atomic), mode 0640, the newest `keep` kept.
One concern a module:

- `probe`: is a database file sound (header, size, `PRAGMA quick_check` within a budget; the per-tick
  header read);
- `backups`: online backups, listing them, restoring the newest sound one, moving a damaged file aside;
- `rederive`: what a run directory says (config versions, checkpoints, attempts, a live job, the telemetry
  cursor) brought into the store;
- `adopt`: a run directory the store does not know: its row, its state, the `store_damaged` incident, and
  refusing to start a fresh run beside such directories;
- `repair`: what the daemon calls: `open_daemon_store` at start, `mend_replaced_file` / `mend_damaged_file`
  mid-run.

This `__init__` states the public API (what the daemon's CLI and supervisor import).
"""

from .adopt import (
    UnknownRunDirs,
    adopt_run_dir,
    record_recovery,
    refuse_unknown_run_dirs,
    settle_adopted_state,
)
from .backups import BACKUP_DIR_NAME, Restore, list_backups, restore_newest_backup, write_backup
from .probe import header_problem, probe_db_file
from .rederive import find_live_job, rederive_run, telemetry_end
from .repair import OpenedStore, mend_damaged_file, mend_replaced_file, open_daemon_store

__all__ = [
    "BACKUP_DIR_NAME",
    "OpenedStore",
    "Restore",
    "UnknownRunDirs",
    "adopt_run_dir",
    "find_live_job",
    "header_problem",
    "list_backups",
    "mend_damaged_file",
    "mend_replaced_file",
    "open_daemon_store",
    "probe_db_file",
    "record_recovery",
    "rederive_run",
    "refuse_unknown_run_dirs",
    "restore_newest_backup",
    "settle_adopted_state",
    "telemetry_end",
    "write_backup",
]
