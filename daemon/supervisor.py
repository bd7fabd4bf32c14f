"""The supervisor: one run, one thread, one tick.

Each `tick()` does, in order: drain queued signals/commands → run due scheduler jobs → read new telemetry
and feed the remediation engine → the engine's clock check (hang) → advance a pending termination
(stack dump → SIGTERM → SIGKILL) → notice the attempt's exit and decide (complete / relaunch / backoff /
fail) → launch when a backoff is over → sd_notify. Signal handlers and the control socket only enqueue
or answer from the same thread; nothing else mutates supervisor state.

The run's state machine is `ulyssesd.daemon.states`; every transition, attempt, incident, action and
config version goes to the store (SQLite), which is also what makes re-adoption exact: the telemetry
cursor is persisted only after the records before it were acted upon, and incidents are deduplicated by
(run, attempt, symptom, step), so a daemon killed at any point neither loses nor doubles an incident.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenacity

from ulyssesd.daemon import job_config as jc
from ulyssesd.daemon.launcher import LaunchPlan, build_launch
from ulyssesd.daemon.logging import get_logger
from ulyssesd.daemon.process import ExitStatus, JobHandle, OSInterface
from ulyssesd.daemon.rank_watch import RankWatch
from ulyssesd.daemon.scheduler import LoopScheduler
from ulyssesd.daemon.spec import RunSpec
from ulyssesd.daemon.states import LIVE_JOB_STATES, TERMINAL, check_transition
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.telemetry_reader import Cursor, TelemetryReader
from ulyssesd.remediation.hang_stacks import read_hang
from ulyssesd.remediation.records import EventRecord, Record, StepRecord

log = get_logger("ulyssesd.supervisor")
S = RunState

LOG_TAIL_BYTES = 64 * 1024
STACKS_MAX_BYTES = 64 * 1024
#: Exit code of `ulyssesd run` when the run ended FAILED (the unit lists it in RestartPreventExitStatus).
EXIT_RUN_FAILED = 10


class LaunchError(RuntimeError):
    """The launcher could not be started even after the bounded retries."""


@dataclass
class Relaunch:
    """What to do once the current attempt has exited: start the next one."""

    reason: str
    incident_id: int | None = None
    rollback_to_step: int | None = None
    counts_against_budget: bool = True


@dataclass
class Termination:
    """A pending shutdown of the current attempt, advanced one phase per tick (never blocks the loop)."""

    reason: str
    after: Any  # Relaunch | "stop" | "pause" | "fail"
    started: float
    grace_s: float
    dump_stacks: bool = False
    dump_until: float = 0.0
    log_offset: int = 0
    termed_at: float | None = None
    killed_at: float | None = None
    wrapper_killed: bool = False
    on_stacks: Callable[[str], None] | None = None
    stack_offsets: dict[str, int] = field(default_factory=dict)  # per-rank dump file -> size before SIGUSR1
    per_rank_stacks: dict[int, str] = field(default_factory=dict)  # what each rank wrote after SIGUSR1


@dataclass
class Counters:
    restarts: list[float] = field(default_factory=list)  # wall times of relaunches (budget per hour)
    restarts_without_progress: int = 0
    consecutive_early_deaths: int = 0
    ckpt_step_at_last_restart: int | None = None


def _read_tail(path: Path, nbytes: int = LOG_TAIL_BYTES, start: int | None = None) -> str:
    try:
        with open(path, "rb") as fh:
            if start is not None:
                fh.seek(start)
                return fh.read(nbytes).decode("utf-8", errors="replace")
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Supervisor:
    def __init__(self, spec: RunSpec, store: Any, os_: OSInterface, *, run_id: str | None = None,
                 engine_factory: Callable[[RunSpec, dict], Any] | None = None,
                 notifier: Any = None, scheduler: LoopScheduler | None = None,
                 say: Callable[[str], None] | None = None, preflight: bool = True,
                 metrics: Any = None, alerts: Any = None) -> None:
        self.spec = spec
        self.store = store
        self.os = os_
        self.notifier = notifier
        self.metrics = metrics  # ulyssesd.daemon.metrics.Metrics (optional, off by default)
        self.alerts = alerts  # ulyssesd.daemon.alerts.AlertSender (optional): escalations and failures
        self.incident_counts: dict[str, int] = {}
        self.scheduler = scheduler
        self.say = say or (lambda msg: None)
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
        self.plan: LaunchPlan | None = None
        self.reader: TelemetryReader | None = None
        self.engine: Any = None
        self.term: Termination | None = None
        self.after_exit: Any = None
        self.backoff_until: float | None = None
        self.pending_relaunch: Relaunch | None = None
        self.counters = Counters()
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
        self.latest_ckpt: tuple[str, int] | None = None
        self.open_incidents: dict[int, dict[str, Any]] = {}
        self.known_good_marked: set[str] = set()
        # symptom -> [(incident id, step)] of findings no decision has acted on yet (grace window)
        self.unacted: dict[str, list[tuple[int, int]]] = {}
        self.ready_sent = False
        self.started_wall = self.os.time()

    # ------------------------------------------------------------------------------- helpers
    @property
    def ckpt_dir(self) -> Path:
        d = jc.get_dotted(self.config, "checkpoint.dir")
        return Path(d) if d else self.run_dir / "checkpoints"

    @property
    def telemetry_path(self) -> Path:
        p = jc.get_dotted(self.config, "telemetry.path")
        return Path(p) if p else self.run_dir / "telemetry.jsonl"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / f"attempt-{self.attempt}.log"

    @property
    def exit_file(self) -> Path:
        return self.run_dir / "attempts" / f"{self.attempt}.exit"

    def _set_state(self, to: RunState, reason: str) -> None:
        if to == self.state:
            return
        table_reason = check_transition(self.state, to)
        full = reason if table_reason in reason else f"{reason} ({table_reason})"
        self.store.set_run_state(self.run_id, to, full, attempt=self.attempt or None)
        log.info("state", run_id=self.run_id, frm=self.state.value, to=to.value, reason=full)
        self.say(f"state {self.state.value} -> {to.value}: {reason}")
        self.state = to
        if self.notifier is not None:
            self.notifier.status(self.status_line())

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
            self._launch(reason="first launch")
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
            return None
        # Under systemd the daemon restarts with the same command line: pick up the unfinished run of
        # this spec instead of starting a second one beside it.
        for run in self.store.list_runs():
            if RunState(run.state) not in TERMINAL and run.spec_path == str(Path(self.spec.source).resolve()):
                return run
        return None

    def _create_run(self) -> None:
        rid = self.requested_run_id or self.spec.run.run_id or (
            f"{self.spec.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(self.os.time()))}")
        self.run_id = rid
        self.run_dir = Path(self.dcfg.state_dir) / "runs" / rid
        (self.run_dir / "configs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        src = Path(self.spec.source)
        if src.is_file():
            (self.run_dir / "spec.toml").write_bytes(src.read_bytes())
        self.config = self.spec.job.model_dump(mode="json")
        self.store.create_run(rid, run_dir=str(self.run_dir), spec_path=str(src.resolve()),
                              spec=_jsonable(self.spec.raw), state=S.STARTING, reason="daemon started the run")
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
        # Incident bookkeeping lives in the store, not in the dead daemon's memory: pick it up again.
        for inc in self.store.list_incidents(run.id, status="remediating"):
            acts = self.store.list_actions(incident_id=inc.id)
            if acts:
                self.open_incidents[inc.id] = {"action_id": acts[-1].id, "step": inc.step}
        for inc in self.store.list_incidents(run.id, status="open"):
            self.unacted.setdefault(inc.symptom.value, []).append((inc.id, inc.step))
        if not attempts:
            self._launch(reason="adopted a run that never launched")
            return
        a = attempts[-1]
        self.attempt = a.number
        self._warm_engine(a.number)
        if a.pid and a.proc_start_time and a.ended_at is None:
            self.job = JobHandle(a.pid, a.proc_start_time)
            alive = self.os.is_alive(self.job)
            log.info("re-adopting", run_id=run.id, attempt=a.number, pid=a.pid, alive=alive, state=self.state.value)
            self.say(f"re-adopted run {run.id} attempt {a.number} (pid {a.pid}, {'alive' if alive else 'gone'})")
            self.attempt_started_mono = self.os.monotonic()
            self.attempt_progress = self.last_step is not None
            if self.state == S.STOPPING:
                self.after_exit = "stop"
                self._begin_termination("stop (re-adopted while stopping)", after="stop",
                                        grace=self.dcfg.stop_grace_s)
            elif self.state in (S.REMEDIATING, S.RESTARTING):
                # We were restarting: finish the job off and relaunch from the latest valid checkpoint.
                self._begin_termination("restart (re-adopted mid-restart)", after=Relaunch("re-adopted mid-restart"),
                                        grace=self.dcfg.stop_grace_s)
            # else: the exit (if any) is noticed by the next tick
        elif self.state == S.BACKOFF:
            self.pending_relaunch = Relaunch("re-adopted during backoff", counts_against_budget=False)
            self.backoff_until = now
        elif self.state in LIVE_JOB_STATES:
            self.pending_relaunch = Relaunch("re-adopted with no live attempt", counts_against_budget=False)
            self._set_state(S.BACKOFF, "no live attempt after daemon restart")
            self.backoff_until = now

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
            batch = warm.read()
            if not batch:
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
        from ulyssesd.training import checkpoint as ck

        notes: list[str] = []
        verify = bool(jc.get_dotted(self.config, "checkpoint.verify_checksums", True))

        def bad(tag: str, reason: str) -> None:
            notes.append(f"{tag} invalid: {reason}")
            try:
                moved = ck.quarantine(self.ckpt_dir / tag)
                notes[-1] += f"; quarantined as {moved.name}"
            except OSError as exc:
                notes[-1] += f"; quarantine failed: {exc}"
            self.store.upsert_checkpoint(self.run_id, tag, step=ck.step_of_tag(tag) or 0, valid=False,
                                         invalid_reason=reason)

        if not self.ckpt_dir.exists():
            return "none", notes
        if not os.access(self.ckpt_dir, os.R_OK | os.X_OK):
            raise PermissionError(f"checkpoint directory {self.ckpt_dir} is not readable by uid {os.geteuid()}")
        tags = ck.list_tags(self.ckpt_dir)

        def first_valid(candidates: list[str]) -> str | None:
            for tag in candidates:
                gib_ok = self._tag_gib(tag) <= self.dcfg.verify_max_gib
                ok, reason = ck.validate_tag(self.ckpt_dir / tag, verify and gib_ok)
                if ok:
                    return tag
                bad(tag, reason)
            return None

        if rollback_to_step is None:
            chosen = first_valid(list(reversed(tags)))
        else:
            older = [t for t in tags if (ck.step_of_tag(t) or 0) <= rollback_to_step]
            chosen = first_valid(list(reversed(older)))
            if chosen is None and rollback_to_step > 0:
                # The rollback target is gone (pruned, or invalid): the closest valid tag after it beats
                # starting from scratch and losing the whole run.
                chosen = first_valid([t for t in tags if (ck.step_of_tag(t) or 0) > rollback_to_step])
                if chosen is not None:
                    notes.append(f"no valid checkpoint at or before step {rollback_to_step} (pruned or invalid); "
                                 f"rolled back to the oldest valid one, {chosen}")
            # Tags after the rollback point belong to the abandoned (bad) trajectory: set them aside so a
            # later plain restart ("latest") can never resume from them. Renamed, not deleted (evidence).
            limit = ck.step_of_tag(chosen) if chosen else rollback_to_step
            for t in ck.list_tags(self.ckpt_dir):
                if (ck.step_of_tag(t) or 0) > (limit or 0):
                    target = self.ckpt_dir / f"{t}.rolledback-{int(self.os.time())}"
                    os.rename(self.ckpt_dir / t, target)
                    log.info("checkpoint set aside", tag=t, to=target.name)
                    self.say(f"  {t} set aside as {target.name} (after the rollback point)")
                    self.store.upsert_checkpoint(self.run_id, t, step=ck.step_of_tag(t) or 0, valid=False,
                                                 invalid_reason=f"rolled back past it (to step {limit})")
        if chosen is None:
            return "none", notes
        ck.point_latest_to(self.ckpt_dir, chosen)
        return chosen, notes

    def _tag_gib(self, tag: str) -> float:
        try:
            files = json.loads((self.ckpt_dir / tag / "manifest.json").read_text()).get("files", {})
            return sum(int(f.get("size", 0)) for f in files.values()) / (1 << 30)
        except (OSError, ValueError, AttributeError):
            return 0.0

    def _new_config_version(self, patch: dict[str, Any], reason: str) -> tuple[int, dict[str, list[Any]]]:
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

    def _launch(self, reason: str, rollback_to_step: int | None = None, incident_id: int | None = None) -> bool:
        """Launch the next attempt. Returns False when the run ended instead (FAILED)."""
        try:
            tag, notes = self._choose_checkpoint(rollback_to_step)
        except (PermissionError, OSError) as exc:
            self._fail(f"cannot read checkpoints: {exc}", symptom=Symptom.checkpoint_corrupt)
            return False
        if tag == "none" and notes and rollback_to_step is None:
            # Checkpoints existed and none is valid: like the job's exit 3, refuse to silently start the
            # run over from step 0; everything (quarantined tags included) is kept for a human.
            sid = self._incident(Symptom.checkpoint_corrupt, self.last_step or 0, Severity.critical,
                                 "no valid checkpoint left; not restarting from scratch",
                                 {"invalid": notes, "ckpt_dir": str(self.ckpt_dir)}, attempt=self.attempt + 1)
            self._action(sid, ActionKind.stop, {"reason": "no valid checkpoint left"}, {}, ApplyMode.none)
            self.store.update_incident_status(sid, IncidentStatus.failed, "no valid checkpoint left")
            self._fail(f"no valid checkpoint left in {self.ckpt_dir}: {'; '.join(notes)[:300]}")
            return False
        # "latest" = the newest valid tag, which is `tag` now that invalid ones are quarantined; an explicit
        # tag (or "none") only for a rollback; the user's own choice stands on the first attempt.
        want_load = "latest" if rollback_to_step is None else tag
        if self.attempt == 0:
            want_load = jc.get_dotted(self.config, "checkpoint.load")
        if want_load != jc.get_dotted(self.config, "checkpoint.load"):
            self._new_config_version({"checkpoint.load": want_load},
                                     f"resume from {tag}" + (f" (rollback to <= step {rollback_to_step})"
                                                             if rollback_to_step is not None else ""))
        if notes:
            sid = self._incident(Symptom.checkpoint_corrupt, self.last_step or 0, Severity.warning,
                                 f"checkpoint fallback: {notes[0][:120]}; resuming from {tag}",
                                 {"invalid": notes, "resumed_from": tag, "ckpt_dir": str(self.ckpt_dir)},
                                 attempt=self.attempt + 1)
            self._action(sid, ActionKind.restart, {"resume_from": tag, "skipped": notes}, {}, ApplyMode.restart)
            self.store.update_incident_status(sid, IncidentStatus.resolved, f"previous valid checkpoint {tag} used")
            self.say(f"checkpoint problem: {'; '.join(notes)} -> using {tag}")
        if rollback_to_step is not None:
            from ulyssesd.training.checkpoint import step_of_tag

            self.latest_ckpt = (tag, step_of_tag(tag) or 0) if tag != "none" else None
        self.attempt += 1
        # A fresh attempt reads control.json from scratch: neutral file (no keys = no change).
        jc.write_control(self.run_dir, suspect=False)
        launcher = self.spec.launcher
        if self.launch_env:
            launcher = launcher.model_copy(update={"env": {**launcher.env, **{k: str(v) for k, v in self.launch_env.items()
                                                                              if v is not None}}})
        plan = build_launch(launcher, run_id=self.run_id, run_dir=self.run_dir, attempt=self.attempt,
                            config_version=self.config_version)
        try:
            job = self._spawn_with_retries(plan)
        except LaunchError as exc:
            self.store.add_attempt(self.run_id, number=self.attempt, command=plan.argv,
                                   config_version=self.config_version, resumed_from=tag, host=socket.gethostname())
            self.store.end_attempt(self.run_id, self.attempt, returncode=127, diagnosis="launcher_error",
                                   diagnosis_evidence=[str(exc)])
            self._fail(str(exc), symptom=Symptom.launch_failure)
            return False
        self.plan, self.job = plan, job
        self.store.add_attempt(self.run_id, number=self.attempt, command=plan.argv, config_version=self.config_version,
                               resumed_from=None if tag == "none" else tag, host=socket.gethostname(),
                               pid=job.pid, pgid=job.pgid, proc_start_time=job.start_time)
        self.attempt_started_mono = self.os.monotonic()
        self.attempt_progress = False
        self.last_exiting = None
        self.after_exit = None
        self.hang_diagnosis, self.rank_lost = None, None
        self.rank_watch = RankWatch(self.dcfg.rank_exit_grace_s, self.dcfg.rank_watch_every_s)
        self._settle_unacted("the attempt ended before any action on it")
        if self.engine is not None:
            self.engine.on_restart(self.os.time(), attempt=self.attempt)
        if self.state != S.STARTING:
            self._set_state(S.STARTING, f"attempt {self.attempt} launched ({reason}) from {tag}")
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
        self._drain_events()
        if self.scheduler is not None:
            self.scheduler.run_due()
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
            self._launch(relaunch.reason, relaunch.rollback_to_step, relaunch.incident_id)
        self._publish()
        if self.notifier is not None:
            self.notifier.maybe_watchdog()

    def _publish(self) -> None:
        """Metrics and alert bookkeeping, from the loop (both helpers never block it)."""
        if self.metrics is not None:
            r = self.last_step_record
            self.metrics.update(run_id=self.run_id, step=self.last_step, loss=r.loss if r else None,
                                tokens_per_s=r.tokens_per_s if r else None,
                                mem_allocated_gib=r.mem_allocated_gib if r else None,
                                mem_max_allocated_gib=r.mem_max_allocated_gib if r else None,
                                state=self.state.value, restarts=max(0, self.attempt - 1),
                                incidents_by_symptom=self.incident_counts, config_version=self.config_version)
        if self.alerts is not None:
            for out in self.alerts.drain():
                log.info("alert outcome", ok=out.ok, attempts=out.attempts, error=out.error)

    def _alert(self, text: str) -> None:
        if self.alerts is not None:
            self.alerts.send(f"run {self.run_id}: {text}")

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
                time.sleep(self.dcfg.tick_s)
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
            if rec.event == "checkpoint_saved":
                tag = rec.fields.get("tag")
                if isinstance(tag, str) and rec.step is not None:
                    if self.latest_ckpt is None or rec.step >= self.latest_ckpt[1]:
                        self.latest_ckpt = (tag, rec.step)

    def _read_telemetry(self) -> None:
        assert self.reader is not None
        batch = self.reader.read()
        if not batch:
            return
        now = self.os.time()
        for rec, _off in batch:
            if rec.attempt is not None and rec.attempt != self.attempt:
                continue  # a late line of an earlier attempt
            self._on_record(rec, now)
        self._sync_known_good()
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
                self._set_state(S.RUNNING, f"attempt {self.attempt} is training"
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
            self._verify_open_incidents(rec.step or 0)
            self.say(f"checkpoint {f['tag']} saved")
        elif rec.event == "checkpoint_invalid":
            sid = self._incident(Symptom.checkpoint_corrupt, rec.step or 0, Severity.warning,
                                 f"job skipped invalid checkpoint {f.get('tag')}: {f.get('reason')}",
                                 {"tag": f.get("tag"), "reason": f.get("reason"), "source": "job"})
            self.store.update_incident_status(sid, IncidentStatus.resolved, "the job fell back to the previous valid tag")
        elif rec.event == "exiting":
            self.last_exiting = str(f.get("reason"))
        elif rec.event == "fault_injected":
            self.say(f"[fault injected by the job: {f.get('fault', f.get('kind'))} at step {rec.step}]")

    # ---------------------------------------------------------------- remediation outputs
    def _handle_outputs(self, out: Any, step: int) -> None:
        findings, decisions = _split_outputs(out)
        for fnd in findings:
            if fnd.symptom == "hang":
                if self.spec.remediation.mode == "observe":
                    iid = self._record_finding(fnd)
                    self.unacted.pop("hang", None)
                    self._action(iid, ActionKind.observe_only_noop,
                                 {"would": "stack dumps, SIGTERM, SIGKILL after grace, restart from latest"}, {},
                                 ApplyMode.none, observe_only=True)
                    continue
                self.on_hang(fnd)  # recorded once the stacks are captured
                continue
            self._record_finding(fnd)
        for dec in decisions:
            self._apply_decision(dec, step)

    def _record_finding(self, fnd: Any) -> int:
        sev = Severity(getattr(fnd, "severity", "warning"))
        iid = self._incident(Symptom(fnd.symptom), fnd.step if fnd.step is not None else (self.last_step or 0),
                             sev, getattr(fnd, "message", "") or fnd.symptom, dict(getattr(fnd, "evidence", {}) or {}))
        # A decision on this symptom (now, or after the grace window) belongs to this incident.
        lst = self.unacted.setdefault(fnd.symptom, [])
        if all(i != iid for i, _ in lst):
            lst.append((iid, fnd.step if fnd.step is not None else (self.last_step or 0)))
        return iid

    def _incident(self, symptom: Symptom, step: int, severity: Severity, summary: str, evidence: dict[str, Any],
                  attempt: int | None = None) -> int:
        iid = self.store.record_incident(self.run_id, attempt=attempt if attempt is not None else self.attempt,
                                         symptom=symptom, step=step, severity=severity, summary=summary,
                                         evidence=_jsonable(evidence))
        self.incident_counts[symptom.value] = self.incident_counts.get(symptom.value, 0) + 1
        log.info("incident", run_id=self.run_id, id=iid, symptom=symptom.value, step=step, summary=summary)
        self.say(f"INCIDENT #{iid} {symptom.value} at step {step}: {summary}")
        return iid

    def _action(self, incident_id: int | None, kind: ActionKind, params: dict[str, Any], diff: dict[str, Any],
                mode: ApplyMode, from_v: int | None = None, to_v: int | None = None, observe_only: bool = False) -> int:
        aid = self.store.record_action(self.run_id, kind, incident_id=incident_id, parameters=_jsonable(params),
                                       config_diff=_jsonable(diff), mode=mode, from_config_version=from_v,
                                       to_config_version=to_v, observe_only=observe_only).id
        if incident_id is not None:
            self.open_incidents[incident_id] = {"action_id": aid, "step": self.last_step or 0}
        return aid

    def _action_kind(self, dec: Any) -> ActionKind:
        apply = getattr(dec, "would_apply", None) or getattr(dec, "apply", "none")
        rung = getattr(dec, "action_kind", "")
        try:
            return ActionKind(rung)
        except ValueError:
            pass
        if apply == "hot":
            return ActionKind.hot_control
        if apply == "rollback_skip":
            return ActionKind.rollback_skip
        if apply == "stop":
            return ActionKind.stop
        if apply == "restart_latest":
            return ActionKind.set_config if getattr(dec, "config_patch", None) else ActionKind.restart
        return ActionKind.alert

    def _patch_of(self, dec: Any) -> dict[str, Any]:
        """The decision's JobSpec patch (launcher.env.* keys go to the launch environment instead)."""
        patch = dict(getattr(dec, "config_patch", {}) or {})
        if "data.skip_ranges" in patch:
            # The engine's value is the whole new list (it merges ranges itself).
            patch["data.skip_ranges"] = [list(r) for r in patch["data.skip_ranges"] or []]
        else:
            skips = [list(r) for r in (getattr(dec, "skip_ranges", None) or [])]
            if skips:
                cur = [list(r) for r in (jc.get_dotted(self.config, "data.skip_ranges") or [])]
                patch["data.skip_ranges"] = cur + [r for r in skips if r not in cur]
        return patch

    def _apply_decision(self, dec: Any, step: int) -> None:
        apply = getattr(dec, "apply", "none")
        symptom = Symptom(getattr(dec, "symptom", "crash"))
        dstep = getattr(dec, "step", None)
        dstep = dstep if dstep is not None else step
        reason = getattr(dec, "reason", "") or f"{symptom.value} remediation"
        kind = self._action_kind(dec)
        params = {"rung": getattr(dec, "action_kind", None), "ladder": getattr(dec, "ladder", None),
                  "apply": apply, "reason": reason}
        if symptom == Symptom.hang and self.term is not None:
            # The hang path (stack dump -> TERM -> KILL -> relaunch) already owns this attempt.
            if apply == "stop":
                self.term.after = self.after_exit = "fail"
                self.term.reason = reason
            return
        pending = self.unacted.pop(symptom.value, [])
        iid = pending[0][0] if pending else None
        for other, _ in pending[1:]:  # later findings of the same episode: one incident carries the action
            self.store.update_incident_status(other, IncidentStatus.resolved, f"same episode as incident {iid}")
        if iid is None:
            iid = self._incident(symptom, dstep, Severity.critical if apply in ("stop", "rollback_skip")
                                 else Severity.warning, reason, dict(getattr(dec, "evidence", {}) or {}))
        if apply == "none":
            observe = getattr(dec, "would_apply", None) is not None
            if params["rung"] == "collect_evidence" and not observe:
                params["evidence"] = self._host_evidence()
            self._action(iid, ActionKind.observe_only_noop if observe else kind,
                         {**params, "would_apply": getattr(dec, "would_apply", None),
                          "patch": getattr(dec, "config_patch", {}), "skip_ranges": getattr(dec, "skip_ranges", [])},
                         {}, ApplyMode.none, observe_only=observe)
            if not observe:
                self.store.update_incident_status(iid, IncidentStatus.escalated, reason)
                self._alert(f"{symptom.value} at step {dstep} escalated: {reason}")
            self.say(f"  {'observe-only: would' if observe else 'action:'} {params['rung']} — {reason}")
            return
        if self.term is not None and apply != "stop":
            self.say(f"  (attempt already terminating; {params['rung']} folded into the pending restart)")
            return
        if apply == "stop":
            self._action(iid, ActionKind.stop, params, {}, ApplyMode.none)
            self.store.update_incident_status(iid, IncidentStatus.escalated, reason)
            self.say(f"  action: stop — {reason}")
            self._stop_run(reason, fail=True)
            return
        if self.state in (S.RUNNING, S.STARTING):
            self._set_state(S.REMEDIATING, f"{symptom.value}: {reason}")
        from_v = self.config_version
        patch = self._patch_of(dec)
        if apply == "hot":
            to_v, diff = self._new_config_version(patch, f"{symptom.value}: {reason}") if patch else (from_v, {})
            hot = {k: v for k, v in dict(getattr(dec, "hot_control", {}) or {}).items() if k != "dump_stacks"}
            ctl = jc.write_control(self.run_dir, **hot)
            self._action(iid, kind, {**params, "control": ctl}, diff, ApplyMode.hot, from_v, to_v)
            self.store.update_incident_status(iid, IncidentStatus.remediating, f"hot: {reason}")
            self.say(f"  action: {params['rung']} hot via control.json v{ctl['version']} {hot}")
            if self.state == S.REMEDIATING:
                self._set_state(S.RUNNING, "hot fix applied, no restart")
            return
        # restart_latest | rollback_skip: new config version, then a graceful (or suspect) restart.
        rollback = getattr(dec, "rollback_to_step", None) if apply == "rollback_skip" else None
        to_v, diff = self._new_config_version(patch, f"{symptom.value}: {reason}") if patch else (from_v, {})
        suspect = apply == "rollback_skip" or bool((getattr(dec, "hot_control", {}) or {}).get("suspect"))
        if suspect:
            jc.write_control(self.run_dir, suspect=True)
        params.update(rollback_to_step=rollback, skip_ranges=getattr(dec, "skip_ranges", []), suspect=suspect)
        self._action(iid, kind, params, diff, ApplyMode.restart, from_v, to_v)
        self.store.update_incident_status(iid, IncidentStatus.remediating, reason)
        self.say(f"  action: {params['rung']} ({apply})" + (f", rollback to <= step {rollback}" if rollback is not None else "")
                 + (f", config v{from_v}->v{to_v}" if to_v != from_v else "") + f" — {reason}")
        relaunch = Relaunch(reason, iid, rollback)
        if self.job is not None and self.os.is_alive(self.job):
            self._set_state(S.RESTARTING, f"{symptom.value}: stopping attempt {self.attempt} to apply")
            self._begin_termination(f"{symptom.value} remediation", after=relaunch, grace=self.dcfg.stop_grace_s)
        else:
            self._schedule_relaunch(relaunch)

    def _host_evidence(self) -> dict[str, Any]:
        """Slow-step evidence the daemon can see: per-rank step times (telemetry), the job's processes'
        CPU use, and the busiest other processes on the host (CPU hogs)."""
        import psutil

        r = self.last_step_record
        ev: dict[str, Any] = {"load_avg": list(os.getloadavg()), "cpu_count": psutil.cpu_count()}
        if r is not None:
            ev["step_time_s"], ev["step_time_max_s"], ev["slowest_rank"] = r.step_time_s, r.step_time_max_s, r.slowest_rank
        mine = set(self.os.job_pids(self.job, self._marker())) if self.job is not None else set()
        procs = []
        for p in psutil.process_iter(["pid", "name", "cpu_percent", "cmdline"]):
            procs.append(p)
        time.sleep(0.2)  # cpu_percent needs an interval; bounded and rare (only on slow-step evidence)
        rows = []
        for p in procs:
            try:
                rows.append((p.cpu_percent(None), p.pid, " ".join(p.info.get("cmdline") or [])[:120] or p.info["name"]))
            except psutil.Error:
                continue
        rows.sort(reverse=True)
        ev["job_cpu_percent"] = {pid: cpu for cpu, pid, _ in rows if pid in mine}
        ev["top_other_processes"] = [{"pid": pid, "cpu_percent": cpu, "cmd": cmd} for cpu, pid, cmd in rows
                                     if pid not in mine and pid != os.getpid()][:5]
        return ev

    def _settle_unacted(self, reason: str, before_step: int | None = None) -> None:
        """Findings that never led to a decision (a spike that recovered inside the grace window, as
        BLOOM-176B's did) are resolved without action instead of staying open forever."""
        for symptom, lst in list(self.unacted.items()):
            keep = []
            for iid, step in lst:
                if before_step is None or step < before_step:
                    try:
                        self.store.update_incident_status(iid, IncidentStatus.resolved, reason)
                    except Exception as exc:  # noqa: BLE001 - bookkeeping only
                        log.warning("could not settle incident", id=iid, error=repr(exc))
                else:
                    keep.append((iid, step))
            if keep:
                self.unacted[symptom] = keep
            else:
                self.unacted.pop(symptom, None)

    def _verify_open_incidents(self, ckpt_step: int) -> None:
        """An incident whose fix was followed by a checkpoint with no recurrence is resolved."""
        grace = self.spec.remediation.grace_steps
        self._settle_unacted(f"recovered by itself: no action needed within the {grace}-step grace window "
                             f"(checkpoint at step {ckpt_step})", before_step=ckpt_step - grace)
        for iid, meta in list(self.open_incidents.items()):
            if ckpt_step > meta["step"]:
                try:
                    self.store.verify_action(meta["action_id"], "effective",
                                             {"verified_by": f"checkpoint at step {ckpt_step}"})
                    self.store.update_incident_status(iid, IncidentStatus.resolved,
                                                      f"training progressed to a checkpoint at step {ckpt_step}")
                except Exception as exc:  # noqa: BLE001 - verification bookkeeping is best effort
                    log.warning("could not resolve incident", id=iid, error=repr(exc))
                self.open_incidents.pop(iid, None)

    # ---------------------------------------------------------------------- termination
    def _begin_termination(self, reason: str, after: Any, grace: float, dump_stacks: bool = False,
                           on_stacks: Callable[[str], None] | None = None) -> None:
        assert self.job is not None
        now = self.os.monotonic()
        self.term = Termination(reason=reason, after=after, started=now, grace_s=grace, dump_stacks=dump_stacks,
                                log_offset=_size(self.log_path), on_stacks=on_stacks)
        self.after_exit = after
        if dump_stacks:
            self.term.stack_offsets = {str(f): _size(f) for f in self._stack_files()}
            ranks = self.os.rank_pids(self.job, self.spec.launcher.module, self.plan.marker if self.plan else None)
            sent = self.os.signal_pids(ranks, signal.SIGUSR1)
            self.term.dump_until = now + self.dcfg.stack_dump_wait_s
            log.info("stack dump requested", pids=sent)
            self.say(f"  SIGUSR1 (stack dump) -> ranks {sent}")
        self._advance_termination()

    def _stack_files(self) -> list[Path]:
        return sorted((self.run_dir / "stacks").glob(f"attempt-{self.attempt}-rank-*.txt"))

    def _collect_stacks(self, t: Termination) -> str:
        """The dumps written since SIGUSR1: per-rank files (the job's), copied into the attempt log under a
        header per rank; a job that wrote none (older job, stderr fallback) -> the log since the request."""
        per_rank: dict[int, str] = {}
        for f in self._stack_files():
            m = re.search(r"-rank-(\d+)\.txt$", f.name)
            text = _read_tail(f, STACKS_MAX_BYTES // 2, start=t.stack_offsets.get(str(f), 0))
            if m and text.strip():
                per_rank[int(m.group(1))] = text
        t.per_rank_stacks = per_rank
        if not per_rank:
            return _read_tail(self.log_path, STACKS_MAX_BYTES, start=t.log_offset)
        combined = "".join(f"=== rank {r} stack dump ({self.run_dir / 'stacks'}) ===\n{text}\n"
                           for r, text in sorted(per_rank.items()))
        try:
            with open(self.log_path, "a") as fh:  # the log stays the one place an operator reads
                fh.write(f"\n[ulyssesd] stack dumps of attempt {self.attempt} ({t.reason}):\n{combined}")
        except OSError as exc:
            log.warning("could not append stack dumps to the log", error=repr(exc))
        return combined

    def _watch_ranks(self) -> None:
        """A rank is gone but the launcher still runs: its peers are blocked in a collective and the launcher
        would wait 30 s before killing them (rank_watch.py). End the attempt now; it is handled as a crash."""
        assert self.job is not None
        now = self.os.monotonic()
        lost = self.rank_watch.observe(now, self.os.rank_pids(self.job, self.spec.launcher.module, self._marker()))
        if not lost:
            return
        self.rank_lost = {"pids": lost, "gone_for_s": round(now - min(self.rank_watch.lost_since.values()), 2),
                          "why": "a rank exited while the launcher still ran; its peers cannot finish a collective"}
        log.warning("rank lost, ending the attempt", pids=lost, attempt=self.attempt)
        self.say(f"  rank process(es) {lost} gone, launcher still running: stopping the remaining ranks now")
        # No save is possible with a dead peer, so no grace: SIGTERM, then SIGKILL on the next tick.
        self._begin_termination("rank lost", after=None, grace=0.0)

    def _marker(self) -> tuple[str, str]:
        return ("ULYSSESD_JOB_ID", f"{self.run_id}:{self.attempt}")

    def _advance_termination(self) -> None:
        t = self.term
        if t is None or self.job is None:
            return
        now = self.os.monotonic()
        if t.dump_stacks and t.termed_at is None:
            if now < t.dump_until:
                return
            stacks = self._collect_stacks(t)
            if t.on_stacks is not None:
                t.on_stacks(stacks)
        if t.termed_at is None:
            ranks = self.os.rank_pids(self.job, self.spec.launcher.module, self._marker())
            targets = ranks or [p for p in self.os.job_pids(self.job, self._marker()) if p != self.job.pid]
            sent = self.os.signal_pids(targets, signal.SIGTERM)
            t.termed_at = now
            self.say(f"  SIGTERM -> {sent} ({t.reason}); SIGKILL after {t.grace_s:.0f}s")
            return
        if t.killed_at is None and now - t.termed_at >= t.grace_s:
            pids = [p for p in self.os.job_pids(self.job, self._marker()) if p != self.job.pid]
            sent = self.os.signal_pids(pids, signal.SIGKILL)
            t.killed_at = now
            log.warning("grace over, SIGKILL", pids=sent, reason=t.reason)
            self.say(f"  grace over: SIGKILL -> {sent}")
            return
        if t.killed_at is not None and not t.wrapper_killed and now - t.killed_at >= 5.0:
            # The wrapper should have recorded the exit by now; if not, take it down too.
            self.os.signal_pids(self.os.job_pids(self.job, self._marker()), signal.SIGKILL)
            t.wrapper_killed = True

    def _stop_run(self, reason: str, fail: bool = False, pause: bool = False) -> None:
        after = "fail" if fail else ("pause" if pause else "stop")
        if self.job is not None and self.os.is_alive(self.job):
            if self.state != S.STOPPING:
                self._set_state(S.STOPPING, reason)
            if self.term is None:
                self._begin_termination(reason, after=after, grace=self.dcfg.stop_grace_s)
            else:
                self.term.after = after
                self.after_exit = after
        else:
            self.backoff_until, self.pending_relaunch = None, None
            if fail:
                self._fail(reason)
            elif pause:
                self._set_state(S.PAUSED, reason)
            else:
                self._set_state(S.STOPPED, reason)

    # ------------------------------------------------------------------------------ exits
    def _on_exit(self, status: ExitStatus) -> None:
        assert self.job is not None
        job = self.job
        self.job = None
        term = self.term
        self.term = None
        if term is not None and term.dump_stacks and term.termed_at is None and term.on_stacks is not None:
            # The attempt ended while we waited for its stack dumps: record the hang with what was written.
            self.term = term
            term.on_stacks(self._collect_stacks(term))
            self.term = None
        survivors = self.os.job_pids(job, self._marker())
        if survivors:
            # No orphan rank may outlive its attempt: kill whatever is left and say so.
            self.os.signal_pids(survivors, signal.SIGKILL)
            log.warning("killed processes that outlived their attempt", pids=survivors)
        ran_s = self.os.monotonic() - self.attempt_started_mono
        tail = _read_tail(self.log_path)
        after = self.after_exit
        self.after_exit = None
        diag_label, diag_evidence, diag_confidence = None, None, None
        crashed = not status.ok and after is None
        completed = status.ok and self.last_exiting == "completed"
        if crashed or (status.ok and after is None and not completed):
            from ulyssesd.remediation.diagnosis import diagnose

            rc = status.returncode if status.returncode is not None else (-status.signal if status.signal else None)
            d = diagnose(tail, rc, status.signal)
            diag_label, diag_evidence = d.label, list(d.evidence)
            diag_confidence = d.confidence
        if diag_label is None and self.hang_diagnosis is not None and self.hang_diagnosis[0] is not None:
            # Killed by the hang path: the stack dumps, not the log's last lines, say what it was.
            diag_label, diag_evidence = self.hang_diagnosis[0], self.hang_diagnosis[1]
        self.store.end_attempt(self.run_id, self.attempt, returncode=status.returncode, signal=status.signal,
                               diagnosis=diag_label, diagnosis_evidence=diag_evidence)
        log.info("attempt ended", run_id=self.run_id, attempt=self.attempt, status=status.describe(),
                 ran_s=round(ran_s, 1), last_step=self.last_step, after=str(after), exiting=self.last_exiting)
        self.say(f"attempt {self.attempt} ended: {status.describe()} after {ran_s:.0f}s (last step {self.last_step})")
        if completed:
            self._resolve_all("run completed")
            self._set_state(S.COMPLETED, f"reached final step {self.last_step}")
            return
        if after == "stop":
            self._set_state(S.STOPPED, "job exited after operator stop")
            return
        if after == "pause":
            self._set_state(S.PAUSED, "job saved and exited; paused")
            return
        if after == "fail":
            self._fail(term.reason if term else "stopped by the playbook")
            return
        if isinstance(after, Relaunch):
            self._schedule_relaunch(after)
            return
        # Unrequested exit: a crash (or a SIGTERM from someone else). Diagnose -> playbook -> relaunch.
        early = ran_s < self.dcfg.early_death_s and not self.attempt_progress
        self.counters.consecutive_early_deaths = self.counters.consecutive_early_deaths + 1 if early else 0
        evidence: dict[str, Any] = {"exit": status.describe(), "returncode": status.returncode, "signal": status.signal,
                    "diagnosis": diag_label, "evidence_lines": diag_evidence, "log_tail": tail[-8000:],
                    "ran_s": round(ran_s, 1), "early_death": early}
        if self.rank_lost is not None:
            evidence["rank_lost"] = self.rank_lost
        symptom = Symptom.launch_failure if early and diag_label == "launcher_error" else Symptom.crash
        if diag_label == "cuda_oom":
            symptom = Symptom.cuda_oom
        elif diag_label == "disk_full":
            symptom = Symptom.disk_full
        if status.returncode in (2, 3) and status.signal is None:
            # CONTRACTS.md: 2 = the job rejected its config, 3 = no loadable checkpoint left. Relaunching the
            # same thing cannot help, and starting from scratch would silently discard the run's progress.
            what = (f"the job rejected config v{self.config_version} (exit 2)" if status.returncode == 2
                    else "no valid checkpoint left to resume from (exit 3)")
            sym = Symptom.crash if status.returncode == 2 else Symptom.checkpoint_corrupt
            iid = self._incident(sym, self.last_step or 0, Severity.critical, what, evidence)
            self._action(iid, ActionKind.stop, {"reason": what}, {}, ApplyMode.none)
            self.store.update_incident_status(iid, IncidentStatus.failed, what)
            self._fail(what)
            return
        what = (f"rank process(es) {self.rank_lost['pids']} died; the daemon stopped the waiting ranks"
                if self.rank_lost is not None else f"attempt {self.attempt} {status.describe()}")
        iid = self._incident(symptom, self.last_step or 0, Severity.critical, f"{what}; diagnosis {diag_label}",
                             evidence)
        decisions: list[Any] = []
        if self.engine is not None:
            label = diag_label or "healthy"
            if label == "host_oom_killed" and diag_confidence != "high":
                # A bare SIGKILL with no OOM-killer line in the log (an operator, a chaos test, a node agent):
                # treat it as an unexplained crash (restart within budget) rather than run the host-memory
                # ladder, whose rungs may all be inapplicable and end the run.
                label = "sigkill_unexplained"
            _, decisions = _split_outputs(self.engine.on_crash(label, diag_evidence or [], self.os.time()))
        relaunch = Relaunch(f"crash ({diag_label})", iid)
        acted = False
        for dec in decisions:
            dec_apply = getattr(dec, "apply", "restart_latest")
            reason = getattr(dec, "reason", "") or f"crash {diag_label}"
            params = {"rung": getattr(dec, "action_kind", None), "ladder": getattr(dec, "ladder", None),
                      "apply": dec_apply, "reason": reason}
            target = iid
            # crash and launch_failure are one family: the engine labels a plain Python exception
            # (launcher_error) a launch failure, the supervisor knows whether it happened at start.
            if getattr(dec, "symptom", symptom.value) not in (symptom.value, Symptom.crash.value,
                                                              Symptom.launch_failure.value):
                # e.g. crash_loop / no_progress: its own incident, so the budget stop is visible as such.
                target = self._incident(Symptom(dec.symptom), self.last_step or 0, Severity.critical, reason,
                                        {"after_incident": iid})
            if dec_apply == "stop":
                self._action(target, ActionKind.stop, params, {}, ApplyMode.none)
                self.store.update_incident_status(target, IncidentStatus.failed, reason)
                if target != iid:
                    self.store.update_incident_status(iid, IncidentStatus.failed, reason)
                self._fail(reason)
                return
            if dec_apply == "none":
                observe = getattr(dec, "would_apply", None) is not None
                self._action(target, ActionKind.observe_only_noop if observe else self._action_kind(dec),
                             {**params, "would_apply": getattr(dec, "would_apply", None),
                              "patch": getattr(dec, "config_patch", {})}, {}, ApplyMode.none, observe_only=observe)
                continue
            from_v = self.config_version
            patch = self._patch_of(dec)
            to_v, diff = self._new_config_version(patch, f"crash {diag_label}: {reason}") if patch else (from_v, {})
            if dec_apply == "rollback_skip":
                relaunch.rollback_to_step = getattr(dec, "rollback_to_step", None)
            params["rollback_to_step"] = relaunch.rollback_to_step
            self._action(target, self._action_kind(dec), params, diff, ApplyMode.restart, from_v, to_v)
            self.say(f"  action: {params['rung']} — {reason}" + (f" (config v{from_v}->v{to_v})" if to_v != from_v else ""))
            acted = True
        if self.spec.remediation.mode == "observe":
            # Observe-only acts on nothing, restarts included: the run ends here, with what would have happened.
            self._action(iid, ActionKind.observe_only_noop, {"would": "restart from the latest valid checkpoint"},
                         {}, ApplyMode.none, observe_only=True)
            self.store.update_incident_status(iid, IncidentStatus.escalated, "observe-only: not restarted")
            self._fail(f"observe-only mode: attempt {self.attempt} ended ({status.describe()}) and was not restarted")
            return
        if not acted:
            self._action(iid, ActionKind.restart, {"reason": "crash: restart from the latest valid checkpoint"}, {},
                         ApplyMode.restart, self.config_version, self.config_version)
        self.store.update_incident_status(iid, IncidentStatus.remediating, "relaunching")
        self._schedule_relaunch(relaunch, early=early)

    def _schedule_relaunch(self, relaunch: Relaunch, early: bool = False) -> None:
        """Budget checks, then relaunch now or after a backoff."""
        now = self.os.time()
        rcfg = self.spec.remediation
        ckpt_step = self.latest_ckpt[1] if self.latest_ckpt else None
        if relaunch.counts_against_budget:
            self.counters.restarts = [t for t in self.counters.restarts if now - t < 3600] + [now]
            if self.counters.ckpt_step_at_last_restart is not None and ckpt_step == self.counters.ckpt_step_at_last_restart:
                self.counters.restarts_without_progress += 1
            elif self.counters.ckpt_step_at_last_restart is None and ckpt_step is None:
                self.counters.restarts_without_progress += 1
            else:
                self.counters.restarts_without_progress = 1 if ckpt_step is None else 0
            self.counters.ckpt_step_at_last_restart = ckpt_step
            if len(self.counters.restarts) > rcfg.max_restarts_per_hour:
                self._fail_budget(Symptom.crash_loop, f"{len(self.counters.restarts)} restarts in the last hour "
                                  f"(remediation.max_restarts_per_hour={rcfg.max_restarts_per_hour})")
                return
            if self.counters.restarts_without_progress > rcfg.no_progress_restarts:
                self._fail_budget(Symptom.no_progress, f"{self.counters.restarts_without_progress} restarts without "
                                  f"checkpoint advance (remediation.no_progress_restarts={rcfg.no_progress_restarts}); "
                                  f"latest checkpoint step {ckpt_step}")
                return
        delay = 0.0
        if early and self.counters.consecutive_early_deaths > 0:
            n = self.counters.consecutive_early_deaths
            delay = min(self.dcfg.backoff_max_s, self.dcfg.backoff_base_s * 2 ** (n - 1))
            delay *= 1 + 0.25 * random.random()  # jitter: decorrelate many daemons after a shared failure
        if delay > 0:
            self.pending_relaunch = relaunch
            self.backoff_until = now + delay
            self._set_state(S.BACKOFF, f"relaunch in {delay:.1f}s ({relaunch.reason})")
            return
        if self.state not in (S.RESTARTING,):
            self._set_state(S.RESTARTING, relaunch.reason)
        self._launch(relaunch.reason, relaunch.rollback_to_step, relaunch.incident_id)

    def _fail_budget(self, symptom: Symptom, reason: str) -> None:
        iid = self._incident(symptom, self.last_step or 0, Severity.critical, reason,
                             {"restarts_last_hour": len(self.counters.restarts),
                              "restarts_without_progress": self.counters.restarts_without_progress,
                              "latest_checkpoint": self.latest_ckpt[0] if self.latest_ckpt else None})
        self._action(iid, ActionKind.stop, {"reason": reason}, {}, ApplyMode.none)
        self.store.update_incident_status(iid, IncidentStatus.failed, reason)
        self._fail(reason)

    def _fail(self, reason: str, symptom: Symptom | None = None) -> None:
        if symptom is not None:
            iid = self._incident(symptom, self.last_step or 0, Severity.critical, reason, {"reason": reason})
            self.store.update_incident_status(iid, IncidentStatus.failed, reason)
        for iid in list(self.open_incidents):
            try:
                self.store.update_incident_status(iid, IncidentStatus.failed, f"run failed: {reason}")
            except Exception:  # noqa: BLE001
                pass
        self.open_incidents.clear()
        self.backoff_until, self.pending_relaunch = None, None
        self._set_state(S.FAILED, reason)
        self.say(f"RUN FAILED: {reason} (everything kept in {self.run_dir})")
        self._alert(f"FAILED at step {self.last_step}: {reason}")

    def _resolve_all(self, reason: str) -> None:
        for iid, meta in list(self.open_incidents.items()):
            try:
                self.store.verify_action(meta["action_id"], "effective", {"verified_by": reason})
                self.store.update_incident_status(iid, IncidentStatus.resolved, reason)
            except Exception:  # noqa: BLE001
                pass
        self.open_incidents.clear()

    # ------------------------------------------------------------------------------ hang
    def on_hang(self, fnd: Any) -> None:
        """Hang: stack dumps of every rank into the incident, then SIGTERM, then SIGKILL after grace."""
        if self.term is not None or self.job is None:
            return
        step = fnd.step if fnd.step is not None else (self.last_step or 0)
        evidence = dict(getattr(fnd, "evidence", {}) or {})
        summary = getattr(fnd, "message", "") or "no progress"
        attempt = self.attempt

        def with_stacks(stacks: str) -> None:
            per_rank = self.term.per_rank_stacks if self.term is not None else {}
            reading = read_hang(per_rank, unattributed=stacks)
            self.hang_diagnosis = (reading.label, [reading.summary])
            ev = dict(evidence, stacks=stacks or "(no stack dump written)",
                      threads_dumped=stacks.count("Current thread") + stacks.count("Thread 0x") if stacks else 0,
                      diagnosis=reading.label, stack_reading=reading.summary,
                      waited_for_ranks=list(reading.waited_for))
            iid = self._incident(Symptom.hang, step, Severity.critical, f"{summary} {reading.summary}", ev,
                                 attempt=attempt)
            self._action(iid, ActionKind.restart, {"reason": "hang: stack dump, SIGTERM, SIGKILL after grace, "
                                                   "restart from latest valid checkpoint"}, {}, ApplyMode.restart,
                         self.config_version, self.config_version)
            self.store.update_incident_status(iid, IncidentStatus.remediating, "restarting after hang")
            if isinstance(self.term.after if self.term else None, Relaunch):
                self.term.after.incident_id = iid  # type: ignore[union-attr]

        self._set_state(S.REMEDIATING, f"hang at step {step}: {summary}")
        self._set_state(S.RESTARTING, "hung attempt is being killed")
        self._begin_termination("hang", after=Relaunch("hang", None), grace=self.dcfg.hang_grace_s,
                                dump_stacks=True, on_stacks=with_stacks)

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
                self._stop_run(f"operator pause (uid {peer.get('uid')})", pause=True)
                return {"ok": True, "state": self.state.value}
            if cmd == "resume":
                if self.state != S.PAUSED:
                    return {"ok": False, "code": "bad_state", "error": f"run is {self.state.value}, not PAUSED"}
                self._launch("operator resume")
                return {"ok": True, "state": self.state.value}
            if cmd == "stop":
                if self.state in TERMINAL:
                    return {"ok": False, "code": "bad_state", "error": f"run is already {self.state.value}"}
                self._stop_run(f"operator stop (uid {peer.get('uid')})")
                return {"ok": True, "state": self.state.value}
            if cmd == "restart":
                if self.job is None or self.state not in (S.RUNNING, S.STARTING):
                    return {"ok": False, "code": "bad_state", "error": f"run is {self.state.value}; nothing to restart"}
                self._set_state(S.RESTARTING, "operator restart")
                self._begin_termination("operator restart", after=Relaunch("operator restart", None,
                                                                           counts_against_budget=False),
                                        grace=self.dcfg.stop_grace_s)
                return {"ok": True, "state": self.state.value}
            if cmd == "ack":
                iid = int(args.get("id", -1))
                self.store.ack_incident(iid, str(args.get("by") or f"uid:{peer.get('uid')}"))
                return {"ok": True, "id": iid}
            return {"ok": False, "code": "unknown_command", "error": f"unknown command {cmd!r}"}
        except Exception as exc:  # noqa: BLE001 - a bad request must not take the loop down
            log.warning("command failed", cmd=cmd, error=repr(exc))
            return {"ok": False, "code": "internal", "error": f"{type(exc).__name__}: {exc}"}

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
            "run_dir": str(self.run_dir), "daemon_pid": os.getpid(),
        }

    # -------------------------------------------------------------------- scheduler jobs
    def _setup_scheduler(self) -> None:
        if self.scheduler is None:
            return
        d = self.dcfg
        self.scheduler.add("checkpoint_retention", d.retention_every_s, self.job_retention)
        self.scheduler.add("store_maintenance", d.maintenance_every_s, self.job_maintenance)
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
        self.store.maintenance()

    def job_sweep(self) -> None:
        """Attempts the store thinks are live but whose process is gone (e.g. left by a crashed daemon
        for another run) are closed with what their exit file says."""
        from ulyssesd.daemon.process import _read_exit_file

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


def _split_outputs(out: Any) -> tuple[list[Any], list[Any]]:
    """Engine outputs -> (findings, decisions), whatever container the engine returns."""
    if out is None:
        return [], []
    if hasattr(out, "findings") or hasattr(out, "decisions"):
        return list(getattr(out, "findings", []) or []), list(getattr(out, "decisions", []) or [])
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, list) for x in out):
        return list(out[0]), list(out[1])
    findings: list[Any] = []
    decisions: list[Any] = []
    for item in out:
        (decisions if hasattr(item, "apply") else findings).append(item)
    return findings, decisions


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else (
        list(o) if isinstance(o, tuple | set) else str(o))))


def default_engine_factory(spec: RunSpec, config: dict[str, Any]) -> Any:
    from ulyssesd.remediation.engine import RemediationEngine

    return RemediationEngine(spec.detectors, spec.remediation, config)
