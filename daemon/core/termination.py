"""Ending one attempt without blocking the loop: the `Termination` record and its phases.

Stack dump (SIGUSR1 to the ranks, wait, collect the per-rank dump files) -> SIGTERM to the ranks ->
SIGKILL to the job's processes after the grace -> SIGKILL to the wrapper if the exit is still not recorded.
The supervisor owns *when* a termination starts; what follows the exit is the termination's one typed
`TerminationPlan` (`Termination.plan`); this module owns the phases, one per tick, and takes the OS seam
and paths it needs as arguments.

The rank watch (`RankWatch`) notices a training rank that is gone while its launcher still runs. When one
rank dies (SIGKILL, segfault, a Python exception), its peers block in their next collective and
the launcher does not notice them: torchrun SIGTERMs the survivors and waits 30 s before it SIGKILLs them
(its `_close(timeout=30)`), and a rank blocked inside NCCL cannot run its SIGTERM handler. Measured on
2×H200 (bench/RESULTS.md) that wait was 32 s of a 79 s MTTR. The daemon sees the lost rank itself and
tells two cases apart:

- **some ranks still run**: they may be stuck in a collective with the dead one. A normal exit (all ranks
  leave within milliseconds of each other after the final collective; the job's `exiting` event, which stops
  the watch, comes right before) and an agreed refusal (exit 2/3/4, decided together) end every rank at once,
  so the attempt gets `grace_s` (default 1 s) for its other ranks to follow, then it is ended;
- **every rank is gone**: nothing can be stuck; the launcher is about to exit with the job's code (torchrun's
  failure report in the log, the refusal's exit 2 or 3), which is what decides what happens next. It gets
  LAUNCHER_EXIT_WAIT_S before the daemon ends it (a launcher that lingers without ranks).

While a loss is pending, and while an attempt is being killed, the loop ticks every URGENT_TICK_S instead of
`tick_s` (`tick_sleep_s`): the grace, the SIGKILL and the exit are seen within 0.1 s, not one tick each
(a 1 s tick made a lost rank cost 3-5 s to detect: scan, 3 s grace, SIGTERM tick, SIGKILL tick, exit tick).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ulyssesd.daemon.core.files import _read_tail, _size
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import JobHandle, OSInterface

log = get_logger("ulyssesd.supervisor")

STACKS_MAX_BYTES = 64 * 1024
#: Every rank of the attempt gone while its launcher still runs: how long the launcher may take to exit on its
#: own (torchrun notices within 0.1 s; its teardown and failure report take well under a second) before the
#: daemon ends it.
LAUNCHER_EXIT_WAIT_S = 10.0
#: The loop's sleep while a lost rank waits out its grace or an attempt is being killed (the tick is 1 s).
URGENT_TICK_S = 0.1


class Then(Enum):
    """What the supervisor does once the attempt has exited."""

    CRASH = "crash"  # nothing was asked for: the exit is an unrequested one (a crash; the rank watch ends so)
    RELAUNCH = "relaunch"  # start the next attempt, as the plan's `relaunch` says
    STOP = "stop"  # an operator stop: the run ends STOPPED
    PAUSE = "pause"  # an operator pause: the run waits PAUSED for a resume
    FAIL = "fail"  # the playbook said stop: the run ends FAILED with the termination's reason


@dataclass
class Relaunch:
    """What to do once the current attempt has exited: start the next one."""

    reason: str
    incident_id: int | None = None
    rollback_to_step: int | None = None
    counts_against_budget: bool = True


@dataclass(frozen=True)
class TerminationPlan:
    """What follows an attempt's exit: the one owner of that fact (a `Relaunch` exactly when RELAUNCH)."""

    then: Then
    relaunch: Relaunch | None = None  # how to relaunch (reason, incident, rollback, budget) when then=RELAUNCH

    def __post_init__(self) -> None:
        if (self.then is Then.RELAUNCH) != (self.relaunch is not None):
            raise ValueError(f"a {self.then.value} plan {'needs' if self.relaunch is None else 'takes no'} Relaunch")

    @classmethod
    def relaunching(cls, relaunch: Relaunch) -> TerminationPlan:
        return cls(Then.RELAUNCH, relaunch)

    def __str__(self) -> str:
        return f"relaunch ({self.relaunch.reason})" if self.relaunch is not None else self.then.value


#: The plan of an exit nobody asked for (no termination pending, or the rank watch's).
UNREQUESTED = TerminationPlan(Then.CRASH)


@dataclass
class Termination:
    """A pending shutdown of the current attempt, advanced one phase per tick (never blocks the loop)."""

    reason: str
    plan: TerminationPlan  # what follows the exit; replaced (not edited) when a stop overrides a restart
    started: float
    grace_s: float
    dump_stacks: bool = False
    dump_until: float = 0.0
    log_offset: int = 0
    termed_at: float | None = None
    killed_at: float | None = None
    wrapper_killed: bool = False
    hung_cut: bool = False  # the grace was cut to hang_grace_s: the job was found hung while stopping (hung_stop.py)
    on_stacks: Callable[[str], None] | None = None
    stack_offsets: dict[str, int] = field(default_factory=dict)  # per-rank dump file -> size before SIGUSR1
    per_rank_stacks: dict[int, str] = field(default_factory=dict)  # what each rank wrote after SIGUSR1
    with_launcher: bool = False  # SIGTERM the launcher with its ranks: one that restarts workers must not (coexist)


