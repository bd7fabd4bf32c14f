"""The next attempt: the `Relaunch` request, the restart budget (`Counters`: restarts per hour, restarts
without checkpoint progress, consecutive early deaths) and the backoff before relaunching."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ulyssesd.daemon.core.termination import Relaunch
from ulyssesd.daemon.host import disk
from ulyssesd.daemon.host.disk import DiskRun
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.ports import HostSide
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom

S = RunState
log = get_logger("ulyssesd.supervisor")

#: Launch tries in a row that may fail on the daemon's own writes (full disk) before the run FAILS.
OWN_WRITE_RETRIES = 6
#: What the pre-launch probe writes: about what a launch writes (configs/vN.json, control.json, the log's
#: first lines), so a disk that passes it very likely takes those writes too.
PROBE_BYTES = 256 << 10


class RelaunchRun(DiskRun, HostSide, Protocol):
    """What the restart budget and backoff use of the run (and the disk handling's `DiskRun`)."""

    counters: Counters
    pending_relaunch: Relaunch | None  # what starts when the backoff is over
    backoff_until: float | None  # steady wall time the backoff ends (daemon/clock.SteadyWall)


@dataclass
class Counters:
    """Restart budget bookkeeping (checked against remediation.max_restarts_per_hour / no_progress_restarts)."""

    restarts: list[float] = field(default_factory=list)  # wall times of relaunches (budget per hour)
    restarts_without_progress: int = 0
    consecutive_early_deaths: int = 0
    ckpt_step_at_last_restart: int | None = None
    own_write_failures: int = 0  # launches in a row that failed on the daemon's own run-directory writes


def schedule_relaunch(sup: RelaunchRun, relaunch: Relaunch, early: bool = False) -> None:
    """Budget checks, then relaunch now or after a backoff."""
    now = sup.steady.now()  # the budget's hour and the backoff: no wall-clock steps
    rcfg = sup.spec.remediation
    ckpt_step = sup.latest_ckpt[1] if sup.latest_ckpt else None
    if relaunch.counts_against_budget:
        sup.counters.restarts = [t for t in sup.counters.restarts if now - t < 3600] + [now]
        if sup.counters.ckpt_step_at_last_restart is not None and ckpt_step == sup.counters.ckpt_step_at_last_restart:
            sup.counters.restarts_without_progress += 1
        elif sup.counters.ckpt_step_at_last_restart is None and ckpt_step is None:
            sup.counters.restarts_without_progress += 1
        else:
            sup.counters.restarts_without_progress = 1 if ckpt_step is None else 0
        sup.counters.ckpt_step_at_last_restart = ckpt_step
        if len(sup.counters.restarts) > rcfg.max_restarts_per_hour:
            fail_budget(sup, Symptom.crash_loop, f"{len(sup.counters.restarts)} restarts in the last hour "
                        f"(remediation.max_restarts_per_hour={rcfg.max_restarts_per_hour})")
            return
        if sup.counters.restarts_without_progress > rcfg.no_progress_restarts:
            fail_budget(sup, Symptom.no_progress, f"{sup.counters.restarts_without_progress} restarts without "
                        f"checkpoint advance (remediation.no_progress_restarts={rcfg.no_progress_restarts}); "
                        f"latest checkpoint step {ckpt_step}")
            return
    delay = 0.0
    if early and sup.counters.consecutive_early_deaths > 0:
        n = sup.counters.consecutive_early_deaths
        delay = min(sup.dcfg.backoff_max_s, sup.dcfg.backoff_base_s * 2 ** (n - 1))
        delay *= 1 + 0.25 * random.random()  # jitter: decorrelate many daemons after a shared failure
    if delay > 0:
        sup.pending_relaunch = relaunch
        sup.backoff_until = now + delay
        sup.set_state(S.BACKOFF, f"relaunch in {delay:.1f}s ({relaunch.reason})")
        return
    if sup.state not in (S.RESTARTING,):
        sup.set_state(S.RESTARTING, relaunch.reason)
    sup.launch(relaunch.reason, relaunch.rollback_to_step, relaunch.incident_id)


def fail_budget(sup: RelaunchRun, symptom: Symptom, reason: str) -> None:
    iid = sup.incidents.incident(symptom, sup.last_step or 0, Severity.critical, reason,
                        {"restarts_last_hour": len(sup.counters.restarts),
                         "restarts_without_progress": sup.counters.restarts_without_progress,
                         "latest_checkpoint": sup.latest_ckpt[0] if sup.latest_ckpt else None})
    sup.incidents.stopped(iid, reason)
    sup.fail(reason)


def probe_run_dir(run_dir: Path) -> None:
    """Write, fsync and remove a small file in the run directory; raises the OSError a full or read-only
    disk gives (ENOSPC, EDQUOT, EROFS) before the launch changes any state."""
    if not run_dir.is_dir():
        return
    probe = run_dir / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * PROBE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def own_write_failed(sup: RelaunchRun, exc: BaseException, relaunch: Relaunch) -> bool:
    """The daemon could not write to the run directory before a launch. Read-only: a clear incident and a
    clean stop, nothing deleted. Full: prune what is prunable, then retry the launch later with a growing
    delay, OWN_WRITE_RETRIES times at most, then FAILED with a disk_full incident. Returns False."""


    code = disk.errno_of(exc) or "unknown"  # the OSError itself, or the cause of a LaunchError
    sup.counters.own_write_failures += 1
    n = sup.counters.own_write_failures
    log.warning("daemon write to the run directory failed", errno=code,
                                              error=repr(exc), tries=n, run_dir=str(sup.run_dir))
    sup.say(f"  the daemon cannot write to {sup.run_dir}: {code} ({exc}); try {n}/{OWN_WRITE_RETRIES}")
    evidence = {"errno": code, "error": str(exc)[:500], "path": getattr(exc.__cause__ or exc, "filename", None), "tries": n,
                "relaunch_reason": relaunch.reason}
    if code == disk.READ_ONLY:
        disk.stop_read_only(sup, str(sup.run_dir), evidence)
        return False
    if n == 1 or n >= OWN_WRITE_RETRIES:
        iid = sup.incidents.incident(Symptom.disk_full, sup.last_step or 0, Severity.critical,
                            f"the daemon's own write to the run directory failed ({code}); "
                            + ("retries exhausted" if n >= OWN_WRITE_RETRIES else "pruning and retrying later"),
                            evidence, attempt=sup.attempt + 1)
        if n >= OWN_WRITE_RETRIES:
            reason = (f"the daemon could not write to {sup.run_dir} ({code}) in {n} tries; nothing was deleted "
                      f"beyond prunable checkpoints: free space there, then start the run again")
            sup.incidents.stopped(iid, reason)
            sup.fail(reason)
            return False
        out = disk.prune_for_space(sup)
        sup.incidents.action(iid, ActionKind.prune, {"rung": "prune_and_retry", "removed": out.removed,
                                            "bytes_freed": out.freed_bytes, "bytes_free_after": out.free_bytes},
                    {}, ApplyMode.none)
        sup.store.update_incident_status(iid, IncidentStatus.remediating, "retrying the launch later")
    delay = min(sup.dcfg.backoff_max_s, max(sup.dcfg.backoff_base_s, 1.0) * 2 ** (n - 1))
    sup.pending_relaunch = relaunch
    sup.backoff_until = sup.steady.now() + delay
    if sup.state == S.PAUSED:
        sup.pending_relaunch, sup.backoff_until = None, None  # an operator resume: they can resume again
        return False
    sup.set_state(S.BACKOFF, f"relaunch in {delay:.1f}s: the daemon's write to the run directory failed ({code})")
    return False
