"""The loop's periodic jobs and the store's health: what runs between ticks, on the supervisor's thread.

`LoopScheduler`: APScheduler's BackgroundScheduler fires triggers from its own thread. The supervisor's
invariant is one thread doing the work (no locks around the store, the job handle or the state machine), so
a trigger does only one thing: put the job's name on a thread-safe queue. The main loop drains the queue
each tick and runs the job body itself. `coalesce=True` + `max_instances=1` + a queue that holds each name
at most once mean a slow loop never accumulates a backlog of the same job.

The jobs (`setup` registers them): checkpoint retention + disk guard, store maintenance (integrity check),
store backups, closing stale attempts and a status line, each on its own interval (`[daemon] *_every_s`);
and, every tick, the one-stat check that the database file was not deleted, replaced or damaged under the
daemon (then it is mended in place from the open connection or restored from the newest backup, this run
re-derived from its directory, and an incident says what was recovered).

`StepGuard`: every step of the tick runs through `StepGuard.run`, so a bug in any of them (the telemetry
path, the engine, advancing a termination, an exit, the rank watch, a BACKOFF's relaunch, a command, the
store check, ...) never ends the daemon. Each distinct error (step, exception type, message, raising line)
is logged with its traceback once and recorded as one `internal_error` incident (traceback in its evidence); repeats
are counted and logged at 2, 4, 8, ... An error back after its step ran cleanly is a new incident (at most
one per error per RECUR_RECORD_EVERY_S; MAX_ERROR_INCIDENTS in all). A step that raises `[daemon] step_error_limit` ticks in a row ends
the run FAILED, "internal error in <step>: <exc>": the job is stopped with the stop grace (it saves; no
checkpoint is removed). If the stop itself cannot proceed (the step is the termination, stopping raised, or
the grace ran out with the run still not ended) the job's processes are SIGKILLed and the run marked
FAILED. A step that runs cleanly again resolves its incidents.
"""

from __future__ import annotations

import queue
import signal
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from apscheduler.schedulers.background import BackgroundScheduler

from ulyssesd.daemon.host.disk_budget import BudgetRun
from ulyssesd.daemon.host.gpu_health import GpuHealth
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import ExitStatus, JobHandle
from ulyssesd.daemon.ports import HostSide, Lifecycle
from ulyssesd.daemon.safety.store_health import StoreHealth
from ulyssesd.daemon.store.enums import TERMINAL_RUN_STATES, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader

log = get_logger("ulyssesd.supervisor")
sched_log = get_logger("ulyssesd.scheduler")


class HousekeepingRun(BudgetRun, Lifecycle, HostSide, Protocol):
    """What the periodic jobs and the tick's guard use of the run (and the budget's `BudgetRun`)."""

    scheduler: LoopScheduler | None
    reader: TelemetryReader | None  # the attempt's telemetry reader (its cursor is what was processed)
    store_health: StoreHealth  # whether the store takes writes (safety/store_health.py)
    gpu_health: GpuHealth  # NVML checks, polled on a timer (host/gpu_health.py)

    def status_dict(self) -> dict[str, Any]: ...


