"""The remediation engine's learned state saved beside the telemetry cursor, so that a restarted daemon resumes
from it instead of replaying the whole telemetry file (a 5-million-record run took minutes of replay).

What is saved (`{run_dir}/engine.snapshot`, replaced whole): the engine itself (its detectors' windows and
bands, calibration, known-good tags, ladder positions, restart budget; its memory re-planner is left out: it is
the live daemon's), what the supervisor remembers of the records (`decisions.track`: last step and record,
newest save, exit reason, failed saves) and the telemetry cursor (inode, offset) it is exact at.

- Written right after a batch's cursor is stored (so the snapshot never runs ahead of what was acted upon),
  when `SnapshotPolicy` says enough happened since the last one (a pickle of ~1 MB, tens of ms).
- Used at re-adoption only when it belongs to this run's telemetry file (same inode), is not past the stored
  cursor (a lost cursor write), and was made by the same engine (`engine_key`: the remediation code, the spec's
  detectors and remediation sections, the run's first config, what reaches the job). Otherwise the daemon says
  why in its log and replays from the start, as without a snapshot. The records between the snapshot and the
  stored cursor are replayed on top of it as before (their decisions dropped: they were acted upon).
- pickle: the file is the daemon's own, written and read only by it, in the run directory (private to the
  daemon's user; store/permissions.py). It is never taken from anywhere else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader
from ulyssesd.remediation.records import StepRecord

log = get_logger("ulyssesd.telemetry")

FORMAT = 1  # bump when what the file holds changes shape
FILE_NAME = "engine.snapshot"
# What the supervisor keeps of the records (decisions.track), saved and restored with the engine.
TRACKED = ("last_step", "last_step_record", "latest_ckpt", "last_exiting", "save_failures")


@dataclass(frozen=True)
class SnapshotPolicy:
    """When a snapshot is written (after a batch's cursor is stored). Counted in records, not seconds: a
    restart replays at most `every_records` (a few seconds), and a simulated week writes a handful."""

    every_records: int = 50_000  # records read since the last snapshot that make the next one due
    after_backlog_records: int = 1_000  # a drained backlog of at least this many records is saved at its end


class SnapshotRun(Protocol):
    """What saving and restoring the snapshot uses of the run (and `TRACKED`, set back at restore)."""

    run_id: str
    run_dir: Path
    last_step: int | None
    engine: Any
    reader: TelemetryReader | None
    attempt: int
    snapshots: EngineSnapshots


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """The remediation package's source: a snapshot of other engine code is not loaded into this one."""
    import ulyssesd.remediation as pkg

    h = hashlib.sha256(f"format {FORMAT}".encode())
    root = Path(pkg.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _plain(obj: Any) -> Any:
    """JSON for the key: sets sorted (their order varies between processes), models and dataclasses as dicts."""
    if isinstance(obj, (set, frozenset)):
        return sorted(map(str, obj))
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return repr(obj)


def engine_key(engine: Any) -> str | None:
    """What built a fresh engine (call it before the engine saw any record): its code, thresholds, policy,
    starting values and reach. None for an engine that is not the remediation engine (a test's stand-in)."""
    from ulyssesd.remediation.engine import RemediationEngine

    if not isinstance(engine, RemediationEngine):
        return None
    made_of = {"type": f"{type(engine).__module__}.{type(engine).__qualname__}", "code": _code_digest(),
               "config": engine.config, "policy": engine.policy, "initial": engine.initial, "reach": engine.reach}
    return hashlib.sha256(json.dumps(made_of, sort_keys=True, default=_plain).encode()).hexdigest()


@dataclass
class EngineSnapshots:
    """The run's snapshot bookkeeping (one per supervisor)."""

    policy: SnapshotPolicy = dataclasses.field(default_factory=SnapshotPolicy)
    key: str | None = None  # the fresh engine's `engine_key`; None: snapshots off for this engine
    records_since: int = 0  # records read since the last snapshot
    draining: bool = False  # the last batch stopped at the reader's byte bound: a backlog is being read
    failed: bool = False  # a write failed: said once, tried again on the next due batch
    restored_from: int | None = None  # the offset a re-adoption resumed from (None: replayed from the start)

    def bind(self, engine: Any) -> None:
        """A fresh engine was built for the run (create or adopt): remember what built it."""
        self.key = engine_key(engine)

    def due(self, behind: bool) -> bool:
        """After a batch (`behind`: more of the file waits): whether to save now."""
        drained, self.draining = self.draining and not behind, behind
        p, n = self.policy, self.records_since
        if n <= 0 or self.key is None:
            return False
        return n >= p.every_records or (drained and n >= p.after_backlog_records)


def path_of(run: SnapshotRun) -> Path:
    return Path(run.run_dir) / FILE_NAME


def after_batch(run: SnapshotRun, records: int) -> None:
    """Called right after a batch's cursor was stored: save the engine when a snapshot is due."""
    snaps, reader = run.snapshots, run.reader
    snaps.records_since += records
    if reader is None or run.engine is None or not snaps.due(reader.behind):
        return
    save(run, reader.cursor.inode, reader.cursor.offset)


def save(run: SnapshotRun, inode: int, offset: int) -> bool:
    """Write the snapshot for the cursor (inode, offset) the store holds now. False when it could not be."""
    from ulyssesd.training.durable import atomic_write

    snaps, eng = run.snapshots, run.engine
    replanner = getattr(eng, "replanner", None)
    try:
        eng.replanner = None  # the live daemon's planner (a closure over it): not state, not picklable
        body = pickle.dumps({"engine": eng, "tracked": {k: getattr(run, k) for k in TRACKED}},
                            protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot be pickled: replay at restart, as before
        if not snaps.failed:
            log.warning("engine snapshot not possible; a restart replays the telemetry", error=repr(exc))
        snaps.failed = True
        return False
    finally:
        eng.replanner = replanner
    head = json.dumps({"format": FORMAT, "key": snaps.key, "run_id": run.run_id, "inode": inode, "offset": offset,
                       "attempt": run.attempt, "last_step": run.last_step}).encode() + b"\n"
    try:
        atomic_write(path_of(run), lambda fh: (fh.write(head), fh.write(body)))
    except OSError as exc:  # a full disk: the previous snapshot (older, still exact) stays
        if not snaps.failed:
            log.warning("engine snapshot could not be written; the previous one stays", error=repr(exc))
        snaps.failed = True
        return False
    snaps.failed, snaps.records_since = False, 0
    log.info("engine snapshot saved", offset=offset, bytes=len(head) + len(body))
    return True


def restore(run: SnapshotRun, inode: int, limit: int) -> tuple[int, int | None]:
    """At re-adoption, before the replay: put the saved engine and tracked state in place when the snapshot is
    usable for the stored cursor (inode, limit). Returns (offset to replay from, the config version the attempt's
    saved records report); (0, None) when no snapshot is used (the replay starts at the beginning)."""
    snaps, path = run.snapshots, path_of(run)
    if snaps.key is None or not path.is_file():
        return 0, None
    why, loaded = _load(path, snaps.key, run.run_id, inode, limit)
    if loaded is None:
        log.warning("engine snapshot not used; replaying the telemetry from the start", reason=why, path=str(path))
        return 0, None
    head, body = loaded
    run.engine = body["engine"]
    for k in TRACKED:
        setattr(run, k, body["tracked"][k])
    rec = body["tracked"]["last_step_record"]
    reported = rec.config_version if isinstance(rec, StepRecord) and rec.attempt == run.attempt else None
    snaps.restored_from = head["offset"]
    log.info("engine restored from its snapshot", offset=head["offset"], replay_bytes=limit - head["offset"])
    return int(head["offset"]), reported if type(reported) is int else None


def _load(path: Path, key: str, run_id: str, inode: int, limit: int) -> tuple[str, tuple[dict, dict] | None]:
    """(why not, None) or ("", (header, body)) of a snapshot that fits the stored cursor."""
    try:
        with path.open("rb") as fh:
            head = json.loads(fh.readline(4096))
            if not isinstance(head, dict):
                return "its header is not an object", None
            if head.get("format") != FORMAT or head.get("key") != key:
                return "made by another engine version, spec or first config", None
            if head.get("run_id") != run_id or head.get("inode") != inode:
                return "of another run or telemetry file", None
            offset = head.get("offset")
            if type(offset) is not int or not 0 < offset <= limit:
                return f"its offset {offset!r} is past the stored cursor {limit}", None
            body = pickle.load(fh)
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: replay, never fail the adoption
        return f"unreadable ({type(exc).__name__}: {exc})", None
    if not isinstance(body, dict) or "engine" not in body or set(body.get("tracked", ())) != set(TRACKED):
        return "its body is not an engine snapshot", None
    return "", (head, body)
