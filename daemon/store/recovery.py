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
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import StoreError
from .permissions import private_dir, private_file, tighten

BACKUP_DIR_NAME = "backups"
BACKUP_GLOB = "ulyssesd-*.db"
#: Wall-clock bound of the integrity probe at start (a quick_check of a few MB takes milliseconds).
PROBE_BUDGET_S = 30.0
SQLITE_HEADER = b"SQLite format 3\x00"
TELEMETRY_TAIL_BYTES = 1 << 20
_ATTEMPT_LOG = re.compile(r"attempt-(\d+)\.log$")
_ATTEMPT_EXIT = re.compile(r"(\d+)\.exit$")
_CONFIG = re.compile(r"v(\d+)\.json$")


def _stamp() -> str:
    t = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- probe
def _header_problem(header: bytes, size: int) -> str | None:
    """What the first 100 bytes and the size say is wrong (emptied, not SQLite, truncated), or None."""
    if size == 0:
        return "the database file is empty (0 bytes): it was emptied or truncated"
    if not header.startswith(SQLITE_HEADER):
        return f"not an SQLite database (first bytes {header[:16]!r})"
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    if len(header) < 100 or page < 512 or size % page:
        return f"truncated: {size} bytes is not a whole number of {page}-byte pages"
    return None


def probe_db_file(path: str | os.PathLike[str], budget_s: float = PROBE_BUDGET_S) -> str | None:
    """None if `path` is missing or a readable SQLite database that passes `PRAGMA quick_check` within
    `budget_s`; otherwise what is wrong, in words. Opens the file like the daemon will (read-write: a
    hot WAL left by a crash is recovered, as any open would)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            header = fh.read(100)
    except FileNotFoundError:
        return None
    bad = _header_problem(header, size)
    if bad is not None:
        return bad
    deadline = time.monotonic() + budget_s
    try:
        conn = sqlite3.connect(str(p), timeout=5.0)
    except sqlite3.Error as exc:
        return f"cannot open: {exc}"
    try:
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
        if rows != ["ok"]:
            return f"quick_check found damage: {'; '.join(rows[:5])}"
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            # Not proof of damage: a huge file on a slow disk. Say so and carry on (maintenance re-checks).
            return None
        return f"{exc}"
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        return f"{exc}"
    finally:
        conn.close()
    return None


# -------------------------------------------------------------------------------------- backups
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


def write_backup(store: Any, backups_dir: str | os.PathLike[str], keep: int = 4) -> Path:
    """Online backup of `store` into `backups_dir` (atomic rename; a copy that fails quick_check is
    discarded and raises StoreError); keeps the newest `keep`. Returns the new backup's path."""
    bdir = private_dir(backups_dir)
    final = bdir / f"ulyssesd-{_stamp()}.db"
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
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        tighten(final)
        _fsync_dir(bdir)
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
    out = Restore(problem=problem, damaged_kept_as=_move_aside(db_path, "damaged"))
    for b in list_backups(backups_dir):
        why = probe_db_file(b)
        if why is not None:
            out.skipped_backups.append(f"{b.name}: {why}")
            continue
        tmp = db_path.with_name(f".{db_path.name}.restore.tmp")
        tmp.unlink(missing_ok=True)
        _copy_db(b, tmp)
        os.replace(tmp, db_path)
        _fsync_dir(db_path.parent)
        out.backup = str(b)
        out.backup_taken = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(b.stat().st_mtime))
        break
    return out


# ----------------------------------------------------------------------------------- re-derivation
def _numbers(d: Path, pattern: re.Pattern[str]) -> set[int]:
    if not d.is_dir():
        return set()
    return {int(m.group(1)) for p in d.iterdir() if (m := pattern.match(p.name))}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes()[: 16 << 20])
    except (OSError, ValueError):
        return None


def telemetry_end(path: Path) -> tuple[int, int, int | None] | None:
    """(inode, offset just after the last complete line, last step seen in the file's last MiB)."""
    try:
        st = path.stat()
        with path.open("rb") as fh:
            start = max(0, st.st_size - TELEMETRY_TAIL_BYTES)
            fh.seek(start)
            tail = fh.read()
    except OSError:
        return None
    end = tail.rfind(b"\n")
    if end < 0:
        return (st.st_ino, start, None) if start else (st.st_ino, 0, None)
    last_step = None
    for line in tail[: end + 1].splitlines()[::-1]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62:
            last_step = step
            break
    return st.st_ino, start + end + 1, last_step