class LoopScheduler:
    """Periodic jobs fired by APScheduler's thread, run by the main loop (`run_due`), never concurrently."""

    def __init__(self, use_thread: bool = True) -> None:
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._bodies: dict[str, Callable[[], None]] = {}
        self._sched = BackgroundScheduler(timezone="UTC", job_defaults={"coalesce": True, "max_instances": 1,
                                                                        "misfire_grace_time": None}) if use_thread else None
        self.runs: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def add(self, name: str, every_s: float, body: Callable[[], None]) -> None:
        self._bodies[name] = body
        if self._sched is not None:
            self._sched.add_job(self.enqueue, "interval", seconds=every_s, args=[name], id=name,
                                replace_existing=True)

    def enqueue(self, name: str) -> None:
        """Called from APScheduler's thread (or a test): mark `name` due, at most once."""
        with self._lock:
            if name in self._pending:
                return
            self._pending.add(name)
        self._queue.put(name)

    def start(self) -> None:
        if self._sched is not None and not self._sched.running:
            self._sched.start()

    def shutdown(self) -> None:
        if self._sched is not None and self._sched.running:
            self._sched.shutdown(wait=False)

    def run_due(self, limit: int = 8) -> list[str]:
        """Run due jobs on the caller's (main loop's) thread; a failing job is logged, never fatal."""
        ran = []
        for _ in range(limit):
            try:
                name = self._queue.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._pending.discard(name)
            body = self._bodies.get(name)
            if body is None:
                continue
            try:
                body()
                self.runs[name] = self.runs.get(name, 0) + 1
            except Exception as exc:  # noqa: BLE001 - a housekeeping failure must not kill supervision
                self.errors[name] = self.errors.get(name, 0) + 1
                sched_log.error("scheduled job failed", job=name, error=repr(exc))
            ran.append(name)
        return ran


#: Steps the orderly stop itself goes through: when one of them is the broken one, the job is killed at once.
STOP_DEPENDS_ON = frozenset({"termination"})
#: Distinct errors remembered per step: past this a new one is counted as a repeat (a hostile client's
#: requests cannot grow the table or the incident list without bound).
MAX_DISTINCT_ERRORS = 50
#: An error that comes back after its step ran cleanly is a new incident, at most once per this many seconds
#: per error: a step that fails every other tick is one incident per 10 minutes, not one per tick.
RECUR_RECORD_EVERY_S = 600.0
#: Internal-error incidents one daemon records in all; past it errors are still logged and counted.
MAX_ERROR_INCIDENTS = 200


@dataclass
class StepErrors:
    """What one tick step's failures look like so far."""

    in_a_row: int = 0  # ticks in a row the step raised (0 once it runs cleanly)
    total: int = 0  # every raise of the step since the daemon started
    distinct: dict[str, int] = field(default_factory=dict)  # error signature -> how often it was seen
    incident_ids: list[int] = field(default_factory=list)  # open incidents of this step's errors
    open_for: set[str] = field(default_factory=set)  # signatures with an open incident (this failure episode)
    recorded_at: dict[str, float] = field(default_factory=dict)  # signature -> monotonic time of its last incident
    ending_since: float | None = None  # monotonic time the run was told to end for this step's errors


#: The tick steps that write the store or the state dir: their "cannot write" errors are the degraded mode's
#: (safety/store_health.py), retried with backoff; the same error elsewhere is an ordinary step error.
STORE_WRITING_STEPS = frozenset({"telemetry", "engine", "attempt_log", "exit_check", "exit", "rank_watch",
                                 "relaunch", "store_flush", "store_probe"})


