"""A warm standby of the next attempt (`[restart] standby = true`, off by default).

Once an attempt trains (its first step seen), the daemon starts the NEXT attempt's launcher in standby: same
launcher, its own free rendezvous port, rank program `--standby-gate {run_dir}/standby/gate-N.json` instead of
`--config`. Its ranks import torch/DeepSpeed/the model, create their CUDA context, preload their checkpoint
shards, and wait (training/standby.py). When an exit leads to a relaunch, `take()` (called by the launch path
in place of a cold spawn) checks the standby, confirms the old attempt's processes are gone, and opens the gate
with the config version to use; the attempt is then recorded as usual, its command holding `--standby-gate`.

A standby is NOT used (the relaunch is cold, and the state transition's reason says why) when it died, when it
is for another attempt number, has fewer live ranks than the world size, or was started for another world
size, launcher environment (a remediation's allocator setting must reach a fresh process) or device.
Bounded: at most one standby per run; `standby_max_failures` deaths (a gate timeout is not one) and the daemon
stops starting them; the standby's own gate wait is bounded (`standby_timeout_s`, exit 5, then replaced).
Standbys are killed when the run ends, stops, pauses or the daemon detaches, and a new daemon kills the one a
dead daemon left (by the next attempt's environment marker) before it starts its own.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.core.files import _read_tail
from ulyssesd.daemon.core.states import TERMINAL
from ulyssesd.daemon.core.termination import Termination
from ulyssesd.daemon.host import disk
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import JobHandle
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job.launcher import LaunchPlan, build_launch, job_marker
from ulyssesd.daemon.ports import HostSide, JobConfig, RunFiles
from ulyssesd.daemon.spec import LauncherSection, RestartSection
from ulyssesd.daemon.store.enums import RunState

log = get_logger("ulyssesd.standby")
S = RunState

STANDBY_DIR = "standby"
#: The job's exit code for "my gate did not open in time" (training/standby.py EXIT_STANDBY).
EXIT_STANDBY = 5
#: How long the daemon waits for a killed standby, or for the old attempt's processes, to be gone.
GONE_WAIT_S = 10.0
GONE_POLL_S = 0.1
# The job side's environment (training/standby.py; the daemon does not import the training package here).
TIMEOUT_ENV = "ULYSSESD_STANDBY_TIMEOUT_S"
PRELOAD_ENV = "ULYSSESD_STANDBY_PRELOAD"
CKPT_DIR_ENV = "ULYSSESD_STANDBY_CKPT_DIR"
DEVICE_ENV = "ULYSSESD_STANDBY_DEVICE"


class StandbyRun(RunFiles, JobConfig, HostSide, Protocol):
    """What keeping the next attempt warm uses of the run."""

    state: RunState
    term: Termination | None
    last_exiting: str | None  # the job's 'exiting' event, once it said it is ending
    attempt_progress: bool  # the current attempt has made progress (steps after its resume point)


def effective_launcher(sup: StandbyRun) -> LauncherSection:
    """The spec's launcher with the environment remediation added (`launcher.env.*` patches)."""
    launcher = sup.spec.launcher
    if sup.launch_env:
        launcher = launcher.model_copy(update={"env": {**launcher.env, **{
            k: str(v) for k, v in sup.launch_env.items() if v is not None}}})
    return launcher


@dataclass(frozen=True)
class LaunchKey:
    """What a standby was started for; a cold launch now with another key must not reuse it."""

    world_size: int
    env: tuple[tuple[str, str], ...]
    device: str

    def mismatch(self, now: LaunchKey) -> str | None:
        if now.world_size != self.world_size:
            return f"it was started for world size {self.world_size}, the relaunch needs {now.world_size}"
        if now.env != self.env:
            changed = sorted({k for k, _ in set(now.env) ^ set(self.env)})
            return f"the launcher environment changed since it started ({', '.join(changed)})"
        if now.device != self.device:
            return f"train.device changed from {self.device!r} to {now.device!r}"
        return None