def _last_exiting_reason(path: Path) -> str | None:
    """`reason` of the last `exiting` event in the telemetry file's last MiB."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - TELEMETRY_TAIL_BYTES))
            tail = fh.read()
    except OSError:
        return None
    for line in tail.splitlines()[::-1]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "exiting":
            reason = rec.get("reason")
            return reason if isinstance(reason, str) else None
    return None


#: The wrapper's module path now, and before daemon/ had sub-packages: a job launched by an older daemon is
#: still found (and re-adopted) after an upgrade.
JOB_WRAPPER_MODULES = ("ulyssesd.daemon.job.wrapper", "ulyssesd.daemon.job_wrapper")


def find_live_job(run_id: str, run_dir: Path, attempt: int) -> tuple[int, float] | None:
    """(pid, create_time) of the attempt's job wrapper if it still runs (found by its environment marker)."""
    import psutil

    from ulyssesd.daemon.job.launcher import job_marker

    key, value = job_marker(run_id, run_dir, attempt)
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
            if not any(module in cmdline for module in JOB_WRAPPER_MODULES):
                continue
            if proc.environ().get(key) == value:
                return proc.info["pid"], proc.info["create_time"]
        except (psutil.Error, OSError):
            continue
    return None


def rederive_run(store: Any, run_id: str, run_dir: Path, *, ckpt_dir: Path | None = None,
                 telemetry: Path | None = None) -> dict[str, Any]:
    """Bring the store's view of one run up to what its run directory holds; returns what was added."""
    from ulyssesd.daemon.host.process import _read_exit_file
    from ulyssesd.training import checkpoint as ck

    got: dict[str, Any] = {"config_versions": [], "checkpoints": [], "attempts": [], "telemetry_cursor": None}
    known_cv = {c.version for c in store.list_config_versions(run_id)}
    for v in sorted(_numbers(run_dir / "configs", _CONFIG) - known_cv):
        cfg = _read_json(run_dir / "configs" / f"v{v}.json")
        if isinstance(cfg, dict):
            store.add_config_version(run_id, {**cfg, "launcher": {"env": {}}}, version=v,
                                     parent_version=v - 1 if v > 1 else None, make_current=True,
                                     reason="re-derived from the run directory (store recovery)")
            got["config_versions"].append(v)
    ckpt_dir = ckpt_dir or run_dir / "checkpoints"
    known_ck = {c.tag for c in store.list_checkpoints(run_id, include_pruned=True)}
    for tag in ck.list_tags(ckpt_dir):
        if tag in known_ck:
            continue
        ok, why = ck.validate_tag(ckpt_dir / tag, verify_checksums=False)
        try:
            man = ck.read_manifest(ckpt_dir / tag)
        except ck.ManifestError:
            man = {}
        loss = man.get("loss")
        store.upsert_checkpoint(run_id, tag, int(man.get("step", ck.step_of_tag(tag) or 0)),
                                loss=loss if isinstance(loss, int | float) else None, valid=ok,
                                invalid_reason=None if ok else why)
        got["checkpoints"].append(tag)
    atts = {a.number: a for a in store.list_attempts(run_id)}
    on_disk = _numbers(run_dir / "logs", _ATTEMPT_LOG) | _numbers(run_dir / "attempts", _ATTEMPT_EXIT)
    last = max(on_disk | set(atts), default=0)
    got["live_job"] = None
    for n in sorted(on_disk | set(atts)):
        a = atts.get(n)
        if a is not None and (a.ended_at is not None or n == last):
            continue  # known; the last attempt's exit is noticed by the daemon's normal exit path
        st = _read_exit_file(run_dir / "attempts" / f"{n}.exit")
        live = find_live_job(run_id, run_dir, n) if n == last and st is None else None
        if a is None:
            store.add_attempt(run_id, number=n, command=["(re-derived from the run directory)"],
                              pid=live[0] if live else None, pgid=live[0] if live else None,
                              proc_start_time=live[1] if live else None)
            got["attempts"].append(n)
        if live is not None:
            got["live_job"] = {"attempt": n, "pid": live[0]}
        else:  # an earlier attempt the store thought live, or one that ended while the store was damaged
            store.end_attempt(run_id, n, returncode=st.returncode if st else None, signal=st.signal if st else None,
                              diagnosis=None if st else "unknown (ended while the store was damaged)")
    tel = telemetry or run_dir / "telemetry.jsonl"
    end = telemetry_end(tel)
    cur = store.get_telemetry_cursor(run_id)
    if end is not None and (cur is None or cur.inode != end[0] or cur.offset < end[1]):
        store.set_telemetry_cursor(run_id, path=str(tel), inode=end[0], offset=end[1], last_step=end[2])
        got["telemetry_cursor"] = {"offset": end[1], "last_step": end[2],
                                   "was": None if cur is None else {"offset": cur.offset, "last_step": cur.last_step}}
    got["last_attempt"] = last
    # The run had ended COMPLETED: its last attempt exited 0 after saying so (an adopted run is not relaunched).
    st_last = _read_exit_file(run_dir / "attempts" / f"{last}.exit") if last else None
    got["completed"] = bool(st_last is not None and st_last.returncode == 0 and end is not None
                            and _last_exiting_reason(tel) == "completed")
    got["last_step"] = end[2] if end else (cur.last_step if cur else None)
    return got