class StepGuard:
    """Runs each tick step so that its exception is logged, recorded, counted and bounded, never fatal."""

    def __init__(self, sup: HousekeepingRun, limit: int) -> None:
        self.sup = sup
        self.limit = limit  # raises in a row that end the run ([daemon] step_error_limit)
        self.steps: dict[str, StepErrors] = {}
        self.incidents_recorded = 0  # internal-error incidents of this daemon (bounded: MAX_ERROR_INCIDENTS)

    def counts(self) -> dict[str, int]:
        """Raises per step since the daemon started (the control socket's status answer)."""
        return {name: e.total for name, e in self.steps.items() if e.total}

    def run(self, step: str, body: Callable[[], object],
            on_error: Callable[[BaseException], None] | None = None, bounded: bool = True) -> bool:
        """Run `body`; False when it raised. `on_error` (the exit step's own plan-aware recovery) then records
        the error instead of the generic incident; `bounded=False`: never ends the run (see `failed`)."""
        try:
            body()
        except Exception as exc:  # noqa: BLE001 - the one place a tick step's bug is caught (module doc)
            try:
                self.failed(step, exc, on_error=on_error, bounded=bounded)
            except Exception:  # noqa: BLE001 - the guard's own failure (a say() callback, the log) is not fatal
                log.critical("handling a tick step's error failed too", step=step, exc_info=True)
            return False
        errors = self.steps.get(step)
        if errors is not None and errors.in_a_row:
            self._recovered(step, errors)
        return True

    def failed(self, step: str, exc: BaseException, *, on_error: Callable[[BaseException], None] | None = None,
               bounded: bool = True) -> None:
        """Log, record and count `exc` (called from its `except`); `bounded`: end the run after `limit` in a
        row. A control request that raised is not bounded: it is the operator's call, not the loop spinning."""
        sup = self.sup
        from ulyssesd.daemon.safety.store_health import is_store_write_error

        if step in STORE_WRITING_STEPS and is_store_write_error(exc) and sup.run_id:
            # Not a bug of the step: the store (state dir) cannot be written. Degraded mode, retried with
            # backoff, never counted toward step_error_limit (that would end a healthy job FAILED).
            sup.store_health.failed(exc, sup.os.time(), sup.say, step)
            if on_error is not None:
                on_error(exc)
            return
        errors = self.steps.setdefault(step, StepErrors())
        errors.in_a_row += 1
        errors.total += 1
        what = f"{type(exc).__name__}: {str(exc)[:300]}"
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        signature = f"{what} at {frame.filename}:{frame.lineno}" if frame else what
        if signature not in errors.distinct and len(errors.distinct) >= MAX_DISTINCT_ERRORS:
            signature = "(more distinct errors)"
        seen = errors.distinct.get(signature, 0) + 1
        errors.distinct[signature] = seen
        if seen == 1:
            log.exception("tick step failed", step=step, error=what, in_a_row=errors.in_a_row)
        elif seen & (seen - 1) == 0:  # 2, 4, 8, ...: counted, not a log line every tick
            log.error("tick step still failing", step=step, error=what, times=seen, in_a_row=errors.in_a_row)
        if on_error is not None:
            on_error(exc)  # never raises (core/exits.exit_handling_failed ends in its own last resort)
        elif sup.run_id and self._records(errors, signature, seen):
            try:
                iid = sup.incidents.incident(
                    Symptom.internal_error, sup.last_step or 0, Severity.critical, f"internal error in {step}: {what}",
                    {"internal_error": traceback.format_exc(limit=30)[-8000:], "step": step,
                     "limit_in_a_row": self.limit, "seen_before": seen - 1})
                errors.incident_ids.append(iid)
                errors.open_for.add(signature)
                errors.recorded_at[signature] = sup.os.monotonic()
                self.incidents_recorded += 1
            except Exception as inner:  # noqa: BLE001 - the log line above already has the traceback
                log.warning("could not record the internal error as an incident", step=step, error=repr(inner))
        # PAUSED is already safe (no job; only idle steps run): the error is logged and counted, the run waits.
        if bounded and sup.state not in TERMINAL_RUN_STATES and sup.state != RunState.PAUSED \
                and errors.in_a_row >= self.limit:
            self._end_run(step, errors, f"internal error in {step}: {what}")

    def _records(self, errors: StepErrors, signature: str, seen: int) -> bool:
        """Whether this raise gets its own incident: an error new to the step does; a repeat while its incident
        is open does not (one incident per error and failure episode); an error back after the step ran
        cleanly does again, at most every RECUR_RECORD_EVERY_S; none past MAX_ERROR_INCIDENTS."""
        if signature in errors.open_for or self.incidents_recorded >= MAX_ERROR_INCIDENTS:
            if self.incidents_recorded == MAX_ERROR_INCIDENTS and signature not in errors.open_for:
                log.error("internal-error incident limit reached: further errors are only logged and counted",
                          limit=MAX_ERROR_INCIDENTS)
                self.incidents_recorded += 1  # said once
            return False
        last = errors.recorded_at.get(signature)
        return seen == 1 or last is None or self.sup.os.monotonic() - last >= RECUR_RECORD_EVERY_S

    def _recovered(self, step: str, errors: StepErrors) -> None:
        log.info("tick step ran cleanly again", step=step, after_failures=errors.in_a_row)
        errors.in_a_row, errors.ending_since = 0, None
        errors.open_for.clear()  # the next failure is a new episode: its errors may be recorded again
        for iid in errors.incident_ids:
            try:
                self.sup.store.update_incident_status(iid, IncidentStatus.resolved, f"{step} ran cleanly again")
            except Exception as exc:  # noqa: BLE001 - bookkeeping; the incident stays open, the log says why
                log.warning("could not resolve the internal-error incident", incident=iid, error=repr(exc))
        errors.incident_ids.clear()

    def _end_run(self, step: str, errors: StepErrors, reason: str) -> None:
        """The bound: stop the job with its grace (it saves) and end FAILED; kill it if that cannot work."""
        sup = self.sup
        now = sup.os.monotonic()
        if errors.ending_since is None:
            errors.ending_since = now
            log.critical("tick step keeps failing; ending the run", step=step, in_a_row=errors.in_a_row)
            orderly = step not in STOP_DEPENDS_ON
            if orderly:
                try:
                    sup.stop_run(reason, fail=True)
                except Exception:  # noqa: BLE001 - the orderly stop is broken too: the hard way below
                    log.exception("the orderly stop after the internal error failed; killing the job")
                    orderly = False
            if not orderly:
                self._kill_and_fail(reason)
            # Last: the operator's console line may itself fail (the caller logs that), the run is ending anyway.
            sup.say(f"INTERNAL ERROR: {step} raised {errors.in_a_row} ticks in a row; ending the run ({reason})")
        elif now - errors.ending_since >= sup.dcfg.stop_grace_s + 10.0:
            self._kill_and_fail(reason)  # the orderly stop had its grace (SIGTERM, final save, SIGKILL): not enough

    def _kill_and_fail(self, reason: str) -> None:
        sup = self.sup
        if sup.job is not None:
            try:
                sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
                sup.store.end_attempt(sup.run_id, sup.attempt, returncode=None, diagnosis="internal_error",
                                      diagnosis_evidence=[reason])
            except Exception as exc:  # noqa: BLE001 - the run still ends FAILED below; the log says what is left
                log.error("could not kill or close the attempt after the internal error", error=repr(exc))
            sup.job, sup.term = None, None
        try:
            sup.fail(reason)
        except Exception:  # noqa: BLE001 - the store is gone too: end the loop; the next daemon re-adopts
            log.critical("could not record the run as FAILED; ending supervision of it", run_id=sup.run_id,
                         exc_info=True)
            sup.state = RunState.FAILED