def request_stack_dumps(t: Termination, os_: OSInterface, job: JobHandle, module: str,
                        marker: tuple[str, str] | None, files: dict[int, Path], now: float, wait_s: float,
                        say: Callable[[str], None]) -> None:
    """Remember where each dump file ends now, SIGUSR1 the ranks, and wait `wait_s` for their dumps."""
    t.stack_offsets = {str(f): _size(f) for f in files.values()}
    ranks = os_.rank_pids(job, module, marker)
    sent = os_.signal_pids(ranks, signal.SIGUSR1)
    t.dump_until = now + wait_s
    log.info("stack dump requested", pids=sent)
    say(f"  SIGUSR1 (stack dump) -> ranks {sent}")


def collect_stacks(t: Termination, files: dict[int, Path], log_path: Path, stacks_dir: Path, attempt: int) -> str:
    """The dumps written since SIGUSR1: per-rank files (rank -> file, the job's), copied into the attempt log
    under a header per rank; a job that wrote none (older job, stderr fallback) -> the log since the request."""
    per_rank: dict[int, str] = {}
    for rank, f in files.items():
        text = _read_tail(f, STACKS_MAX_BYTES // 2, start=t.stack_offsets.get(str(f), 0))
        if text.strip():
            per_rank[rank] = text
    t.per_rank_stacks = per_rank
    if not per_rank:
        return _read_tail(log_path, STACKS_MAX_BYTES, start=t.log_offset)
    combined = "".join(f"=== rank {r} stack dump ({stacks_dir}) ===\n{text}\n"
                       for r, text in sorted(per_rank.items()))
    try:
        with open(log_path, "a") as fh:  # the log stays the one place an operator reads
            fh.write(f"\n[ulyssesd] stack dumps of attempt {attempt} ({t.reason}):\n{combined}")
    except OSError as exc:
        log.warning("could not append stack dumps to the log", error=repr(exc))
    return combined


def advance(t: Termination, os_: OSInterface, job: JobHandle, module: str, marker: tuple[str, str], now: float,
            collect: Callable[[], str], say: Callable[[str], None]) -> None:
    """One phase per call: collect the stack dumps once their wait is over, then SIGTERM, then SIGKILL."""
    if t.dump_stacks and t.termed_at is None:
        if now < t.dump_until:
            return
        stacks = collect()
        if t.on_stacks is not None:
            t.on_stacks(stacks)
    if t.termed_at is None:
        ranks = os_.rank_pids(job, module, marker)
        targets = ranks if ranks and not t.with_launcher else [p for p in os_.job_pids(job, marker) if p != job.pid]
        sent = os_.signal_pids(targets, signal.SIGTERM)
        t.termed_at = now
        say(f"  SIGTERM -> {sent} ({t.reason}); SIGKILL after {t.grace_s:.0f}s")
        return
    if t.killed_at is None and now - t.termed_at >= t.grace_s:
        pids = [p for p in os_.job_pids(job, marker) if p != job.pid]
        sent = os_.signal_pids(pids, signal.SIGKILL)
        t.killed_at = now
        log.warning("grace over, SIGKILL", pids=sent, reason=t.reason)
        say(f"  grace over: SIGKILL -> {sent}")
        return
    if t.killed_at is not None and not t.wrapper_killed and now - t.killed_at >= 5.0:
        # The wrapper should have recorded the exit by now; if not, take it down too.
        os_.signal_pids(os_.job_pids(job, marker), signal.SIGKILL)
        t.wrapper_killed = True


@dataclass
class RankWatch:
    """Per attempt: the rank pids seen alive, and since when each lost one has been gone."""

    grace_s: float  # a rank may be gone this long before the attempt is declared broken
    every_s: float  # how often to look (a process-table scan)
    seen: set[int] = field(default_factory=set)
    lost_since: dict[int, float] = field(default_factory=dict)
    next_check: float = 0.0
    live: list[int] = field(default_factory=list)  # the rank pids the last scan found (the status answer's)

    @property
    def pending(self) -> bool:
        """A rank is gone and its grace is running: scan every tick, and tick fast (`tick_sleep_s`)."""
        return bool(self.lost_since)

    def due(self, now: float) -> bool:
        if now < self.next_check and not self.pending:
            return False
        self.next_check = now + self.every_s
        return True

    def observe(self, now: float, live: list[int]) -> list[int] | None:
        """Feed the live rank pids; returns the lost pids once the first has been gone for `grace_s` while
        other ranks still run, or for LAUNCHER_EXIT_WAIT_S when none is left (see the module docstring)."""
        alive = set(live)
        self.live = sorted(alive)
        for pid in self.seen - alive:
            self.lost_since.setdefault(pid, now)
        for pid in alive & self.lost_since.keys():
            del self.lost_since[pid]  # seen again: a scan that missed it (its /proc entry unreadable), not a loss
        self.seen |= alive
        if not self.lost_since:
            return None
        wait = self.grace_s if alive else max(self.grace_s, LAUNCHER_EXIT_WAIT_S)
        if now - min(self.lost_since.values()) >= wait:
            return sorted(self.lost_since)
        return None


def tick_sleep_s(tick_s: float, term: Termination | None, watch: RankWatch | None) -> float:
    """The loop's sleep: URGENT_TICK_S while a lost rank's grace runs, or while an attempt is being killed (a
    no-grace termination, or past its SIGKILL) so that its exit is handled at once; `tick_s` otherwise (a
    stop's long grace, the stack-dump wait and normal training tick at the normal pace)."""
    killing = term is not None and (term.grace_s == 0.0 or term.killed_at is not None)
    if killing or (term is None and watch is not None and watch.pending):
        return min(tick_s, URGENT_TICK_S)
    return tick_s