def adopt_run_dir(store: Any, run_dir: Path, run_id: str, *, spec_path: str | None,
                  live_states: bool = True) -> Any:
    """Create the store's row for a run directory it does not know (the database was emptied, restored
    from an older backup, or replaced): state RUNNING when its job still runs, else BACKOFF (the daemon
    relaunches from the newest valid checkpoint), STARTING when it never launched."""
    import tomllib

    try:
        raw = tomllib.loads((run_dir / "spec.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    store.create_run(run_id, spec=json.loads(json.dumps(raw, default=str)), run_dir=str(run_dir),
                     spec_path=spec_path or str(run_dir / "spec.toml"), state="STARTING",
                     reason="re-adopted from its run directory (the store did not know it)")
    return store.get_run(run_id)


def settle_adopted_state(store: Any, run: Any, what: dict[str, Any]) -> None:
    """A run row created by `adopt_run_dir` (STARTING) gets the state its directory says: RUNNING with a
    live job (re-adopted), BACKOFF when attempts ran but none is alive (relaunched from the newest valid
    checkpoint), STARTING when it never launched (launched)."""
    from .enums import RunState

    live = what.get("live_job")
    if live and live["attempt"] in what.get("attempts", []) and run.state not in (RunState.STARTING, RunState.RUNNING):
        # The backup predates the live attempt: the restart (or backoff, or stop) it recorded as in progress
        # is long over. Left as it is, re-adoption would "finish" that restart by killing the healthy job.
        store.set_run_state(run.id, RunState.RUNNING,
                            f"store restored: attempt {live['attempt']} (newer than the backup) is training")
        return
    if run.state != RunState.STARTING or not what.get("last_attempt"):
        return
    if what.get("completed"):
        store.set_run_state(run.id, RunState.COMPLETED, "re-adopted: its last attempt had completed the run")
    elif what.get("live_job"):
        store.set_run_state(run.id, RunState.RUNNING, "re-adopted: its job is still running")
    else:
        store.set_run_state(run.id, RunState.BACKOFF, "re-adopted: no live job; relaunch from the newest checkpoint")


def record_recovery(store: Any, run_id: str, what: dict[str, Any], summary: str) -> int:
    """The `store_damaged` incident of one run: what was restored and re-derived (resolved at once)."""
    from .enums import IncidentStatus, Severity, Symptom

    iid = store.record_incident(run_id, attempt=int(what.get("last_attempt") or 0), symptom=Symptom.store_damaged,
                                step=int(what.get("last_step") or 0), severity=Severity.warning,
                                summary=summary[:500], evidence=json.loads(json.dumps(what, default=str)))
    store.update_incident_status(iid, IncidentStatus.resolved, "store recovered; supervision continues")
    return iid


# ----------------------------------------------------------------------------------- daemon entry
@dataclass
class OpenedStore:
    store: Any
    restore: Restore | None
    incidents: list[int]


def open_daemon_store(db_path: str | os.PathLike[str], state_dir: str | os.PathLike[str], *,
                      spec_source: str | None = None, say: Any = None) -> OpenedStore:
    """The daemon's `open_store`: probe the file, restore the newest sound backup if it is damaged,
    re-derive every unfinished run from its directory, record what was recovered."""
    from .enums import TERMINAL_RUN_STATES
    from .errors import NotFoundError
    from .opener import open_store

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


def mend_replaced_file(store: Any) -> str | None:
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
        os.replace(db, Path(f"{db}.foreign-{_stamp()}"))
    # Closing the old connections checkpoints into the deleted inode and removes the -wal/-shm names;
    # only then may the new file take the path (a leftover -wal must never be applied to it).
    store._engine.dispose()
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, db)
    tighten(db)
    _fsync_dir(db.parent)
    store.rebind()
    return problem