def setup(sup: HousekeepingRun) -> None:
    """Register the periodic jobs with the supervisor's scheduler (none in tests that pass no scheduler)."""
    if sup.scheduler is None:
        return
    d = sup.dcfg
    sup.scheduler.add("checkpoint_retention", d.retention_every_s, lambda: retention(sup))
    sup.scheduler.add("store_maintenance", d.maintenance_every_s, lambda: maintenance(sup))
    if hasattr(sup.store, "backup_into"):
        sup.scheduler.add("store_backup", d.backup_every_s, lambda: backup(sup))
    sup.scheduler.add("stale_attempt_sweep", d.sweep_every_s, lambda: sweep_stale_attempts(sup))
    sup.scheduler.add("status_summary", d.status_every_s, lambda: status_summary(sup))
    sup.scheduler.add("gpu_health", sup.spec.gpu_health.every_s, lambda: sup.gpu_health.poll(sup.os.time()))
    sup.scheduler.start()


def retention(sup: HousekeepingRun) -> None:
    """The checkpoint directory's budget (host/disk_budget.py): surplus tags and set-aside copies over their caps
    go, room is made for the next save, the store is told. Runs after every `checkpoint_saved` and on a timer."""
    from ulyssesd.daemon.host import disk_budget

    disk_budget.run_retention(sup)