def launch_key(sup: StandbyRun) -> LaunchKey:
    launcher = effective_launcher(sup)
    return LaunchKey(launcher.world_size, tuple(sorted(launcher.env.items())),
                     str(jc.get_dotted(sup.config, "train.device", "auto")))


@dataclass
class Standby:
    """One standby: the next attempt's launcher, waiting at its gate."""

    attempt: int
    job: JobHandle
    plan: LaunchPlan
    gate: Path
    key: LaunchKey
    started_mono: float


@dataclass(frozen=True)
class Takeover:
    """What `take()` gives the launch path: the promoted standby's job and plan, or nothing (launch cold);
    `note` is appended to the launch's reason (stored with the STARTING transition)."""

    job: JobHandle | None = None
    plan: LaunchPlan | None = None
    note: str = ""


class StandbyKeeper:
    """The daemon's side of warm standbys (see the module docstring); driven from the supervisor's loop."""

    def __init__(self, cfg: RestartSection) -> None:
        self.cfg = cfg
        self.current: Standby | None = None
        self.failures = 0  # standbys that died (timeouts excluded) in this daemon's life
        self.swept = False
        self.watched: tuple[JobHandle, tuple[str, str]] | None = None  # the running attempt, for take()
        self.last_note = ""  # why the newest relaunch was cold (tests, logs)
        self.lost: str | None = None  # why the last standby went away before a relaunch could use it

    def describe(self, sup: StandbyRun) -> dict[str, Any] | None:
        """For `status`: the standby now (None without one), e.g. {"attempt": 3, "pid": 123, "ready_ranks": 2,
        "warm_for_s": 41.0}; `ready_ranks` counts the ranks that finished warming up."""
        sb = self.current
        if sb is None:
            return None
        return {"attempt": sb.attempt, "pid": sb.job.pid, "ready_ranks": len(self._ready(sup.run_dir, sb.attempt)),
                "warm_for_s": round(sup.os.monotonic() - sb.started_mono, 1)}

    # ------------------------------------------------------------------------------- the loop
    def tick(self, sup: StandbyRun) -> None:
        if not self.cfg.standby:
            return
        if not self.swept:
            self.swept = True
            self._sweep_left_behind(sup)
        if sup.state in TERMINAL or sup.state in (S.STOPPING, S.PAUSED):
            self.stop(sup, f"the run is {sup.state.value}")
            return
        if sup.job is not None:
            self.watched = (sup.job, job_marker(sup.run_id, sup.run_dir, sup.attempt))
        if self.current is not None:
            self._check(sup, self.current)
        if self.current is None and self._due(sup):
            self._start(sup)

    def _due(self, sup: StandbyRun) -> bool:
        return (sup.state == S.RUNNING and sup.attempt_progress and sup.job is not None and sup.term is None
                and sup.last_exiting is None and self.failures < self.cfg.standby_max_failures
                and sup.os.is_alive(sup.job))  # not beside an attempt that has just ended

    def _start(self, sup: StandbyRun) -> None:
        n = sup.attempt + 1
        gate = sup.run_dir / STANDBY_DIR / f"gate-{n}.json"
        self._clear_files(sup.run_dir, n)
        # Its own rendezvous: a fixed master_port would collide with the attempt that is training.
        launcher = effective_launcher(sup).model_copy(update={"master_port": None})
        plan = build_launch(launcher, run_id=sup.run_id, run_dir=sup.run_dir, attempt=n,
                            config_version=sup.config_version, job=sup.spec.job_section, standby_gate=gate)
        plan.env.update({TIMEOUT_ENV: str(self.cfg.standby_timeout_s),
                         PRELOAD_ENV: "1" if self.cfg.standby_preload else "0",
                         CKPT_DIR_ENV: str(sup.ckpt_dir),
                         DEVICE_ENV: str(jc.get_dotted(sup.config, "train.device", "auto"))})
        try:
            job = sup.os.spawn(plan.argv, plan.env, plan.cwd, plan.log_path)
        except OSError as exc:
            self.failures += 1
            log.warning("standby could not be started", attempt=n, error=repr(exc), failures=self.failures)
            return
        self.current = Standby(n, job, plan, gate, launch_key(sup), sup.os.monotonic())
        self.lost = None
        log.info("standby started", attempt=n, pid=job.pid, config_version=sup.config_version)
        sup.say(f"  warm standby for attempt {n} started (pid {job.pid})")

    def _check(self, sup: StandbyRun, sb: Standby) -> None:
        """A standby that died is cleaned up now (its files would shadow a cold attempt's), and counted."""
        if sb.attempt != sup.attempt + 1 and sup.job is not None:
            self.current = None
            self._discard(sup, sb, f"it is for attempt {sb.attempt}, the next is {sup.attempt + 1}")
            return
        status = sup.os.exit_status(sb.job, sb.plan.exit_file)
        if status is None:
            return
        self.current = None
        tail = _read_tail(sb.plan.log_path)
        timed_out = status.returncode == EXIT_STANDBY or EXIT_STANDBY in disk.rank_exit_codes(tail)
        if not timed_out:
            self.failures += 1
        log.warning("standby ended", attempt=sb.attempt, status=status.describe(), timed_out=timed_out,
                    failures=self.failures)
        self.lost = "its gate timed out" if timed_out else f"the standby died ({status.describe()})"
        self._discard(sup, sb, self.lost)

    # ------------------------------------------------------------------------------ promotion
    def take(self, sup: StandbyRun, plan: LaunchPlan) -> Takeover:
        """The launch path's hook, after the attempt number was advanced: promote the standby for this
        attempt, or say why the launch is cold. Never raises for a standby problem (a cold launch follows)."""
        if not self.cfg.standby or sup.attempt <= 1:
            return Takeover()
        sb, self.current = self.current, None
        if sb is None:
            return self._cold(self.lost or "no warm standby was ready")
        why = self._unusable(sup, sb)
        if why is None and not self._old_attempt_gone(sup):
            why = "the previous attempt's processes are still alive"
        if why is not None:
            if sup.os.exit_status(sb.job, sb.plan.exit_file) is not None:
                self.failures += 1
            self._discard(sup, sb, why)
            return self._cold(why)
        config_path = sup.run_dir / "configs" / f"v{sup.config_version}.json"
        try:
            jc.write_json_atomic(sb.gate, {"v": 1, "attempt": sup.attempt, "config": str(config_path),
                                           "config_version": sup.config_version, "opened": sup.os.time()})
        except OSError as exc:
            self._discard(sup, sb, f"its gate could not be written: {exc}")
            return self._cold(f"its gate could not be written ({disk.errno_of(exc) or exc})")
        warm_s = round(sup.os.monotonic() - sb.started_mono, 1)
        log.info("standby promoted", attempt=sup.attempt, pid=sb.job.pid, config_version=sup.config_version,
                 warm_for_s=warm_s, ready_ranks=len(self._ready(sup.run_dir, sb.attempt)))
        sup.say(f"  warm standby promoted to attempt {sup.attempt} (pid {sb.job.pid}, warm for {warm_s}s)")
        self.last_note = ""
        return Takeover(sb.job, sb.plan, "; warm standby promoted")

    def _cold(self, why: str) -> Takeover:
        self.last_note = why
        log.info("cold launch instead of a standby", reason=why)
        return Takeover(note=f"; cold launch (standby not used: {why})")

    def _unusable(self, sup: StandbyRun, sb: Standby) -> str | None:
        status = sup.os.exit_status(sb.job, sb.plan.exit_file)
        if status is not None:
            return f"the standby died ({status.describe()})"
        if sb.attempt != sup.attempt:
            return f"the standby is for attempt {sb.attempt}, the relaunch is attempt {sup.attempt}"
        mismatch = sb.key.mismatch(launch_key(sup))
        if mismatch is not None:
            return mismatch
        ranks = sup.os.rank_pids(sb.job, sup.spec.launcher.module, sb.plan.marker)
        if len(ranks) < sb.key.world_size:
            return f"the standby has {len(ranks)} of {sb.key.world_size} ranks alive"
        return None

    def _old_attempt_gone(self, sup: StandbyRun) -> bool:
        """The attempt that ended must hold no process (GPU memory, ports) before its successor starts: the
        exit path SIGKILLed its survivors; confirm, bounded."""
        if self.watched is None:
            return True
        job, marker = self.watched
        return self._wait_gone(sup, job, marker)

    # ------------------------------------------------------------------------------ ending
    def stop(self, sup: StandbyRun, reason: str) -> None:
        """Kill the standby (run ended/stopped/paused, daemon leaving); a no-op without one."""
        sb, self.current = self.current, None
        if sb is not None:
            self._discard(sup, sb, reason)

    def _discard(self, sup: StandbyRun, sb: Standby, why: str) -> None:
        pids = sup.os.job_pids(sb.job, sb.plan.marker)
        if pids:
            sup.os.signal_pids(pids, signal.SIGKILL)  # nothing to save: it never trained
        gone = self._wait_gone(sup, sb.job, sb.plan.marker)
        sup.os.exit_status(sb.job, sb.plan.exit_file)  # reap the wrapper
        # Its log and exit file have the next attempt's names: set the log aside, drop the exit file, so a
        # cold attempt of that number starts clean.
        if sb.plan.log_path.exists():
            try:
                sb.plan.log_path.rename(sb.plan.log_path.with_name(
                    f"standby-{sb.attempt}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(sup.os.time()))}.log"))
            except OSError as exc:
                log.warning("standby log not set aside", error=repr(exc))
        self._clear_files(sup.run_dir, sb.attempt, exit_file=sb.plan.exit_file)
        log.info("standby stopped", attempt=sb.attempt, pid=sb.job.pid, reason=why, gone=gone)
        sup.say(f"  warm standby for attempt {sb.attempt} stopped: {why}")

    def _wait_gone(self, sup: StandbyRun, job: JobHandle, marker: tuple[str, str]) -> bool:
        deadline = sup.os.monotonic() + GONE_WAIT_S
        while True:
            left = sup.os.job_pids(job, marker)
            if not left:
                return True
            if sup.os.monotonic() >= deadline:
                log.warning("processes still alive", pids=left)
                return False
            sup.os.signal_pids(left, signal.SIGKILL)
            sup.os.sleep(GONE_POLL_S)

    def _sweep_left_behind(self, sup: StandbyRun) -> None:
        """A standby a dead daemon left (the next attempt's marker, no attempt row yet): kill it."""
        if not sup.run_id:
            return
        marker = job_marker(sup.run_id, sup.run_dir, sup.attempt + 1)
        pids = sup.os.job_pids(JobHandle(0, 0.0), marker)  # no live root: the marker scan alone
        if pids:
            sup.os.signal_pids(pids, signal.SIGKILL)
            log.warning("killed a standby left by a previous daemon", pids=pids, attempt=sup.attempt + 1)
            sup.say(f"  killed a warm standby left by a previous daemon: {pids}")
            self._wait_gone(sup, JobHandle(0, 0.0), marker)
            self._clear_files(sup.run_dir, sup.attempt + 1,
                              exit_file=sup.run_dir / "attempts" / f"{sup.attempt + 1}.exit")

    @staticmethod
    def _clear_files(run_dir: Path, attempt: int, exit_file: Path | None = None) -> None:
        d = run_dir / STANDBY_DIR
        paths = [d / f"gate-{attempt}.json", *d.glob(f"attempt-{attempt}-rank-*.ready")]
        if exit_file is not None:
            paths.append(exit_file)
        for p in paths:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("standby file not removed", path=str(p), error=repr(exc))

    @staticmethod
    def _ready(run_dir: Path, attempt: int) -> list[dict[str, Any]]:
        out = []
        for p in sorted((run_dir / STANDBY_DIR).glob(f"attempt-{attempt}-rank-*.ready")):
            try:
                data = json.loads(p.read_text()[:4096])
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                out.append(data)
        return out