def header_problem(path: str | os.PathLike[str]) -> str | None:
    """The cheap per-tick check (one 100-byte read): None while the file still looks like an SQLite
    database; else what is wrong (emptied, overwritten header, not a whole number of pages)."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(100)
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        return None  # file_problem() reports a missing file
    except OSError as exc:
        return f"unreadable: {exc}"
    bad = _header_problem(header, size)
    return None if bad is None else f"under the running daemon: {bad}"


def mend_damaged_file(store: Any, state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
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
        store._engine.dispose()
    except Exception:  # noqa: BLE001 - closing a damaged database may fail; its file is set aside anyway
        pass
    if salvaged:
        kept = _move_aside(db, "damaged")
        os.replace(tmp, db)
        tighten(db)
        _fsync_dir(db.parent)
        out = {"problem": problem, "recovered_from": "the daemon's open connection", "damaged_kept_as": kept,
               "lost_since": None}
    else:
        tmp.unlink(missing_ok=True)
        r = restore_newest_backup(db, Path(state_dir) / BACKUP_DIR_NAME, problem)
        out = {"problem": problem, "recovered_from": r.backup or "nothing (no sound backup: empty database)",
               "damaged_kept_as": r.damaged_kept_as, "lost_since": r.backup_taken,
               "skipped_backups": r.skipped_backups}
        if r.backup is None:
            from .migrate import upgrade_to_head

            upgrade_to_head(db)
    store.rebind()
    return out


def _move_aside(db: Path, what: str) -> list[str]:
    stamp = _stamp()
    kept = []
    for suffix in ("", "-wal", "-shm"):
        f = Path(f"{db}{suffix}")
        if f.exists():
            aside = Path(f"{db}.{what}-{stamp}{suffix}")
            os.replace(f, aside)
            kept.append(str(aside))
    return kept


class UnknownRunDirs(RuntimeError):
    """Run directories exist that the store does not know: starting a fresh run beside them would
    silently restart training from step 0 (typically the database was emptied or replaced)."""


def refuse_unknown_run_dirs(store: Any, state_dir: Path, new_run_id: str, spec_source: str | None) -> None:
    """Raise UnknownRunDirs naming them and saying how to adopt or archive them."""
    runs_root = state_dir / "runs"
    if not runs_root.is_dir():
        return
    known = {r.id for r in store.list_runs()}
    unknown = sorted(p.name for p in runs_root.iterdir() if p.is_dir() and p.name not in known)
    if not unknown:
        return
    spec = spec_source or "RUN.toml"
    shown = ", ".join(unknown[:10]) + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
    raise UnknownRunDirs(
        f"refusing to start run {new_run_id}: {runs_root} holds run directories the database does not know "
        f"({shown}); the database was probably emptied or replaced. To continue one of them: "
        f"`ulyssesd run --spec {spec} --state-dir {state_dir} --run-id {unknown[-1]}` (re-adopts it from its "
        f"directory: configs, checkpoints, telemetry). To start fresh instead, archive them first: "
        f"`mkdir -p {state_dir}/archive && mv {runs_root}/{unknown[-1]} {state_dir}/archive/`. Backups of the "
        f"database, if any, are in {state_dir / BACKUP_DIR_NAME}")