def maintenance(sup: HousekeepingRun) -> None:
    """The store's own upkeep and integrity check; a damaged database under a running daemon is an incident."""
    res = sup.store.maintenance()
    if getattr(res, "ok", True) is False and sup.run_id:
        # Damaged under a running daemon: the backup job now refuses unsound copies (the last good ones
        # stay), and the next daemon start restores the newest one. Say it once per distinct result.
        iid = sup.incidents.incident(Symptom.store_damaged, sup.last_step or 0, Severity.critical,
                             f"integrity_check failed: {'; '.join(res.integrity[:3])[:300]}; restart the "
                             "daemon to restore the newest good backup (the job keeps training)",
                             {"integrity": res.integrity[:20], "path": str(sup.store.path)})
        sup.alert("incident", f"store {sup.store.path} damaged: {res.integrity[:1]}")
        log.error("store integrity check failed", incident=iid, integrity=res.integrity[:5])


def backup(sup: HousekeepingRun) -> None:
    """A consistent copy of the store next to the state dir (the newest `backups_keep` are kept)."""
    from ulyssesd.daemon.store.recovery import BACKUP_DIR_NAME, write_backup

    path = write_backup(sup.store, Path(sup.dcfg.state_dir) / BACKUP_DIR_NAME, keep=sup.dcfg.backups_keep)
    log.info("store backup written", path=str(path))


def check_store_file(sup: HousekeepingRun) -> None:
    """Database file deleted or replaced under us (one stat): re-create it from the open connection
    before anything is written to an inode nobody can read, and say so (store/recovery/repair.py)."""
    if not hasattr(sup.store, "file_problem"):
        return
    from ulyssesd.daemon.store.recovery import mend_replaced_file

    problem = mend_replaced_file(sup.store)
    if problem is None:
        check_store_damage(sup)
        return
    log.warning("store file re-created", problem=problem, path=str(sup.store.path))
    sup.say(f"WARNING: {problem}; re-created it from the open connection (nothing lost)")
    if sup.run_id:
        iid = sup.incidents.incident(Symptom.store_damaged, sup.last_step or 0, Severity.warning,
                             f"{problem}; re-created from the daemon's open connection, no history lost",
                             {"problem": problem, "path": str(sup.store.path), "recovered": "everything"})
        sup.store.update_incident_status(iid, IncidentStatus.resolved, "database re-created in place")


def check_on_disk_state(sup: HousekeepingRun, run_dir: Path) -> None:
    """The tick's look at what an operator or a cleaner may remove under the daemon: its store, the run dir."""
    check_store_file(sup)
    check_run_dir(sup, run_dir)


