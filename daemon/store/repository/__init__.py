"""The repository: the ONLY code that issues queries against the store, one module per table group.

Every write is one short transaction (BEGIN IMMEDIATE … COMMIT) so the daemon never holds the write lock
across I/O, and every method returns frozen records (see ../records.py), never live ORM objects.
Enum-typed arguments accept the enum or its text; unknown text raises `InvalidValueError` naming the
allowed values before anything reaches SQLite (the table CHECKs are the second line of defence).

- `base`: sessions (read / write transactions), timestamp and enum parsing, the run-row lookup;
- `runs`: runs, their state transitions, attempts;
- `incidents`: incidents, the actions taken on them, `flat_diff` (an action's config diff);
- `progress`: config versions, the telemetry cursor, checkpoints;
- `upkeep`: the file's identity, online backup, reconnect, integrity check and WAL checkpoint;
- `store`: `Store`, all of the above over one SQLite file (built by `ulyssesd.daemon.store.open_store`).
"""
