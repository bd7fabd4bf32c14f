"""The supervisor: one run, one thread, one tick.

Each `tick()` does, in order: drain queued signals/commands → run due scheduler jobs → read new telemetry
and feed the remediation engine → the engine's clock check (hang) → advance a pending termination
(stack dump → SIGTERM → SIGKILL) → notice the attempt's exit and decide (complete / relaunch / backoff /
fail) → launch when a backoff is over → sd_notify. Each step runs through one guard (`StepGuard`,
core/housekeeping.py): its exception is logged once per distinct error, recorded as an incident and bounded
(`[daemon] step_error_limit` in a row end the run FAILED), never the daemon's end. Signal handlers and the
control socket only enqueue or answer from the same thread; nothing else mutates supervisor state.

The run's state machine is `ulyssesd.daemon.core.states`; every transition, attempt, incident, action and
config version goes to the store (SQLite), which is also what makes re-adoption exact: the telemetry
cursor is persisted only after the records before it were acted upon, and incidents are deduplicated by
(run, attempt, symptom, step), so a daemon killed at any point neither loses nor doubles an incident.

The tick's parts live in `core/`, one concept each, and take the supervisor as `sup`, typed by a Protocol of
their own that names what they use (built from `daemon/ports.py`; no part imports this class, and every
clock read goes through `self.os`, the OS seam, or `daemon/clock.py`), using only its public operations
(`set_state`, `fail`, `stop_run`, `launch`, `begin_termination`, `new_config_version`, `alert`) and its
collaborators: `incidents` (`core/incident_log.py`: every incident and action, settled and
verified there) and `term` (`core/termination.py`: the phases, and the typed `TerminationPlan` that says
what follows the exit). `core/startup.py` creates or re-adopts the run, `core/launch.py` starts an attempt
(checkpoint choice, preflight, spawn), `core/decisions.py` runs the telemetry -> engine -> decisions path,
`core/exits.py` an attempt's exit, `core/relaunch.py` the restart budget and backoff, `core/commands.py`
the control-socket requests and signals, `core/housekeeping.py` the periodic jobs and the store's health
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ulyssesd.daemon.coexist.watch import InnerRestartWatch
from ulyssesd.daemon.core import commands, decisions, exits, housekeeping, startup, termination
from ulyssesd.daemon.core import launch as launching
from ulyssesd.daemon.core.files import _size
from ulyssesd.daemon.core.housekeeping import LoopScheduler, StepGuard
from ulyssesd.daemon.core.incident_log import IncidentLog, Position
from ulyssesd.daemon.core.relaunch import Counters, Relaunch
from ulyssesd.daemon.core.states import TERMINAL, TRANSITIONS, check_transition, transition_reason
from ulyssesd.daemon.core.termination import UNREQUESTED, RankWatch, Termination, TerminationPlan, Then
from ulyssesd.daemon.host import gpu_health
from ulyssesd.daemon.host.logging import bind_run, get_logger
from ulyssesd.daemon.host.process import ExitStatus, JobHandle, OSInterface
from ulyssesd.daemon.job import checkpoint_watch, slurm_supervise
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job.launcher import job_marker
from ulyssesd.daemon.job.standby import StandbyKeeper
from ulyssesd.daemon.safety import attempt_log, hung_stop, liveness, store_health
from ulyssesd.daemon.spec import RunSpec, engine_job_values
from ulyssesd.daemon.store.enums import IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.telemetry import log_source
from ulyssesd.daemon.telemetry.engine_snapshot import EngineSnapshots
from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader
from ulyssesd.remediation.records import StepRecord, finite_or_none
from ulyssesd.training.control import STACK_DUMP_DIR, stack_dump_files

log = get_logger("ulyssesd.supervisor")
S = RunState


class Supervisor:
    def __init__(self, spec: RunSpec, store: Any, os_: OSInterface, *, run_id: str | None = None,
                 engine_factory: Callable[[RunSpec, dict], Any] | None = None,
                 notifier: Any = None, scheduler: LoopScheduler | None = None,
                 say: Callable[[str], None] | None = None,
                 preflight: Callable[[dict[str, Any]], str | None] | None = None,
                 metrics: Any = None, alerts: Any = None,
                 run_lock: Callable[[Path, str], None] | None = None, gpu_reader: Any = None) -> None:
        self.spec = spec
        # The per-run lock (host/locks.py), taken once the run is known; None in in-process tests (a dead daemon).
        self.run_lock = run_lock
        self.store = store
        self.os = os_
        self.notifier = notifier
        self.metrics = metrics  # ulyssesd.daemon.host.metrics.Metrics (optional, off by default)
        self.alerts = alerts  # ulyssesd.daemon.host.alerts.AlertSender (optional): escalations and failures
        self.scheduler = scheduler
        self.say = say or (lambda msg: None)
        # Every incident and action goes through here; it settles and verifies them (core/incident_log.py).
        self.incidents = IncidentLog(store, self._position, alert=self.alert, say=self.say)
        self.gpu_health = gpu_health.build(spec.gpu_health, spec.launcher.kind, reader=gpu_reader, say=self.say,
                                           report=gpu_health.incident_reporter(self.incidents))
        # The planner's check of a config (None = fits, else why not) before each relaunch (cli.py: the first).
        self.preflight = preflight
        self.engine_factory = engine_factory or default_engine_factory
        self.dcfg = spec.daemon
        self.requested_run_id = run_id
        self.run_id: str = ""
        self.run_dir: Path = Path()
        self.state: RunState = S.STARTING
        self.attempt = 0
        self.config_version = 1
        self.config: dict[str, Any] = {}
        self.launch_env: dict[str, str] = {}  # launcher.env.* overrides from remediation (e.g. allocator conf)
        self.job: JobHandle | None = None
        self.reader: TelemetryReader | None = None
        self.snapshots = EngineSnapshots()  # the engine's learned state, saved with the cursor
        self.record_errors = 0  # telemetry records whose handling raised (logged and skipped)
        self.engine: Any = None
        self.term: Termination | None = None  # the pending shutdown of the attempt and what follows its exit
        self.backoff_until: float | None = None
        self.pending_relaunch: Relaunch | None = None
        self.counters = Counters()
        self.standby = StandbyKeeper(spec.restart)  # the next attempt kept warm ([restart] standby)
        self.inner = InnerRestartWatch.of(spec.launcher, store, lambda: self.run_id)  # in-job restarts (coexist/)
        self.events: collections.deque[tuple[str, Any]] = collections.deque()
        self.detach = False
        self.attempt_started_mono = 0.0
        self.attempt_progress = False
        self.last_step: int | None = None
        self.last_step_record: StepRecord | None = None
        self.last_exiting: str | None = None
        self.attempt_resume_step: int | None = None  # the step of the checkpoint a command job's attempt was given
        # (label, evidence) the hang path read from the stack dumps; the attempt's diagnosis when it ends.
        self.hang_diagnosis: tuple[str | None, list[str]] | None = None
        self.rank_watch = RankWatch(self.dcfg.rank_exit_grace_s, self.dcfg.rank_watch_every_s)
        self.rank_lost: dict[str, Any] | None = None  # evidence when the rank watch ended the attempt
        self.save_failures: dict[int, dict[str, Any]] = {}  # attempt -> its job's checkpoint_save_failed event
        self.latest_ckpt: tuple[str, int] | None = None
        self.known_good_marked: set[str] = set()
        # A command job's checkpoint dir, watched (job/checkpoint_watch.py), and its open "none recognised" incident.
        self.ckpt_watch: Any = None
        self.ckpt_watch_incident: int | None = None
        self.ckpt_watch_warned = False
        self.ready_sent = False
        self.started_wall = self.os.time()
        # Every tick step runs through it: a bug in one is logged, recorded and bounded (core/housekeeping.py).
        self.guard = StepGuard(self, self.dcfg.step_error_limit)
        self.store_health = store_health.StoreHealth()  # the store cannot be written: degraded mode (safety/store_health.py)
        self.gone_check = liveness.GoneCheck()  # a job not found is "gone" only when confirmed (safety/liveness.py)
        # An exit the store could not record, kept to be handled again at the next retry (its status is read
        # once: a reaped child's code is not read twice).
        self.unrecorded_exit: ExitStatus | None = None

    # ------------------------------------------------------------------------------- helpers
    @property
    def ckpt_dir(self) -> Path:
        d = jc.get_dotted(self.config, "checkpoint.dir")
        return Path(d) if d else self.run_dir / "checkpoints"

    @property
    def telemetry_path(self) -> Path:
        if log_source.stdout_source(self.config):  # records parsed from the job's log (daemon/telemetry/log_source.py)
            return self.run_dir / log_source.STDOUT_TELEMETRY_NAME
        p = jc.get_dotted(self.config, "telemetry.path")
        return Path(p) if p else self.run_dir / "telemetry.jsonl"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / f"attempt-{self.attempt}.log"

    @property
    def exit_file(self) -> Path:
        return self.run_dir / "attempts" / f"{self.attempt}.exit"

    def set_state(self, to: RunState, reason: str) -> None:
        if to == self.state:
            return
        table_reason = check_transition(self.state, to)
        full = transition_reason(reason, table_reason)
        store_health.store_state(self, to, full)  # or kept in memory while the store cannot be written (safety/store_health.py)
        # FAILED is the one line an operator must not miss (journald priority 2, `journalctl -p crit`).
        (log.critical if to == S.FAILED else log.info)("state", run_id=self.run_id, frm=self.state.value,
                                                         to=to.value, reason=full)
        self._alert_state(to, full)
        self.say(f"state {self.state.value} -> {to.value}: {reason}")
        self.state = to
        if self.notifier is not None:
            self.notifier.status(self.status_line())

    def _position(self) -> Position:
        return Position(self.run_id, self.attempt, self.last_step)

    def status_line(self) -> str:
        loss = finite_or_none(self.last_step_record.loss) if self.last_step_record else None
        return (f"{self.run_id} {self.state.value} attempt {self.attempt} step {self.last_step} "
                f"loss {loss if loss is None else round(loss, 4)} config v{self.config_version}")

    # --------------------------------------------------------------------------- start-up
    def start(self) -> None:
        """Create the run (or re-adopt an unfinished one) and launch/adopt its job."""
        existing = startup.find_existing_run(self)
        if existing is not None:
            startup.adopt(self, existing)
        else:
            startup.create_run(self)
            self.launch(reason="first launch")
        housekeeping.setup(self)
        if self.notifier is not None:
            self.notifier.ready(self.status_line())
            self.ready_sent = True

    # ------------------------------------------------------------------------------- launch
    def new_config_version(self, patch: dict[str, Any], reason: str) -> tuple[int, dict[str, list[Any]]]:
        """Patch -> validated config -> configs/v{N+1}.json + store row (with the launcher env overrides,
        which are not JobSpec keys: `launcher.env.X` patches the ranks' environment)."""
        env_patch = {k: v for k, v in patch.items() if k.startswith("launcher.env.")}
        job_patch = {k: v for k, v in patch.items() if k not in env_patch}
        new, diff = jc.apply_patch(self.config, job_patch)
        new_env = dict(self.launch_env)
        for k, v in env_patch.items():
            name = k[len("launcher.env."):]
            after = v[1] if isinstance(v, tuple) else v
            if new_env.get(name) != after:
                diff[k] = [new_env.get(name, self.spec.launcher.env.get(name)), after]
                new_env[name] = after
        if not diff:
            return self.config_version, {}
        parent = self.config_version
        version = parent + 1
        jc.write_json_atomic(self.run_dir / "configs" / f"v{version}.json", new)
        stored = {**new, "launcher": {"env": new_env}, **decisions.carried_fit(self, parent)}
        self.store.add_config_version(self.run_id, stored, reason=reason, parent_version=parent, version=version)
        self.config, self.config_version, self.launch_env = new, version, new_env
        log.info("config version", run_id=self.run_id, version=version, diff=diff, reason=reason)
        self.say(f"config v{parent} -> v{version}: {', '.join(f'{k} {b!r}->{a!r}' for k, (b, a) in diff.items())}")
        return version, diff

    def launch(self, reason: str, rollback_to_step: int | None = None, incident_id: int | None = None) -> bool:
        """Launch the next attempt (core/launch.py); False when the run ended instead or the launch waits."""
        return launching.launch(self, reason, rollback_to_step, incident_id)

    # --------------------------------------------------------------------------- the tick
    def tick(self) -> None:
        bind_run(self.run_id, self.attempt)  # every log line of this tick names the run and attempt
        step = self.guard.run  # each step's exception: logged once, an incident, bounded (never the daemon's end)
        step("store_check", lambda: housekeeping.check_on_disk_state(self, self.run_dir))
        step("commands", lambda: commands.drain_events(self))
        if self.scheduler is not None:
            step("scheduler", self.scheduler.run_due)
        step("standby", lambda: self.standby.tick(self))  # start, check or stop the warm standby
        # The store cannot be written (safety/store_health.py): the steps that write run only at the retry time.
        health = self.store_health
        writes = health.due(self.os.time())
        failures_before = health.failures
        if writes and health.pending_states:
            writes = step("store_flush", lambda: store_health.flush_pending_states(self)) and not health.pending_states
            if writes and self.state in TERMINAL:
                health.recovered(self.os.time(), self.say)  # the run's end is stored: nothing else to write
        if self.state in TERMINAL:
            return
        if self.job is not None and writes:
            # A command job's saves, from its files, before its new records: a NaN read in this tick has the
            # saves already on disk as rollback targets (job/checkpoint_watch.py).
            step("checkpoints", lambda: checkpoint_watch.tick(self, decisions.on_record))
            step("telemetry", lambda: decisions.read_telemetry(self))
            step("inner_restarts", lambda: self.inner.tick(self.attempt, self.log_path, self.last_step or 0,
                 self.incidents.incident, lambda r: decisions.on_record(self, r, self.os.time()), self.say))
            if self.engine is not None and self.term is None and self.state in (S.RUNNING, S.STARTING) \
                    and not health.failing:
                step("engine", lambda: decisions.handle_outputs(self, self.engine.tick(decisions.engine_now(self)),
                                                                step=self.last_step or 0))
        if self.job is not None and writes:
            step("attempt_log", lambda: attempt_log.rotate_if_big(self))  # bounded attempt logs
        if self.term is not None:
            step("termination", self._advance_termination)
        if self.job is not None and writes:
            step("exit_check", self._notice_exit)
        if self.job is not None and self.term is None and self.last_exiting is None and writes \
                and self.state in (S.RUNNING, S.STARTING) and self.rank_watch.due(self.os.monotonic()) \
                and not self.inner.defers_rank_watch(self.attempt):
            step("rank_watch", self._watch_ranks)
        if self.state == S.BACKOFF and self.job is None and self.backoff_until is not None and writes \
                and self.os.time() >= self.backoff_until:
            step("relaunch", self._relaunch_after_backoff)
        if writes and health.failing and health.failures == failures_before and not health.pending_states \
                and step("store_probe", lambda: store_health.probe_state_dir(self.dcfg.state_dir)):
            health.recovered(self.os.time(), self.say)  # a retry ran clean and the state dir takes writes
        step("publish", self._publish)
        if self.notifier is not None:
            step("watchdog", self.notifier.maybe_watchdog)

    def _relaunch_after_backoff(self) -> None:
        relaunch = self.pending_relaunch or Relaunch("backoff over")
        self.pending_relaunch, self.backoff_until = None, None
        try:
            self.launch(relaunch.reason, relaunch.rollback_to_step, relaunch.incident_id)
        except Exception:
            if self.job is None and self.state == S.BACKOFF and self.backoff_until is None:
                self.pending_relaunch, self.backoff_until = relaunch, self.os.time()  # retried next tick
            raise

    def _publish(self) -> None:
        """Metrics and alert bookkeeping, from the loop (both helpers never block it)."""
        if self.metrics is not None:
            r = self.last_step_record
            self.metrics.update(run_id=self.run_id, step=self.last_step, loss=r.loss if r else None,
                                step_time=r.time if r else None, tokens_per_s=r.tokens_per_s if r else None,
                                step_time_s=r.step_time_s if r else None,
                                step_time_max_s=r.step_time_max_s if r else None,
                                slowest_rank=r.slowest_rank if r else None,
                                mem_allocated_gib=r.mem_allocated_gib if r else None,
                                mem_max_allocated_gib=r.mem_max_allocated_gib if r else None,
                                state=self.state.value, attempt=self.attempt,
                                relaunch_counts=lambda: self.store.relaunch_counts(self.run_id),
                                incidents_by_symptom=self.incidents.counts, actions_by_kind=self.incidents.actions_by_kind,
                                config_version=self.config_version)
        if self.alerts is not None:
            for out in self.alerts.drain():
                log.info("alert outcome", ok=out.ok, attempts=out.attempts, error=out.error)

    def alert(self, event: str, text: str, **details: Any) -> None:
        """Queue a webhook event (never blocks; the sender drops kinds the spec did not choose)."""
        if self.alerts is not None:
            self.alerts.send(f"run {self.run_id}: {text}", event=event,
                             details={"run_id": self.run_id, "attempt": self.attempt or None,
                                      "step": self.last_step, "state": self.state.value, **details})

    def _alert_state(self, to: RunState, reason: str) -> None:
        event = {S.RESTARTING: "restart", S.BACKOFF: "restart", S.COMPLETED: "completed", S.STOPPED: "stopped",
                 S.FAILED: "failed"}.get(to)
        if event is not None:
            self.alert(event, f"{to.value} at step {self.last_step}: {reason}", state=to.value,
                        frm=self.state.value, reason=reason)

    def run_forever(self, poll: Callable[[float], object] | None = None) -> RunState:
        """Tick until the run ends or the daemon is told to detach. `poll(timeout)` doubles as the sleep
        (the control socket's poll, which answers requests on this thread)."""
        # A run that ended while its store could not be written stays served (status) until the end is stored.
        while not self.detach and (self.state not in TERMINAL or self.store_health.pending_states):
            self.tick()
            if (self.state in TERMINAL and not self.store_health.pending_states) or self.detach:
                break
            # The socket's poll is the sleep; if it raises, the loop still sleeps (never a busy spin), and the
            # training goes on: a broken socket is an incident, not a reason to end a run.
            # A lost rank's grace or a kill in progress ticks fast (termination.tick_sleep_s): MTTR, not load.
            sleep_s = termination.tick_sleep_s(self.dcfg.tick_s, self.term,
                                               self.rank_watch if self.job is not None else None)
            if poll is None or not self.guard.run("control_socket", functools.partial(poll, sleep_s), bounded=False):
                self.os.sleep(sleep_s)
        self.standby.stop(self, "the daemon is leaving" if self.detach else f"the run is {self.state.value}")
        if self.scheduler is not None:
            self.scheduler.shutdown()
        return self.state

    # ---------------------------------------------------------------------- termination
    def begin_termination(self, reason: str, plan: TerminationPlan, grace: float, dump_stacks: bool = False,
                           on_stacks: Callable[[str], None] | None = None) -> None:
        assert self.job is not None
        now = self.os.monotonic()
        self.term = Termination(reason=reason, plan=plan, started=now, grace_s=grace, dump_stacks=dump_stacks,
                                log_offset=_size(self.log_path), on_stacks=on_stacks,
                                with_launcher=self.inner.mode.on)  # an inner launcher must not restart them
        if dump_stacks and not (slurm_supervise.submit_mode(self) and slurm_supervise.request_stack_dumps(
                self, self.term, self._stack_files(), now)):  # submit mode: through scancel --signal=USR1
            termination.request_stack_dumps(self.term, self.os, self.job, self.spec.launcher.module,
                                            self.marker(), self._stack_files(), now,
                                            self.dcfg.stack_dump_wait_s, self.say)
        self._advance_termination()

    def _stack_files(self) -> dict[int, Path]:
        return stack_dump_files(self.run_dir, self.attempt)

    def collect_stacks(self, t: Termination) -> str:
        return termination.collect_stacks(t, self._stack_files(), self.log_path, self.run_dir / STACK_DUMP_DIR,
                                          self.attempt)


    def _watch_ranks(self) -> None:
        """A rank is gone but the launcher still runs: its peers are blocked in a collective and the launcher
        would wait 30 s before killing them (rank_watch.py). End the attempt now; it is handled as a crash."""
        assert self.job is not None
        now = self.os.monotonic()
        # No marker: this runs every second, and the marker scan reads every process's environment. Ranks
        # still under a running launcher are its descendants, which the cheap tree/group scan finds.
        lost = self.rank_watch.observe(now, self.os.rank_pids(self.job, self.spec.launcher.module, None))
        if not lost:
            return
        self.rank_lost = {"pids": lost, "gone_for_s": round(now - min(self.rank_watch.lost_since.values()), 2),
                          "why": "a rank exited while the launcher still ran; its peers cannot finish a collective"}
        log.warning("rank lost, ending the attempt", pids=lost, attempt=self.attempt)
        self.say(f"  rank process(es) {lost} gone, launcher still running: stopping the remaining ranks now")
        # No save is possible with a dead peer, so no grace: SIGTERM, then SIGKILL on the next tick.
        self.begin_termination("rank lost", UNREQUESTED, grace=0.0)

    def marker(self) -> tuple[str, str]:
        return job_marker(self.run_id, self.run_dir, self.attempt)

    def _advance_termination(self) -> None:
        t = self.term
        if t is None or self.job is None:
            return
        hung_stop.shorten_grace_if_hung(self, t, self.os.monotonic())
        termination.advance(t, self.os, self.job, self.spec.launcher.module, self.marker(), self.os.monotonic(),
                            collect=lambda: self.collect_stacks(t), say=self.say)

    def stop_run(self, reason: str, fail: bool = False, pause: bool = False) -> None:
        plan = TerminationPlan(Then.FAIL if fail else (Then.PAUSE if pause else Then.STOP))
        if self.job is not None and self.os.is_alive(self.job):
            if self.state != S.STOPPING:
                self.set_state(S.STOPPING, reason)
            if self.term is None:
                self.begin_termination(reason, plan, grace=self.dcfg.stop_grace_s)
            else:
                self.term.plan = plan
        else:
            self.backoff_until, self.pending_relaunch = None, None
            if fail:
                self.fail(reason)
                return
            to = S.PAUSED if pause else S.STOPPED
            if self.state not in TERMINAL and (self.state, to) not in TRANSITIONS:
                # No job to stop but a state that cannot end directly (a run whose exit could not be
                # recorded sits RUNNING with no job): pass through STOPPING, as a stop with a job does.
                self.set_state(S.STOPPING, reason)
            self.set_state(to, reason)

    # ------------------------------------------------------------------------------ exits
    def _notice_exit(self) -> None:
        assert self.job is not None
        status = self.unrecorded_exit or self.os.exit_status(self.job, self.exit_file)
        if status is None:
            self.gone_check.since = None
            return
        confirmed = status if self.unrecorded_exit else liveness.confirm(self, status, self.gone_check)
        if confirmed is None:
            return  # "gone" needs more than one sign (safety/liveness.py)
        if not attempt_log.output_read(self):
            return  # its output is read to its end first, tick after tick (safety/attempt_log.py)
        status, self.unrecorded_exit = confirmed, None
        job, term = self.job, self.term
        # The job's last words (exiting event, final checkpoint); a bug there must not keep the exit unhandled.
        # All of them: a job that printed much before it exited is read to its end first (safety/attempt_log.py).
        self.guard.run("telemetry", self._read_to_the_end)
        attempt = self.attempt
        plan = self.term.plan if self.term is not None else UNREQUESTED
        # A failed exit handling has its own recovery: the run goes where the plan said (core/exits.py).
        def on_error(exc: BaseException) -> None:
            if not store_health.keep_unrecorded_exit(self, exc, job, term, status, plan.then in (Then.CRASH,
                                                                                              Then.RELAUNCH)):
                exits.exit_handling_failed(self, status, plan, attempt, exc)

        self.guard.run("exit", lambda: self._on_exit(status, attempt), on_error=on_error)

    def _read_to_the_end(self) -> None:
        """An ended attempt's output read to its end (safety/attempt_log.py), then its last records acted upon."""
        attempt_log.drain_before_exit(self)
        decisions.read_telemetry(self)

    def _on_exit(self, status: ExitStatus, attempt: int) -> None:
        slurm_end = slurm_supervise.before_exit(self, status)  # submit mode: Slurm's record decides first
        exits.on_exit(self, status)
        slurm_supervise.after_exit(self, attempt, slurm_end)

    def fail(self, reason: str, symptom: Symptom | None = None) -> None:
        if symptom is not None:
            iid = self.incidents.incident(symptom, self.last_step or 0, Severity.critical, reason, {"reason": reason})
            self.store.update_incident_status(iid, IncidentStatus.failed, reason)
        self.incidents.fail_all(reason)
        self.backoff_until, self.pending_relaunch = None, None
        self.set_state(S.FAILED, reason)
        self.say(f"RUN FAILED: {reason} (everything kept in {self.run_dir})")

    # ------------------------------------------------------------------------------ hang
    def on_hang(self, fnd: Any) -> None:
        """Hang: stack dumps of every rank into the incident, then SIGTERM, then SIGKILL after grace."""
        decisions.on_hang(self, fnd)

    # --------------------------------------------------------------------- commands
    def enqueue(self, kind: str, payload: Any = None) -> None:
        """Safe from signal handlers: appending to a deque is atomic; the loop does the work."""
        self.events.append((kind, payload))

    def handle_command(self, req: dict[str, Any]) -> dict[str, Any]:
        """Control-socket requests (answered on the main loop's thread; core/commands.py)."""
        return commands.handle(self, req)

    def status_dict(self) -> dict[str, Any]:
        r = self.last_step_record
        return {
            "run_id": self.run_id, "state": self.state.value, "attempt": self.attempt,
            "pid": self.job.pid if self.job else None, "step": self.last_step,
            # The attempt's process group and its ranks as the rank watch's last scan saw them (py-spy, kill).
            "pgid": self.job.pgid if self.job else None,
            "rank_pids": list(self.rank_watch.live) if self.job else [],
            "loss": finite_or_none(r.loss) if r else None, "tokens_per_s": r.tokens_per_s if r else None,
            "mem_max_allocated_gib": r.mem_max_allocated_gib if r else None,
            "latest_checkpoint": self.latest_ckpt[0] if self.latest_ckpt else None,
            "config_version": self.config_version, "restarts_last_hour": len(self.counters.restarts),
            "garbage_telemetry_lines": self.reader.garbage_lines if self.reader else 0,
            "telemetry_record_errors": self.record_errors,
            "tick_step_errors": self.guard.counts(),  # raises per tick step since the daemon started
            "store": self.store_health.status(self.os.time()),  # writable, or why not (safety/store_health.py)
            "run_dir": str(self.run_dir), "daemon_pid": os.getpid(),
            "standby": self.standby.describe(self),  # the warm next attempt, or None (daemon/job/standby.py)
        }


def default_engine_factory(spec: RunSpec, config: dict[str, Any]) -> Any:
    from ulyssesd.daemon.job.command import job_reach
    from ulyssesd.remediation.engine import RemediationEngine

    return RemediationEngine(spec.detectors, spec.remediation, engine_job_values(config),
                             reach=job_reach(spec.job_section, config))