def check_run_dir(sup: HousekeepingRun, run_dir: Path) -> None:
    """The live run's directory removed under us (an `rm -rf`, a tmp cleaner; one stat): re-create it empty (with
    logs/ and attempts/) so the daemon's own files and the job's exit record can be written again, and say so
    (an incident: what was in it, the spec copy, logs and telemetry, is gone). The job trains on; `stop` works."""
    if not sup.run_id or sup.state in TERMINAL_RUN_STATES or run_dir.is_dir():
        return
    for sub in ("logs", "attempts"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    text = (f"the run dir {run_dir} was removed while the run was live; re-created it empty: its logs, telemetry "
            f"and spec copy are gone, the job trains on (its output from now is not in the new log)")
    log.warning("run directory removed under the daemon; re-created", path=str(run_dir))
    sup.say(f"WARNING: {text}")
    iid = sup.incidents.incident(Symptom.store_damaged, sup.last_step or 0, Severity.warning, text,
                                 {"problem": "run directory removed", "path": str(run_dir)})
    sup.store.update_incident_status(iid, IncidentStatus.escalated, "run directory removed under the daemon")


def check_store_damage(sup: HousekeepingRun) -> None:
    """The database file itself damaged under us (emptied, header overwritten, truncated: one 100-byte
    read): salvage it from the open connection or restore the newest backup, re-derive this run from its
    directory, forget in-memory references to incidents the restored store does not have, say so."""
    from ulyssesd.daemon.store import recovery

    got = recovery.mend_damaged_file(sup.store, sup.dcfg.state_dir)
    if got is None:
        return
    log.warning("store damaged under the daemon", **{k: str(v) for k, v in got.items()})
    if sup.run_id:
        try:
            sup.store.get_run(sup.run_id)
        except LookupError:  # the restored database predates this run: rebuild it from its directory
            recovery.adopt_run_dir(sup.store, sup.run_dir, sup.run_id,
                                   spec_path=str(Path(sup.spec.source).resolve()))
        # This daemon's state is the truth; a restored backup may hold an older one (no-op when equal).
        sup.store.set_run_state(sup.run_id, sup.state, "store restored under the running daemon",
                                 attempt=sup.attempt or None)
        what = recovery.rederive_run(sup.store, sup.run_id, sup.run_dir, ckpt_dir=sup.ckpt_dir,
                                     telemetry=sup.telemetry_path)
        if sup.reader is not None:  # what this daemon has processed, not the file's end
            sup.store.set_telemetry_cursor(sup.run_id, path=str(sup.telemetry_path),
                                            inode=sup.reader.cursor.inode, offset=sup.reader.cursor.offset,
                                            last_step=sup.last_step)
        known = {i.id for i in sup.store.list_incidents(sup.run_id)}
        sup.incidents.forget_unknown(known)
        what.update(got)
        iid = sup.incidents.incident(Symptom.store_damaged, sup.last_step or 0, Severity.warning,
                             f"{got['problem']}; recovered from {got['recovered_from']}"
                             + (f" (incidents/actions after {got['lost_since']} are not in the store)"
                                if got.get("lost_since") else ", nothing lost"), what)
        sup.store.update_incident_status(iid, IncidentStatus.resolved, "database recovered in place")
    sup.say(f"WARNING: {got['problem']}; recovered from {got['recovered_from']}")


# Supervisor -> its attempt number when a sweep last found no other open attempt. Only a daemon before this one
# leaves one open (this one ends each attempt it launched), so the store is asked again only once the attempt
# changed (an end this daemon failed to write): not on every sweep of a week-long run.
_swept_clean: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def sweep_stale_attempts(sup: HousekeepingRun) -> None:
    """Attempts the store thinks are live but whose process is gone (e.g. left by a crashed daemon
    for another run) are closed with what their exit file says."""
    from ulyssesd.daemon.host.process import read_exit_file

    if _swept_clean.get(sup) == sup.attempt:
        return
    others = 0
    for a in sup.store.list_open_attempts(sup.run_id):
        if a.ended_at is not None or a.number == sup.attempt or not a.pid or not a.proc_start_time:
            continue
        others += 1
        h = JobHandle(a.pid, a.proc_start_time)
        if not sup.os.is_alive(h):
            others -= 1
            st = read_exit_file(sup.run_dir / "attempts" / f"{a.number}.exit") or ExitStatus(None, None, "unknown")
            sup.store.end_attempt(sup.run_id, a.number, returncode=st.returncode, signal=st.signal)
            log.info("stale attempt closed", attempt=a.number, status=st.describe())
    if not others:
        _swept_clean[sup] = sup.attempt


def status_summary(sup: HousekeepingRun) -> None:
    """One structured status line in the daemon log."""
    log.info("status", **sup.status_dict())
