"""The supervisor's own store (and state dir) cannot be written: say so, keep the job safe, retry, accept stop.

On a full or failing state-dir disk every store write raises (`database or disk is full`, `disk I/O error`,
ENOSPC on a run-dir file). Before, the exit handling failed, its recovery failed too, and the run sat RUNNING
with no job while `stop` answered `internal` (`IllegalTransition RUNNING -> STOPPED`). Now such an error is
not a bug of a tick step: the supervisor enters a degraded mode in which

- `status` (the control socket, answered from memory) carries `store: {writable: false, error, since_s,
  failures, next_retry_s}` and the journal has one critical line when it starts and one when it ends;
- the job is left alone: a running job keeps training (no hang verdict from a telemetry path that cannot
  record), and an exited job's exit stays unprocessed (its exit file is kept) so that nothing is relaunched,
  failed or decided on a store that cannot record it;
- the steps that write (telemetry, engine, exit, relaunch) are retried with exponential backoff
  (`BASE_S` doubling to `MAX_S`); the first retry that runs clean ends the mode;
- a state change the store could not take is applied in memory (so `stop` is accepted and the run's state
  machine moves on) and written to the store once it can be (`pending_states`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Protocol

from ulyssesd.daemon.core.termination import Termination
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import ExitStatus, JobHandle
from ulyssesd.daemon.ports import HostSide, Lifecycle, Records, RunFiles

log = get_logger("ulyssesd.supervisor")

#: First retry after this many seconds; doubles per failed retry up to MAX_S.
BASE_S = 1.0
MAX_S = 30.0
_SQLITE_WRITE_FAILURES = ("database or disk is full", "disk i/o error", "readonly database",
                          "unable to open database file", "no space left")
_OS_WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def is_store_write_error(exc: BaseException | None) -> bool:
    """True when `exc` (or what caused it) says the state dir / database cannot be written."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError):
            if any(w in str(exc).lower() for w in _SQLITE_WRITE_FAILURES):
                return True
        if isinstance(exc, OSError) and exc.errno in _OS_WRITE_FAILURES:
            return True
        orig = getattr(exc, "orig", None)  # SQLAlchemy's wrapper of the DB-API error
        if isinstance(orig, BaseException) and orig is not exc and is_store_write_error(orig):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


@dataclass
class StoreHealth:
    """Whether the store can be written now, and when to try again (see the module doc)."""

    failing_since: float | None = None  # wall time of the first failure of this episode
    error: str = ""
    failures: int = 0
    retry_at: float = 0.0
    episodes: int = 0  # degraded episodes since the daemon started
    pending_states: list[tuple[Any, str, int | None]] = field(default_factory=list)  # (state, reason, attempt)

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    def due(self, now: float) -> bool:
        """Run the writing steps now: always when healthy, at the retry time when degraded."""
        return self.failing_since is None or now >= self.retry_at

    def failed(self, exc: BaseException, now: float, say: Any = None, where: str = "") -> None:
        self.failures += 1
        self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        delay = min(MAX_S, BASE_S * 2 ** min(self.failures - 1, 20))
        self.retry_at = now + delay
        if self.failing_since is None:
            self.failing_since = now
            self.episodes += 1
            log.critical("the daemon's store cannot be written; the job is left alone, writes are retried with "
                         "backoff, stop is accepted", error=self.error, step=where, retry_in_s=delay)
            if say is not None:
                say(f"STORE NOT WRITABLE ({self.error}): job left alone; retrying with backoff")
        elif self.failures & (self.failures - 1) == 0:
            log.error("the daemon's store still cannot be written", error=self.error, failures=self.failures,
                      retry_in_s=delay)

    def recovered(self, now: float, say: Any = None) -> None:
        if self.failing_since is None:
            return
        log.warning("the daemon's store is writable again", after_s=round(now - self.failing_since, 1),
                    failures=self.failures)
        if say is not None:
            say(f"store writable again after {now - self.failing_since:.0f} s")
        self.failing_since, self.error, self.failures, self.retry_at = None, "", 0, 0.0

    def status(self, now: float) -> dict[str, Any]:
        """The `store` part of the status answer."""
        if self.failing_since is None:
            return {"writable": True, "degraded_episodes": self.episodes}
        return {"writable": False, "error": self.error, "since_s": round(now - self.failing_since, 1),
                "failures": self.failures, "next_retry_s": round(max(0.0, self.retry_at - now), 1),
                "unrecorded_state_changes": len(self.pending_states),
                "note": "the state dir's disk is full or failing; the job is left alone until the store can be "
                        "written; free space there"}


PROBE_BYTES = 256 << 10


def probe_state_dir(state_dir: str | os.PathLike[str]) -> None:
    """Write, sync and remove a small file in the state dir: raises OSError (ENOSPC, EROFS, EIO) while it
    cannot take writes. The degraded mode ends only after a retry ran clean AND this succeeds, so a quiet
    retry (nothing to write) on a still-full disk does not end it."""
    path = os.path.join(os.fspath(state_dir), ".ulyssesd-write-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


class StoreHealthRun(RunFiles, Records, Lifecycle, HostSide, Protocol):
    """What writing the run's state through a failing store uses of the run."""

    store_health: StoreHealth
    unrecorded_exit: ExitStatus | None  # an exit the store could not record, handled again at the next retry


def flush_pending_states(sup: StoreHealthRun) -> None:
    """Write the state changes the store could not take, oldest first (raises while it still cannot)."""
    health: StoreHealth = sup.store_health
    while health.pending_states:
        to, reason, attempt = health.pending_states[0]
        sup.store.set_run_state(sup.run_id, to, reason, attempt=attempt)
        health.pending_states.pop(0)


def store_state(sup: StoreHealthRun, to: Any, reason: str) -> None:
    """Write a state change, or keep it (in order) for later while the store cannot be written: the state
    machine moves on in memory, so a stop is accepted; the store gets the change when it can."""
    health: StoreHealth = sup.store_health
    if health.pending_states:  # keep the order: this one is written after the earlier ones
        health.pending_states.append((to, reason, sup.attempt or None))
        return
    try:
        sup.store.set_run_state(sup.run_id, to, reason, attempt=sup.attempt or None)
    except Exception as exc:
        if not is_store_write_error(exc):
            raise
        health.pending_states.append((to, reason, sup.attempt or None))
        health.failed(exc, sup.os.time(), sup.say, "state")


def keep_unrecorded_exit(sup: StoreHealthRun, exc: BaseException, job: JobHandle | None, term: Termination | None,
                         status: ExitStatus | None, relaunching: bool) -> bool:
    """The store cannot record this exit (`exc`): keep it unprocessed (the exit file stays) and handle it again
    at the next retry; nothing is relaunched or decided meanwhile. A stop or pause is honoured at once instead:
    there is nothing left to keep safe. False: not a store failure, or nothing to keep (the caller recovers)."""
    from ulyssesd.daemon.core.states import TERMINAL

    if not (is_store_write_error(exc) and sup.job is None and sup.state not in TERMINAL and relaunching):
        return False
    sup.job, sup.term, sup.unrecorded_exit = job, term, status
    return True
