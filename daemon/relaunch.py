"""The next attempt: the `Relaunch` request, the restart budget (`Counters`: restarts per hour, restarts
without checkpoint progress, consecutive early deaths) and the backoff before relaunching."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom

if TYPE_CHECKING:
    from ulyssesd.daemon.supervisor import Supervisor

S = RunState


@dataclass
class Relaunch:
    """What to do once the current attempt has exited: start the next one."""

    reason: str
    incident_id: int | None = None
    rollback_to_step: int | None = None
    counts_against_budget: bool = True


@dataclass
class Counters:
    """Restart budget bookkeeping (checked against remediation.max_restarts_per_hour / no_progress_restarts)."""

    restarts: list[float] = field(default_factory=list)  # wall times of relaunches (budget per hour)
    restarts_without_progress: int = 0
    consecutive_early_deaths: int = 0
    ckpt_step_at_last_restart: int | None = None


def schedule_relaunch(sup: Supervisor, relaunch: Relaunch, early: bool = False) -> None:
    """Budget checks, then relaunch now or after a backoff."""
    now = sup.os.time()
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
        sup._set_state(S.BACKOFF, f"relaunch in {delay:.1f}s ({relaunch.reason})")
        return
    if sup.state not in (S.RESTARTING,):
        sup._set_state(S.RESTARTING, relaunch.reason)
    sup._launch(relaunch.reason, relaunch.rollback_to_step, relaunch.incident_id)


def fail_budget(sup: Supervisor, symptom: Symptom, reason: str) -> None:
    iid = sup._incident(symptom, sup.last_step or 0, Severity.critical, reason,
                        {"restarts_last_hour": len(sup.counters.restarts),
                         "restarts_without_progress": sup.counters.restarts_without_progress,
                         "latest_checkpoint": sup.latest_ckpt[0] if sup.latest_ckpt else None})
    sup._action(iid, ActionKind.stop, {"reason": reason}, {}, ApplyMode.none)
    sup.store.update_incident_status(iid, IncidentStatus.failed, reason)
    sup._fail(reason)
