"""The supervisor: one run, one thread, one tick.

Each `tick()` does, in order: drain queued signals/commands → run due scheduler jobs → read new telemetry
and feed the remediation engine → the engine's clock check (hang) → advance a pending termination
(stack dump → SIGTERM → SIGKILL) → notice the attempt's exit and decide (complete / relaunch / backoff /
fail) → launch when a backoff is over → sd_notify. Signal handlers and the control socket only enqueue
or answer from the same thread; nothing else mutates supervisor state.

The run's state machine is `ulyssesd.daemon.core.states`; every transition, attempt, incident, action and
config version goes to the store (SQLite), which is also what makes re-adoption exact: the telemetry
cursor is persisted only after the records before it were acted upon, and incidents are deduplicated by
(run, attempt, symptom, step), so a daemon killed at any point neither loses nor doubles an incident.

The tick's larger parts live beside it, one concept each: `core/termination.py` (stack dump -> SIGTERM ->
SIGKILL phases), `core/exits.py` (an attempt's exit: crash -> diagnosis -> playbook), `core/decisions.py` (the
engine's findings and decisions -> incidents, actions, restarts), `core/relaunch.py` (restart budget and
backoff), `core/resume.py` (which checkpoint the next attempt resumes from), `core/files.py` (log/dump
reads); the job side is in `job/`, the OS seam in `host/process.py` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import collections
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tenacity

from ulyssesd.daemon.core import decisions, exits, relaunch, resume, termination
from ulyssesd.daemon.core.files import _size
from ulyssesd.daemon.core.incident_log import IncidentLog, Position, jsonable
from ulyssesd.daemon.core.rank_watch import RankWatch
from ulyssesd.daemon.core.relaunch import Counters, Relaunch
from ulyssesd.daemon.core.scheduler import LoopScheduler
from ulyssesd.daemon.core.states import LIVE_JOB_STATES, TERMINAL, check_transition, transition_reason
from ulyssesd.daemon.core.termination import UNREQUESTED, Termination, TerminationPlan, Then
from ulyssesd.daemon.host import disk
from ulyssesd.daemon.host.logging import bind_run, get_logger
from ulyssesd.daemon.host.process import ExitStatus, JobHandle, OSInterface
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job import log_source, slurm_supervise
from ulyssesd.daemon.job.launcher import LaunchPlan, build_launch, job_marker
from ulyssesd.daemon.job.standby import StandbyKeeper
from ulyssesd.daemon.job.telemetry_reader import Cursor, TelemetryReader
from ulyssesd.daemon.spec import RunSpec, engine_job_values
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.store.errors import NotFoundError
from ulyssesd.daemon.store.permissions import private_dir
from ulyssesd.daemon.store.recovery import refuse_unknown_run_dirs
from ulyssesd.remediation.records import INT64_MAX, EventRecord, Record, StepRecord, bounded_repr
from ulyssesd.training.control import STACK_DUMP_DIR, stack_dump_files

log = get_logger("ulyssesd.supervisor")
S = RunState


class LaunchError(RuntimeError):
    """The launcher could not be started even after the bounded retries."""


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Supervisor:
    def __init__(self, spec: RunSpec, store: Any, os_: OSInterface, *, run_id: str | None = None,
                 engine_factory: Callable[[RunSpec, dict], Any] | None = None,
                 notifier: Any = None, scheduler: LoopScheduler | None = None,
                 say: Callable[[str], None] | None = None,
                 preflight: Callable[[dict[str, Any]], str | None] | None = None,
                 metrics: Any = None, alerts: Any = None,
                 run_lock: Callable[[Path, str], None] | None = None) -> None:
        self.spec = spec
        # Takes the per-run supervisor lock (ulyssesd.daemon.host.locks) once the run is known; raises LockHeld.
        # None in in-process tests, which simulate a dead daemon by starting a second Supervisor.
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
        # The planner's check of a job config (None = fits, else why not); run before every relaunch with the
        # patched config, as cli.py runs it before the first launch. None: no preflight (CPU/command jobs, tests).
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
        self.record_errors = 0  # telemetry records whose handling raised (logged and skipped)
        self.engine: Any = None
        self.term: Termination | None = None  # the pending shutdown of the attempt and what follows its exit
        self.backoff_until: float | None = None
        self.pending_relaunch: Relaunch | None = None
        self.counters = Counters()
        self.standby = StandbyKeeper(spec.restart)  # the next attempt kept warm ([restart] standby)
        self.events: collections.deque[tuple[str, Any]] = collections.deque()
        self.detach = False
        self.attempt_started_mono = 0.0
        self.attempt_progress = False
        self.last_step: int | None = None
        self.last_step_record: StepRecord | None = None
        self.last_exiting: str | None = None
        # (label, evidence) the hang path read from the stack dumps; the attempt's diagnosis when it ends.
        self.hang_diagnosis: tuple[str | None, list[str]] | None = None
        self.rank_watch = RankWatch(self.dcfg.rank_exit_grace_s, self.dcfg.rank_watch_every_s)
        self.rank_lost: dict[str, Any] | None = None  # evidence when the rank watch ended the attempt
        self.save_failures: dict[int, dict[str, Any]] = {}  # attempt -> its job's checkpoint_save_failed event
        self.latest_ckpt: tuple[str, int] | None = None
        self.known_good_marked: set[str] = set()
        self.ready_sent = False
        self.started_wall = self.os.time()

    # ------------------------------------------------------------------------------- helpers
    @property
    def ckpt_dir(self) -> Path:
        d = jc.get_dotted(self.config, "checkpoint.dir")
        return Path(d) if d else self.run_dir / "checkpoints"

    @property
    def telemetry_path(self) -> Path:
        if log_source.stdout_source(self.config):  # records parsed from the job's log (daemon/job/log_source.py)
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
        self.store.set_run_state(self.run_id, to, full, attempt=self.attempt or None)
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
        loss = _finite(self.last_step_record.loss) if self.last_step_record else None
        return (f"{self.run_id} {self.state.value} attempt {self.attempt} step {self.last_step} "
                f"loss {loss if loss is None else round(loss, 4)} config v{self.config_version}")

    # --------------------------------------------------------------------------- start-up
    def start(self) -> None:
        """Create the run (or re-adopt an unfinished one) and launch/adopt its job."""
        existing = self._find_existing_run()
        if existing is not None:
            self._adopt(existing)
        else:
            self._create_run()
            self.launch(reason="first launch")
        self._setup_scheduler()
        if self.notifier is not None:
            self.notifier.ready(self.status_line())
            self.ready_sent = True

    def _find_existing_run(self) -> Any:
        rid = self.requested_run_id or self.spec.run.run_id
        if rid:
            try:
                run = self.store.get_run(rid)
            except LookupError:
                run = None
            if run is not None and RunState(run.state) not in TERMINAL:
                return run
            if run is not None:
                raise RuntimeError(f"run {rid} already ended as {run.state}; choose a new --run-id")
            run_dir = Path(self.dcfg.state_dir) / "runs" / rid
            if run_dir.is_dir():  # the store lost it (emptied / replaced database): adopt it from its directory
                return self._adopt_run_dir(run_dir, rid)
            return None
        # Under systemd the daemon restarts with the same command line: pick up the unfinished run of
        # this spec instead of starting a second one beside it.
        for run in self.store.list_runs():
            if RunState(run.state) not in TERMINAL and run.spec_path == str(Path(self.spec.source).resolve()):
                return run
        return None

    def _adopt_run_dir(self, run_dir: Path, rid: str) -> Any:
        """`--run-id X` of a run directory the store does not know: rebuild its rows from the directory
        (configs, checkpoints' manifests, attempts, telemetry cursor; store/recovery.py) and re-adopt it."""
        from ulyssesd.daemon.store import recovery

        run = recovery.adopt_run_dir(self.store, run_dir, rid, spec_path=str(Path(self.spec.source).resolve()))
        if self.run_lock is not None:
            self.run_lock(run_dir, rid)
        what = recovery.rederive_run(self.store, rid, run_dir)
        recovery.settle_adopted_state(self.store, run, what)
        recovery.record_recovery(self.store, rid, what, (
            f"run directory {run_dir} re-adopted with --run-id (the store did not know it): "
            f"{len(what['config_versions'])} config version(s), {len(what['checkpoints'])} checkpoint(s), "
            f"{len(what['attempts'])} attempt(s) re-derived, telemetry cursor at step {what['last_step']}"))
        log.info("run re-adopted from its directory", run_id=rid, run_dir=str(run_dir))
        self.say(f"run {rid} re-adopted from its directory {run_dir}")
        return self.store.get_run(rid)

    def _create_run(self) -> None:
        rid = self.requested_run_id or self.spec.run.run_id or (
            f"{self.spec.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(self.os.time()))}")
        self.run_id = rid
        self.run_dir = Path(self.dcfg.state_dir) / "runs" / rid
        refuse_unknown_run_dirs(self.store, Path(self.dcfg.state_dir), rid, self.spec.source)
        for d in (self.run_dir, self.run_dir / "configs", self.run_dir / "logs"):
            private_dir(d)
        if self.run_lock is not None:
            self.run_lock(self.run_dir, rid)
        src = Path(self.spec.source)
        if src.is_file():
            (self.run_dir / "spec.toml").write_bytes(src.read_bytes())
        self.config = self.spec.job.model_dump(mode="json")
        self.store.create_run(rid, run_dir=str(self.run_dir), spec_path=str(src.resolve()),
                              spec=jsonable(self.spec.raw), state=S.STARTING, reason="daemon started the run")
        # Stored configs carry the launcher env overrides remediation may add (`launcher.env.X`), so diffs
        # show them by their dotted key; the job's configs/vN.json stays a pure JobSpec.
        self.store.add_config_version(rid, {**self.config, "launcher": {"env": {}}}, reason="initial spec",
                                      parent_version=None, version=1)
        jc.write_json_atomic(self.run_dir / "configs" / "v1.json", self.config)
        self.config_version = 1
        self.engine = self.engine_factory(self.spec, self.config)
        self.reader = TelemetryReader(self.telemetry_path)
        log.info("run created", run_id=rid, run_dir=str(self.run_dir))
        self.say(f"run {rid} created in {self.run_dir}")

    def _adopt(self, run: Any) -> None:
        """Resume supervising a run a previous daemon left behind (its job may still be running)."""
        self.run_id = run.id
        self.run_dir = Path(run.run_dir)
        if self.run_lock is not None:
            self.run_lock(self.run_dir, run.id)
        self.state = RunState(run.state)
        cv = self.store.list_config_versions(run.id)
        latest = max(cv, key=lambda c: c.version)
        self.config_version, self.config = latest.version, dict(latest.config)
        self.launch_env = dict((self.config.pop("launcher", None) or {}).get("env") or {})
        # The engine starts from v1 (its bounds are relative to the initial values) and the warm-up replay
        # walks it through the same decisions again, so its values end where the stored config is.
        v1 = dict(min(cv, key=lambda c: c.version).config)
        v1.pop("launcher", None)
        self.engine = self.engine_factory(self.spec, v1)
        attempts = self.store.list_attempts(run.id)
        now = self.os.time()
        self.counters.restarts = [a.started_at.timestamp() for a in attempts[1:] if now - a.started_at.timestamp() < 3600]
        cursor = self.store.get_telemetry_cursor(run.id)
        self.reader = TelemetryReader(self.telemetry_path,
                                      Cursor(cursor.inode, cursor.offset) if cursor is not None else None)
        for ck in self.store.list_checkpoints(run.id):
            if ck.valid and (self.latest_ckpt is None or ck.step > self.latest_ckpt[1]):
                self.latest_ckpt = (ck.tag, ck.step)
        self.incidents.pick_up(run.id)
        if not attempts:
            self.launch(reason="adopted a run that never launched")
            return
        a = attempts[-1]
        self.attempt = a.number
        self._warm_engine(a.number)
        if a.pid and a.proc_start_time and a.ended_at is None:
            self.job = JobHandle(a.pid, a.proc_start_time)
            alive = self.os.is_alive(self.job)
            if not alive and (watcher := slurm_supervise.reattach(self, a)) is not None:
                self.job, alive = watcher, True  # its Slurm job still runs: a new watcher took it over
            log.info("re-adopting", run_id=run.id, attempt=a.number, pid=a.pid, alive=alive, state=self.state.value)
            self.say(f"re-adopted run {run.id} attempt {a.number} (pid {a.pid}, {'alive' if alive else 'gone'})")
            self.attempt_started_mono = self.os.monotonic()
            self.attempt_progress = self.last_step is not None
            if self.state == S.STOPPING:
                self.begin_termination("stop (re-adopted while stopping)", TerminationPlan(Then.STOP),
                                        grace=self.dcfg.stop_grace_s)
            elif self.state in (S.REMEDIATING, S.RESTARTING):
                # We were restarting: finish the job off and relaunch from the latest valid checkpoint.
                self.begin_termination("restart (re-adopted mid-restart)", TerminationPlan.relaunching(
                    self._decided_relaunch(a.number, "re-adopted mid-restart", True)), grace=self.dcfg.stop_grace_s)
            # else: the exit (if any) is noticed by the next tick
        elif self.state == S.BACKOFF:
            self.pending_relaunch = self._decided_relaunch(a.number, "re-adopted during backoff", False)
            self.backoff_until = now
        elif self.state in LIVE_JOB_STATES:
            self.pending_relaunch = self._decided_relaunch(a.number, "re-adopted with no live attempt", False)
            self.set_state(S.BACKOFF, "no live attempt after daemon restart")
            self.backoff_until = now

    def _decided_relaunch(self, attempt: int, reason: str, counts: bool) -> Relaunch:
        """The relaunch a previous daemon decided for `attempt` but did not carry out (it died in between):
        the newest restart-mode action on that attempt's incidents, read back from the store, so that a
        rollback-and-skip is not silently turned into a restart from the latest, possibly bad, checkpoint."""
        incidents = {i.id for i in self.store.list_incidents(self.run_id) if i.attempt == attempt}
        decided = [a for a in self.store.list_actions(run_id=self.run_id)
                   if a.incident_id in incidents and a.mode == ApplyMode.restart and not a.observe_only]
        if not decided:
            return Relaunch(reason, counts_against_budget=counts)
        last = decided[-1]
        target = (last.parameters or {}).get("rollback_to_step")
        rollback = target if isinstance(target, int) and not isinstance(target, bool) else None
        if rollback is not None:
            log.info("pending rollback picked up from the store", to_step=rollback, action=last.id)
            self.say(f"pending rollback to <= step {rollback} (action {last.id}) picked up from the store")
            reason += f"; pending rollback to <= step {rollback}"
        return Relaunch(reason, last.incident_id, rollback, counts_against_budget=counts)

    def _warm_engine(self, attempt: int) -> None:
        """Feed the current attempt's already-processed records to a fresh engine (baselines, hang clock)
        and drop its decisions: they were acted upon by the previous daemon."""
        assert self.reader is not None
        limit = self.reader.cursor.offset
        if limit <= 0 or not self.telemetry_path.exists():
            return
        warm = TelemetryReader(self.telemetry_path)
        fed = 0
        while warm.cursor.offset < limit:
            scanned = warm.scanned_to
            batch = warm.read()
            if not batch and warm.scanned_to == scanned:  # bad lines or an over-long one still move it
                break
            for rec, off in batch:
                if off > limit:
                    break
                self._track(rec)
                # Every attempt's records, at their own timestamps: restart history (budget), known-good
                # tags and baselines come back as they were; `started` events re-run the engine's restarts.
                try:
                    self.engine.observe(rec, rec.time if rec.time is not None else self.os.time())
                except Exception as exc:  # noqa: BLE001
                    log.warning("engine warm-up failed on a record", error=repr(exc))
                fed += 1
        log.info("engine warmed from telemetry", records=fed, up_to_offset=limit, attempt=attempt)

    # ------------------------------------------------------------------------------- launch
    def _choose_checkpoint(self, rollback_to_step: int | None) -> tuple[str, list[str]]:
        """Validate tags newest -> oldest, quarantine bad ones; return (tag or "none", notes)."""
        return resume.choose_checkpoint(
            self.ckpt_dir, rollback_to_step, verify=bool(jc.get_dotted(self.config, "checkpoint.verify_checksums", True)),
            verify_max_gib=self.dcfg.verify_max_gib, store=self.store, run_id=self.run_id, clock=self.os.time,
            say=self.say)

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
        stored = {**new, "launcher": {"env": new_env}}
        self.store.add_config_version(self.run_id, stored, reason=reason, parent_version=parent, version=version)
        self.config, self.config_version, self.launch_env = new, version, new_env
        log.info("config version", run_id=self.run_id, version=version, diff=diff, reason=reason)
        self.say(f"config v{parent} -> v{version}: {', '.join(f'{k} {b!r}->{a!r}' for k, (b, a) in diff.items())}")
        return version, diff

    def launch(self, reason: str, rollback_to_step: int | None = None, incident_id: int | None = None) -> bool:
        """Launch the next attempt. Returns False when the run ended instead (FAILED), or when the daemon's
        own writes to the run directory fail for lack of space (retried later, bounded: relaunch.py)."""
        try:
            relaunch.probe_run_dir(self.run_dir)
            launched = self._launch_attempt(reason, rollback_to_step, incident_id)
        except (OSError, LaunchError) as exc:
            if disk.errno_of(exc) is None:
                raise
            return relaunch.own_write_failed(self, exc, Relaunch(reason, incident_id, rollback_to_step))
        self.counters.own_write_failures = 0
        return launched

    def _launch_attempt(self, reason: str, rollback_to_step: int | None, incident_id: int | None) -> bool:
        try:
            tag, notes = self._choose_checkpoint(rollback_to_step)
        except (PermissionError, OSError) as exc:
            if disk.errno_of(exc) is not None:
                raise  # our own write failed (full / read-only disk): not a checkpoint problem (_launch)
            self.fail(f"cannot read checkpoints: {exc}", symptom=Symptom.checkpoint_corrupt)
            return False
        if tag == "none" and notes and rollback_to_step is None:
            # Checkpoints existed and none is valid: like the job's exit 3, refuse to silently start the
            # run over from step 0; everything (quarantined tags included) is kept for a human.
            sid = self.incidents.incident(Symptom.checkpoint_corrupt, self.last_step or 0, Severity.critical,
                                 "no valid checkpoint left; not restarting from scratch",
                                 {"invalid": notes, "ckpt_dir": str(self.ckpt_dir)}, attempt=self.attempt + 1)
            self.incidents.action(sid, ActionKind.stop, {"reason": "no valid checkpoint left"}, {}, ApplyMode.none)
            self.store.update_incident_status(sid, IncidentStatus.failed, "no valid checkpoint left")
            self.fail(f"no valid checkpoint left in {self.ckpt_dir}: {'; '.join(notes)[:300]}")
            return False
        # "latest" = the newest valid tag, which is `tag` now that invalid ones are quarantined; an explicit
        # tag (or "none") only for a rollback; the user's own choice stands on the first attempt.
        want_load = "latest" if rollback_to_step is None else tag
        if self.attempt == 0:
            want_load = jc.get_dotted(self.config, "checkpoint.load")
        if want_load != jc.get_dotted(self.config, "checkpoint.load"):
            self.new_config_version({"checkpoint.load": want_load},
                                     f"resume from {tag}" + (f" (rollback to <= step {rollback_to_step})"
                                                             if rollback_to_step is not None else ""))
        if notes:
            sid = self.incidents.incident(Symptom.checkpoint_corrupt, self.last_step or 0, Severity.warning,
                                 f"checkpoint fallback: {notes[0][:120]}; resuming from {tag}",
                                 {"invalid": notes, "resumed_from": tag, "ckpt_dir": str(self.ckpt_dir)},
                                 attempt=self.attempt + 1)
            self.incidents.action(sid, ActionKind.restart, {"resume_from": tag, "skipped": notes}, {}, ApplyMode.restart)
            self.store.update_incident_status(sid, IncidentStatus.resolved, f"previous valid checkpoint {tag} used")
            log.warning("checkpoint problem", notes=notes, using=tag)
            self.say(f"checkpoint problem: {'; '.join(notes)} -> using {tag}")
        if rollback_to_step is not None:
            from ulyssesd.training.checkpoint import step_of_tag

            self.latest_ckpt = (tag, step_of_tag(tag) or 0) if tag != "none" else None
        if self.attempt > 0 and self.preflight is not None:
            verdict = self.preflight(self.config)  # fails closed: a planner error is a refusal too
            if verdict is not None:
                self.fail(f"preflight refused config v{self.config_version}: {verdict}", symptom=Symptom.launch_failure)
                return False
        self.attempt += 1
        # A fresh attempt reads control.json from scratch: neutral file (no keys = no change).
        jc.write_control(self.run_dir, suspect=False)
        launcher = self.spec.launcher
        if self.launch_env:
            launcher = launcher.model_copy(update={"env": {**launcher.env, **{k: str(v) for k, v in self.launch_env.items()
                                                                              if v is not None}}})
        plan = build_launch(launcher, run_id=self.run_id, run_dir=self.run_dir, attempt=self.attempt,
                            config_version=self.config_version, job=self.spec.job_section,
                            rollback_to_step=rollback_to_step, slurm=self.spec.slurm)
        takeover = self.standby.take(self, plan)  # a warm standby's gate opened, or why not (job/standby.py)
        plan, reason = takeover.plan or plan, reason + takeover.note
        try:
            job = takeover.job or self._spawn_with_retries(plan)
        except LaunchError as exc:
            if disk.errno_of(exc) is not None:
                self.attempt -= 1  # not launched (its log file could not be written): retried later, same number
                raise
            self.store.add_attempt(self.run_id, number=self.attempt, command=plan.argv,
                                   config_version=self.config_version, resumed_from=tag, host=socket.gethostname())
            self.store.end_attempt(self.run_id, self.attempt, returncode=127, diagnosis="launcher_error",
                                   diagnosis_evidence=[str(exc)])
            self.fail(str(exc), symptom=Symptom.launch_failure)
            return False
        self.job = job
        self.store.add_attempt(self.run_id, number=self.attempt, command=plan.argv, config_version=self.config_version,
                               resumed_from=None if tag == "none" else tag, host=socket.gethostname(),
                               pid=job.pid, pgid=job.pgid, proc_start_time=job.start_time)
        self.attempt_started_mono = self.os.monotonic()
        self.attempt_progress = False
        self.last_exiting = None
        self.hang_diagnosis, self.rank_lost = None, None
        self.rank_watch = RankWatch(self.dcfg.rank_exit_grace_s, self.dcfg.rank_watch_every_s)
        self.incidents.settle_unacted("the attempt ended before any action on it")
        if self.engine is not None:
            self.engine.on_restart(self.os.time(), attempt=self.attempt)
        if self.state != S.STARTING:
            self.set_state(S.STARTING, f"attempt {self.attempt} launched ({reason}) from {tag}")
        log.info("launched", run_id=self.run_id, attempt=self.attempt, pid=job.pid, resume=tag, reason=reason,
                 config_version=self.config_version)
        self.say(f"attempt {self.attempt} launched (pid {job.pid}, config v{self.config_version}, resume {tag}): {reason}")
        return True

    def _spawn_with_retries(self, plan: LaunchPlan) -> JobHandle:
        """Bounded retries with exponential backoff + jitter for launches that fail to start at all
        (fork/exec errors, a missing interpreter). The waits are short and bounded (≤ ~10 s total)."""
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.dcfg.launch_retries + 1),
            wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=4.0, jitter=0.5),
            retry=tenacity.retry_if_exception_type(OSError),
            before_sleep=lambda rs: log.warning("launch failed, retrying", attempt=rs.attempt_number,
                                                error=repr(rs.outcome.exception() if rs.outcome else None)),
            reraise=True,
        )
        try:
            return retrying(self.os.spawn, plan.argv, plan.env, plan.cwd, plan.log_path)
        except OSError as exc:
            raise LaunchError(f"cannot start the launcher after {self.dcfg.launch_retries + 1} tries: "
                              f"{plan.argv[0]}: {exc}") from exc

    # --------------------------------------------------------------------------- the tick
    def tick(self) -> None:
        bind_run(self.run_id, self.attempt)  # every log line of this tick names the run and attempt
        self._check_store_file()
        self._drain_events()
        if self.scheduler is not None:
            self.scheduler.run_due()
        self.standby.tick(self)  # start, check or stop the warm standby
        if self.state in TERMINAL:
            return
        if self.job is not None:
            self._read_telemetry()
            if self.engine is not None and self.term is None and self.state in (S.RUNNING, S.STARTING):
                self._handle_outputs(self.engine.tick(self.os.time()), step=self.last_step or 0)
        if self.term is not None:
            self._advance_termination()
        if self.job is not None:
            status = self.os.exit_status(self.job, self.exit_file)
            if status is not None:
                self._read_telemetry()  # the job's last words (exiting event, final checkpoint)
                self._on_exit(status)
        if self.job is not None and self.term is None and self.last_exiting is None \
                and self.state in (S.RUNNING, S.STARTING) and self.rank_watch.due(self.os.monotonic()):
            self._watch_ranks()
        if self.state == S.BACKOFF and self.backoff_until is not None and self.os.time() >= self.backoff_until:
            relaunch = self.pending_relaunch or Relaunch("backoff over")
            self.pending_relaunch, self.backoff_until = None, None
            self.launch(relaunch.reason, relaunch.rollback_to_step, relaunch.incident_id)
        self._publish()
        if self.notifier is not None:
            self.notifier.maybe_watchdog()

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
                                state=self.state.value, restarts=max(0, self.attempt - 1),
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
        while not self.detach and self.state not in TERMINAL:
            self.tick()
            if self.state in TERMINAL or self.detach:
                break
            if poll is not None:
                poll(self.dcfg.tick_s)
            else:
                self.os.sleep(self.dcfg.tick_s)
        self.standby.stop(self, "the daemon is leaving" if self.detach else f"the run is {self.state.value}")
        if self.scheduler is not None:
            self.scheduler.shutdown()
        return self.state

    # ------------------------------------------------------------------------ telemetry
    def _track(self, rec: Record) -> None:
        if isinstance(rec, StepRecord):
            self.last_step = rec.step
            self.last_step_record = rec
        elif isinstance(rec, EventRecord):
            if rec.event == "exiting" and rec.attempt in (None, self.attempt):
                self.last_exiting = str(rec.fields.get("reason"))
            if rec.event == "checkpoint_save_failed":
                self.save_failures[rec.attempt if rec.attempt is not None else self.attempt] = dict(rec.fields)
            if rec.event == "checkpoint_saved":
                tag = rec.fields.get("tag")
                if isinstance(tag, str) and rec.step is not None:
                    if self.latest_ckpt is None or rec.step >= self.latest_ckpt[1]:
                        self.latest_ckpt = (tag, rec.step)

    def _read_telemetry(self) -> None:
        assert self.reader is not None
        log_source.pump(self)  # [telemetry] source = "stdout": the job's new log lines become records first
        offset_before = self.reader.cursor.offset
        batch = self.reader.read()
        if not batch and self.reader.cursor.offset == offset_before:
            return
        now = self.os.time()
        for rec, _off in batch:
            if rec.attempt is not None and rec.attempt != self.attempt:
                continue  # a late line of an earlier attempt
            try:
                self._on_record(rec, now)
            except Exception:  # noqa: BLE001 - one record must not end supervision (and not on every restart)
                self.record_errors += 1
                log.exception("handling a telemetry record failed; skipped", run_id=self.run_id,
                              step=rec.step, kind=rec.kind, count=self.record_errors)
        self._sync_known_good()
        # Persisted even when only bad lines were consumed: a restart must not re-read them.
        cur = self.reader.cursor
        self.store.set_telemetry_cursor(self.run_id, path=str(self.telemetry_path), inode=cur.inode,
                                        offset=cur.offset, last_step=self.last_step)

    def _sync_known_good(self) -> None:
        """Mirror the engine's known-good tags (checkpoints followed by a clean window) into the store;
        retention keeps them as anchors and `ulyssesctl status` shows the newest."""
        for tag, step in list(getattr(self.engine, "known_good", []) or []):
            if tag not in self.known_good_marked:
                self.store.upsert_checkpoint(self.run_id, tag, step=step, known_good=True)
                self.known_good_marked.add(tag)

    def _on_record(self, rec: Record, now: float) -> None:
        self._track(rec)
        if isinstance(rec, StepRecord) or (isinstance(rec, EventRecord) and rec.event in ("started",)):
            self.attempt_progress = self.attempt_progress or isinstance(rec, StepRecord)
            if self.state == S.STARTING:
                self.set_state(S.RUNNING, f"attempt {self.attempt} is training"
                                if isinstance(rec, StepRecord) else f"attempt {self.attempt} started")
        if isinstance(rec, EventRecord):
            self._on_event(rec)
        if self.engine is not None:
            self._handle_outputs(self.engine.observe(rec, now), step=rec.step if rec.step is not None else (self.last_step or 0))

    def _on_event(self, rec: EventRecord) -> None:
        f = rec.fields
        if rec.event == "checkpoint_saved" and isinstance(f.get("tag"), str):
            self.store.upsert_checkpoint(self.run_id, f["tag"], step=rec.step or 0, loss=None, valid=True,
                                         attempt=self.attempt, config_version=self.config_version)
            self.incidents.verify(rec.step or 0, self.spec.remediation.grace_steps)
            log.info("checkpoint saved", tag=f["tag"], step=rec.step)
            self.say(f"checkpoint {f['tag']} saved")
        elif rec.event == "checkpoint_invalid":
            sid = self.incidents.incident(Symptom.checkpoint_corrupt, rec.step or 0, Severity.warning,
                                 f"job skipped invalid checkpoint {f.get('tag')}: {f.get('reason')}",
                                 {"tag": f.get("tag"), "reason": f.get("reason"), "source": "job"})
            self.store.update_incident_status(sid, IncidentStatus.resolved, "the job fell back to the previous valid tag")
        elif rec.event == "exiting":
            self.last_exiting = str(f.get("reason"))
        elif rec.event == "fault_injected":
            log.info("fault injected by the job", fault=f.get("fault", f.get("kind")), step=rec.step)
            self.say(f"[fault injected by the job: {f.get('fault', f.get('kind'))} at step {rec.step}]")

    # ---------------------------------------------------------------- remediation outputs
    def _handle_outputs(self, out: Any, step: int) -> None:
        decisions.handle_outputs(self, out, step)

    # ---------------------------------------------------------------------- termination
    def begin_termination(self, reason: str, plan: TerminationPlan, grace: float, dump_stacks: bool = False,
                           on_stacks: Callable[[str], None] | None = None) -> None:
        assert self.job is not None
        now = self.os.monotonic()
        self.term = Termination(reason=reason, plan=plan, started=now, grace_s=grace, dump_stacks=dump_stacks,
                                log_offset=_size(self.log_path), on_stacks=on_stacks)
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
            elif pause:
                self.set_state(S.PAUSED, reason)
            else:
                self.set_state(S.STOPPED, reason)

    # ------------------------------------------------------------------------------ exits
    def _on_exit(self, status: ExitStatus) -> None:
        attempt = self.attempt
        plan = self.term.plan if self.term is not None else UNREQUESTED
        try:
            slurm_end = slurm_supervise.before_exit(self, status)  # submit mode: Slurm's record decides first
            exits.on_exit(self, status)
            slurm_supervise.after_exit(self, attempt, slurm_end)
        except Exception as exc:  # noqa: BLE001 - one exit must not end supervision (like a telemetry record)
            log.exception("handling the attempt's exit failed", run_id=self.run_id, attempt=attempt,
                          status=status.describe(), plan=str(plan))
            exits.exit_handling_failed(self, status, plan, attempt, exc)

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

    def _drain_events(self) -> None:
        while self.events:
            kind, payload = self.events.popleft()
            if kind == "signal":
                self._on_signal(payload)
            elif kind == "command":
                self.handle_command(payload)

    def _on_signal(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            # Detach: the job keeps training; the next daemon re-adopts it (KillMode=process).
            log.info("signal: detaching, the job keeps running", signal=signal.Signals(signum).name)
            self.say(f"daemon got {signal.Signals(signum).name}: detaching, job keeps running")
            if self.notifier is not None:
                self.notifier.stopping("detaching; the job keeps running")
            self.detach = True
        elif signum == signal.SIGHUP:
            log.info("SIGHUP ignored (no reloadable settings)")

    def handle_command(self, req: dict[str, Any]) -> dict[str, Any]:
        """Control-socket requests (answered on the main loop's thread)."""
        cmd = req.get("cmd")
        args = req.get("args") or {}
        peer = req.get("peer") or {}
        try:
            if cmd == "status":
                return {"ok": True, "status": self.status_dict()}
            if cmd == "pause":
                if self.state in (S.PAUSED,) or self.state in TERMINAL:
                    return {"ok": False, "code": "bad_state", "error": f"run is {self.state.value}"}
                self.stop_run(f"operator pause (uid {peer.get('uid')})", pause=True)
                return {"ok": True, "state": self.state.value}
            if cmd == "resume":
                if self.state != S.PAUSED:
                    return {"ok": False, "code": "bad_state", "error": f"run is {self.state.value}, not PAUSED"}
                self.launch("operator resume")
                return {"ok": True, "state": self.state.value}
            if cmd == "stop":
                if self.state in TERMINAL:
                    return {"ok": False, "code": "bad_state", "error": f"run is already {self.state.value}"}
                self.stop_run(f"operator stop (uid {peer.get('uid')})")
                return {"ok": True, "state": self.state.value}
            if cmd == "restart":
                if self.job is None or self.state not in (S.RUNNING, S.STARTING):
                    return {"ok": False, "code": "bad_state", "error": f"run is {self.state.value}; nothing to restart"}
                self.set_state(S.RESTARTING, "operator restart")
                self.begin_termination("operator restart", TerminationPlan.relaunching(Relaunch(
                    "operator restart", None, counts_against_budget=False)), grace=self.dcfg.stop_grace_s)
                return {"ok": True, "state": self.state.value}
            if cmd == "ack":
                iid = args.get("id")
                if type(iid) is not int or not 0 < iid <= INT64_MAX:
                    return {"ok": False, "code": "bad_request",
                            "error": f"'args.id' must be a positive integer incident id, got {bounded_repr(iid)}"}
                by = args.get("by")
                if by is not None and (not isinstance(by, str) or len(by) > 200):
                    return {"ok": False, "code": "bad_request",
                            "error": f"'args.by' must be an operator name (a string of at most 200 characters), "
                                     f"got {bounded_repr(by)}"}
                try:
                    self.store.ack_incident(iid, by.strip() if by and by.strip() else f"uid:{peer.get('uid')}")
                except NotFoundError:
                    return {"ok": False, "code": "not_found", "error": f"no incident {iid}"}
                return {"ok": True, "id": iid}
            return {"ok": False, "code": "unknown_command", "error": f"unknown command {bounded_repr(cmd)}"}
        except Exception as exc:  # noqa: BLE001 - a bad request must not take the loop down
            log.exception("control command failed", cmd=cmd)
            # No exception text to the client: it may hold paths or internals; the daemon log has it all.
            return {"ok": False, "code": "internal",
                    "error": f"internal error handling {bounded_repr(cmd)} ({type(exc).__name__}); see the daemon log"}

    def status_dict(self) -> dict[str, Any]:
        r = self.last_step_record
        return {
            "run_id": self.run_id, "state": self.state.value, "attempt": self.attempt,
            "pid": self.job.pid if self.job else None, "step": self.last_step,
            "loss": _finite(r.loss) if r else None, "tokens_per_s": r.tokens_per_s if r else None,
            "mem_max_allocated_gib": r.mem_max_allocated_gib if r else None,
            "latest_checkpoint": self.latest_ckpt[0] if self.latest_ckpt else None,
            "config_version": self.config_version, "restarts_last_hour": len(self.counters.restarts),
            "garbage_telemetry_lines": self.reader.garbage_lines if self.reader else 0,
            "telemetry_record_errors": self.record_errors,
            "run_dir": str(self.run_dir), "daemon_pid": os.getpid(),
        }

    # -------------------------------------------------------------------- scheduler jobs
    def _setup_scheduler(self) -> None:
        if self.scheduler is None:
            return
        d = self.dcfg
        self.scheduler.add("checkpoint_retention", d.retention_every_s, self.job_retention)
        self.scheduler.add("store_maintenance", d.maintenance_every_s, self.job_maintenance)
        if hasattr(self.store, "backup_into"):
            self.scheduler.add("store_backup", d.backup_every_s, self.job_backup)
        self.scheduler.add("stale_attempt_sweep", d.sweep_every_s, self.job_sweep)
        self.scheduler.add("status_summary", d.status_every_s, self.job_status)
        self.scheduler.start()

    def job_retention(self) -> None:
        from ulyssesd.training import checkpoint as ck

        if not self.ckpt_dir.is_dir():
            return
        anchors = [c.tag for c in self.store.list_checkpoints(self.run_id) if getattr(c, "known_good", False)]
        keep = int(jc.get_dotted(self.config, "checkpoint.keep_last", 3))
        removed = ck.prune(self.ckpt_dir, keep_last=keep, anchors=anchors)
        removed += ck.disk_guard(self.ckpt_dir, int(self.dcfg.min_free_gib * (1 << 30)), keep_min=1, anchors=anchors)
        for tag in removed:
            log.info("checkpoint pruned", tag=tag)
            if hasattr(self.store, "mark_checkpoint_pruned"):
                self.store.mark_checkpoint_pruned(self.run_id, tag)

    def job_maintenance(self) -> None:
        res = self.store.maintenance()
        if getattr(res, "ok", True) is False and self.run_id:
            # Damaged under a running daemon: the backup job now refuses unsound copies (the last good ones
            # stay), and the next daemon start restores the newest one. Say it once per distinct result.
            iid = self.incidents.incident(Symptom.store_damaged, self.last_step or 0, Severity.critical,
                                 f"integrity_check failed: {'; '.join(res.integrity[:3])[:300]}; restart the "
                                 "daemon to restore the newest good backup (the job keeps training)",
                                 {"integrity": res.integrity[:20], "path": str(self.store.path)})
            self.alert("incident", f"store {self.store.path} damaged: {res.integrity[:1]}")
            log.error("store integrity check failed", incident=iid, integrity=res.integrity[:5])

    def job_backup(self) -> None:
        from ulyssesd.daemon.store.recovery import BACKUP_DIR_NAME, write_backup

        path = write_backup(self.store, Path(self.dcfg.state_dir) / BACKUP_DIR_NAME, keep=self.dcfg.backups_keep)
        log.info("store backup written", path=str(path))

    def _check_store_file(self) -> None:
        """Database file deleted or replaced under us (one stat): re-create it from the open connection
        before anything is written to an inode nobody can read, and say so (store/recovery.py)."""
        if not hasattr(self.store, "file_problem"):
            return
        from ulyssesd.daemon.store.recovery import mend_replaced_file

        problem = mend_replaced_file(self.store)
        if problem is None:
            self._check_store_damage()
            return
        log.warning("store file re-created", problem=problem, path=str(self.store.path))
        self.say(f"WARNING: {problem}; re-created it from the open connection (nothing lost)")
        if self.run_id:
            iid = self.incidents.incident(Symptom.store_damaged, self.last_step or 0, Severity.warning,
                                 f"{problem}; re-created from the daemon's open connection, no history lost",
                                 {"problem": problem, "path": str(self.store.path), "recovered": "everything"})
            self.store.update_incident_status(iid, IncidentStatus.resolved, "database re-created in place")

    def _check_store_damage(self) -> None:
        """The database file itself damaged under us (emptied, header overwritten, truncated: one 100-byte
        read): salvage it from the open connection or restore the newest backup, re-derive this run from its
        directory, forget in-memory references to incidents the restored store does not have, say so."""
        from ulyssesd.daemon.store import recovery

        got = recovery.mend_damaged_file(self.store, self.dcfg.state_dir)
        if got is None:
            return
        log.warning("store damaged under the daemon", **{k: str(v) for k, v in got.items()})
        if self.run_id:
            try:
                self.store.get_run(self.run_id)
            except LookupError:  # the restored database predates this run: rebuild it from its directory
                recovery.adopt_run_dir(self.store, self.run_dir, self.run_id,
                                       spec_path=str(Path(self.spec.source).resolve()))
            # This daemon's state is the truth; a restored backup may hold an older one (no-op when equal).
            self.store.set_run_state(self.run_id, self.state, "store restored under the running daemon",
                                     attempt=self.attempt or None)
            what = recovery.rederive_run(self.store, self.run_id, self.run_dir, ckpt_dir=self.ckpt_dir,
                                         telemetry=self.telemetry_path)
            if self.reader is not None:  # what this daemon has processed, not the file's end
                self.store.set_telemetry_cursor(self.run_id, path=str(self.telemetry_path),
                                                inode=self.reader.cursor.inode, offset=self.reader.cursor.offset,
                                                last_step=self.last_step)
            known = {i.id for i in self.store.list_incidents(self.run_id)}
            self.incidents.forget_unknown(known)
            what.update(got)
            iid = self.incidents.incident(Symptom.store_damaged, self.last_step or 0, Severity.warning,
                                 f"{got['problem']}; recovered from {got['recovered_from']}"
                                 + (f" (incidents/actions after {got['lost_since']} are not in the store)"
                                    if got.get("lost_since") else ", nothing lost"), what)
            self.store.update_incident_status(iid, IncidentStatus.resolved, "database recovered in place")
        self.say(f"WARNING: {got['problem']}; recovered from {got['recovered_from']}")

    def job_sweep(self) -> None:
        """Attempts the store thinks are live but whose process is gone (e.g. left by a crashed daemon
        for another run) are closed with what their exit file says."""
        from ulyssesd.daemon.host.process import _read_exit_file

        for a in self.store.list_attempts(self.run_id):
            if a.ended_at is not None or a.number == self.attempt or not a.pid or not a.proc_start_time:
                continue
            h = JobHandle(a.pid, a.proc_start_time)
            if not self.os.is_alive(h):
                st = _read_exit_file(self.run_dir / "attempts" / f"{a.number}.exit") or ExitStatus(None, None, "unknown")
                self.store.end_attempt(self.run_id, a.number, returncode=st.returncode, signal=st.signal)
                log.info("stale attempt closed", attempt=a.number, status=st.describe())

    def job_status(self) -> None:
        log.info("status", **self.status_dict())


def default_engine_factory(spec: RunSpec, config: dict[str, Any]) -> Any:
    from ulyssesd.remediation.engine import RemediationEngine

    return RemediationEngine(spec.detectors, spec.remediation, engine_job_values(config))
