"""Start-up: create the run, or re-adopt the unfinished one a previous daemon left behind.

Re-adoption is exact because everything lives in the store and the run directory: the config versions, the
attempts (a live job is adopted by pid and start time), the telemetry cursor (the engine is warmed by
re-reading what was already processed, its decisions dropped), the incidents waiting for a fix to be
verified, and a relaunch the dead daemon had decided but not carried out (a pending rollback included).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.core import decisions, exits
from ulyssesd.daemon.core.exits import ExitRun
from ulyssesd.daemon.core.incident_log import jsonable
from ulyssesd.daemon.core.relaunch import Relaunch
from ulyssesd.daemon.core.states import LIVE_JOB_STATES, TERMINAL
from ulyssesd.daemon.core.termination import TerminationPlan, Then
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import JobHandle
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job import slurm_supervise
from ulyssesd.daemon.spec import RunSpec, engine_job_values
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.store.permissions import private_dir
from ulyssesd.daemon.store.recovery import refuse_unknown_run_dirs
from ulyssesd.daemon.telemetry import engine_snapshot
from ulyssesd.daemon.telemetry.engine_snapshot import EngineSnapshots
from ulyssesd.daemon.telemetry.telemetry_reader import Cursor, TelemetryReader
from ulyssesd.remediation.engine import LadderState
from ulyssesd.remediation.learned.fit_version import job_part
from ulyssesd.remediation.playbook import DEFAULTS, LADDERS, NON_FATAL
from ulyssesd.remediation.records import StepRecord

log = get_logger("ulyssesd.supervisor")
S = RunState


class StartupRun(ExitRun, Protocol):
    """What creating or re-adopting the run uses of it (and the exit path's `ExitRun`)."""

    run_lock: Callable[[Path, str], None] | None  # takes the per-run lock once the run is known
    requested_run_id: str | None
    engine_factory: Callable[[RunSpec, dict], Any]
    attempt_started_mono: float
    snapshots: EngineSnapshots  # the engine's learned state saved with the cursor


def find_existing_run(sup: StartupRun) -> Any:
    """The unfinished run to re-adopt: the one `--run-id`/`[run] run_id` names (from its directory when the
    store lost it), else the unfinished run of this spec file; None when there is none (a new run)."""
    rid = sup.requested_run_id or sup.spec.run.run_id
    if rid:
        try:
            run = sup.store.get_run(rid)
        except LookupError:
            run = None
        if run is not None and RunState(run.state) not in TERMINAL:
            return run
        if run is not None:
            raise RuntimeError(f"run {rid} already ended as {run.state}; choose a new --run-id")
        run_dir = Path(sup.dcfg.state_dir) / "runs" / rid
        if run_dir.is_dir():  # the store lost it (emptied / replaced database): adopt it from its directory
            return adopt_run_dir(sup, run_dir, rid)
        return None
    # Under systemd the daemon restarts with the same command line: pick up the unfinished run of
    # this spec instead of starting a second one beside it.
    for run in sup.store.list_runs():
        if RunState(run.state) not in TERMINAL and run.spec_path == str(Path(sup.spec.source).resolve()):
            return run
    return None


def adopt_run_dir(sup: StartupRun, run_dir: Path, rid: str) -> Any:
    """`--run-id X` of a run directory the store does not know: rebuild its rows from the directory
    (configs, checkpoints' manifests, attempts, telemetry cursor; store/recovery/) and re-adopt it."""
    from ulyssesd.daemon.store import recovery

    run = recovery.adopt_run_dir(sup.store, run_dir, rid, spec_path=str(Path(sup.spec.source).resolve()))
    if sup.run_lock is not None:
        sup.run_lock(run_dir, rid)
    what = recovery.rederive_run(sup.store, rid, run_dir)
    recovery.settle_adopted_state(sup.store, run, what)
    recovery.record_recovery(sup.store, rid, what, (
        f"run directory {run_dir} re-adopted with --run-id (the store did not know it): "
        f"{len(what['config_versions'])} config version(s), {len(what['checkpoints'])} checkpoint(s), "
        f"{len(what['attempts'])} attempt(s) re-derived, telemetry cursor at step {what['last_step']}"))
    log.info("run re-adopted from its directory", run_id=rid, run_dir=str(run_dir))
    sup.say(f"run {rid} re-adopted from its directory {run_dir}")
    return sup.store.get_run(rid)


def create_run(sup: StartupRun) -> None:
    rid = sup.requested_run_id or sup.spec.run.run_id or (
        f"{sup.spec.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(sup.os.time()))}")
    sup.run_id = rid
    sup.run_dir = Path(sup.dcfg.state_dir) / "runs" / rid
    refuse_unknown_run_dirs(sup.store, Path(sup.dcfg.state_dir), rid, sup.spec.source)
    for d in (sup.run_dir, sup.run_dir / "configs", sup.run_dir / "logs"):
        private_dir(d)
    if sup.run_lock is not None:
        sup.run_lock(sup.run_dir, rid)
    src = Path(sup.spec.source)
    if src.is_file():
        (sup.run_dir / "spec.toml").write_bytes(src.read_bytes())
    sup.config = sup.spec.job.model_dump(mode="json")
    sup.store.create_run(rid, run_dir=str(sup.run_dir), spec_path=str(src.resolve()),
                          spec=jsonable(sup.spec.raw), state=S.STARTING, reason="daemon started the run")
    # Stored configs carry the launcher env overrides remediation may add (`launcher.env.X`), so diffs
    # show them by their dotted key; the job's configs/vN.json stays a pure JobSpec.
    sup.store.add_config_version(rid, {**sup.config, "launcher": {"env": {}}}, reason="initial spec",
                                  parent_version=None, version=1)
    jc.write_json_atomic(sup.run_dir / "configs" / "v1.json", sup.config)
    sup.config_version = 1
    sup.engine = sup.engine_factory(sup.spec, sup.config)
    sup.snapshots.bind(sup.engine)
    sup.engine.replanner = lambda: exits._memory_replanner(sup)   # memory spikes re-plan as OOMs do
    sup.reader = TelemetryReader(sup.telemetry_path)
    log.info("run created", run_id=rid, run_dir=str(sup.run_dir))
    sup.say(f"run {rid} created in {sup.run_dir}")


def adopt(sup: StartupRun, run: Any) -> None:
    """Resume supervising a run a previous daemon left behind (its job may still be running)."""
    sup.run_id = run.id
    sup.run_dir = Path(run.run_dir)
    if sup.run_lock is not None:
        sup.run_lock(sup.run_dir, run.id)
    sup.state = RunState(run.state)
    cv = sup.store.list_config_versions(run.id)
    latest = max(cv, key=lambda c: c.version)
    sup.config_version, sup.config = latest.version, job_part(latest.config)   # the fit's keys are not the job's
    sup.launch_env = dict((sup.config.pop("launcher", None) or {}).get("env") or {})
    # The engine starts from v1 (its bounds are relative to the initial values); the warm-up replay walks it
    # through the telemetry's findings again (decisions dropped), and `seat_engine` then tells it the configs
    # the replay cannot reach. Its memory re-planner is set only after the replay (`replanner` below).
    v1 = dict(min(cv, key=lambda c: c.version).config)
    v1.pop("launcher", None)
    sup.engine = sup.engine_factory(sup.spec, v1)
    sup.snapshots.bind(sup.engine)  # what built it: a snapshot of another engine is not restored
    attempts = sup.store.list_attempts(run.id)
    now = sup.os.time()
    # The last hour's restart budget as the previous daemon spent it: operator relaunches were never in it.
    sup.counters.restarts = [r.started_at.timestamp() for r in sup.store.list_relaunches(run.id)
                             if not r.by_operator and now - r.started_at.timestamp() < 3600]
    cursor = sup.store.get_telemetry_cursor(run.id)
    sup.reader = TelemetryReader(sup.telemetry_path,
                                  Cursor(cursor.inode, cursor.offset) if cursor is not None else None)
    for ck in sup.store.list_checkpoints(run.id):
        if ck.valid and (sup.latest_ckpt is None or ck.step > sup.latest_ckpt[1]):
            sup.latest_ckpt = (ck.tag, ck.step)
    sup.incidents.pick_up(run.id)
    if not attempts:
        sup.engine.replanner = replanner(sup)
        sup.launch(reason="adopted a run that never launched")
        return
    a = attempts[-1]
    sup.attempt = a.number
    reported = warm_engine(sup, a.number)
    seat_engine(sup, cv, a.number, reported if reported is not None else a.config_version)
    restore_ladders(sup)
    sup.engine.replanner = replanner(sup)
    if a.pid and a.proc_start_time and a.ended_at is None:
        sup.job = JobHandle(a.pid, a.proc_start_time)
        alive = sup.os.is_alive(sup.job)
        if not alive and (watcher := slurm_supervise.reattach(sup, a)) is not None:
            sup.job, alive = watcher, True  # its Slurm job still runs: a new watcher took it over
        log.info("re-adopting", run_id=run.id, attempt=a.number, pid=a.pid, alive=alive, state=sup.state.value)
        sup.say(f"re-adopted run {run.id} attempt {a.number} (pid {a.pid}, {'alive' if alive else 'gone'})")
        sup.attempt_started_mono = sup.os.monotonic()
        sup.attempt_progress = sup.last_step is not None
        if sup.state == S.STOPPING:
            sup.begin_termination("stop (re-adopted while stopping)", TerminationPlan(Then.STOP),
                                    grace=sup.dcfg.stop_grace_s)
        elif sup.state in (S.REMEDIATING, S.RESTARTING):
            # We were restarting: finish the job off and relaunch from the latest valid checkpoint.
            sup.begin_termination("restart (re-adopted mid-restart)", TerminationPlan.relaunching(
                decided_relaunch(sup, a.number, "re-adopted mid-restart", True)), grace=sup.dcfg.stop_grace_s)
        # else: the exit (if any) is noticed by the next tick
    elif sup.state == S.BACKOFF:
        sup.pending_relaunch = decided_relaunch(sup, a.number, "re-adopted during backoff", False)
        sup.backoff_until = now
    elif sup.state in LIVE_JOB_STATES:
        sup.pending_relaunch = decided_relaunch(sup, a.number, "re-adopted with no live attempt", False)
        sup.set_state(S.BACKOFF, "no live attempt after daemon restart")
        sup.backoff_until = now


def decided_relaunch(sup: StartupRun, attempt: int, reason: str, counts: bool) -> Relaunch:
    """The relaunch a previous daemon decided for `attempt` but did not carry out (it died in between):
    the newest restart-mode action on that attempt's incidents, read back from the store, so that a
    rollback-and-skip is not silently turned into a restart from the latest, possibly bad, checkpoint."""
    decided = sup.store.restart_actions(sup.run_id, attempt)  # one query: a long run has 10^5 actions
    if not decided:
        return Relaunch(reason, counts_against_budget=counts)
    last = decided[-1]
    target = (last.parameters or {}).get("rollback_to_step")
    rollback = target if isinstance(target, int) and not isinstance(target, bool) else None
    if rollback is not None:
        log.info("pending rollback picked up from the store", to_step=rollback, action=last.id)
        sup.say(f"pending rollback to <= step {rollback} (action {last.id}) picked up from the store")
        reason += f"; pending rollback to <= step {rollback}"
    return Relaunch(reason, last.incident_id, rollback, counts_against_budget=counts)


def replanner(sup: StartupRun) -> Callable[[], Any]:
    """The engine's memory re-planner: memory spikes re-plan the daemon's current config as OOMs do."""
    return lambda: exits._memory_replanner(sup)


def engine_values(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config version (job config + `launcher.env`) as the engine holds it: the engine's defaults
    under the config's dotted values, as `RemediationEngine.__init__` takes them, the launcher env included."""
    cfg = job_part(stored)
    env = (cfg.pop("launcher", None) or {}).get("env") or {}
    return {**DEFAULTS, **{k: v for k, v in engine_job_values(cfg, env).items() if v is not None}}


def seat_engine(sup: StartupRun, versions: list[Any], attempt: int, running: int | None) -> None:
    """What the replay cannot walk the engine to: a crash's fix comes from the exit handling, not from a
    record, so after re-adoption the engine's `values` would still be v1's and its `launched` (lr_scale and
    reverts are relative to it) would not be the config the live attempt runs. Tell it: `values` are the
    newest config version (what the next attempt launches with), `launched` the version the attempt runs
    (`running`: its telemetry's `config_version`, else the attempt's row; unknown: the newest)."""
    by_version = {c.version: c for c in versions}
    newest = max(by_version)
    if running not in by_version:
        if running is not None:
            log.warning("the attempt reports a config version the store does not have; taking the newest",
                        attempt=attempt, reported=running, newest=newest)
        running = newest
    fitted = by_version[newest].config.get("detectors")
    if fitted and getattr(sup.engine, "calibration", True) is None:   # the replay did not reach the fit: keep it
        for key, value in fitted.items():
            setattr(sup.engine.config, key, value)
    try:
        sup.engine.values = engine_values(by_version[newest].config)
        sup.engine.launched = engine_values(by_version[running].config)
    except Exception as exc:  # noqa: BLE001 - a stored config that no longer validates: keep the replay's view
        log.warning("could not seat the engine on the stored configs; keeping the replay's values",
                    error=repr(exc))
        return
    log.info("engine seated on the stored configs", attempt=attempt, runs_version=running, newest=newest)


def ladder_position(ladder: str, done: list[tuple[str, int]], verify_steps: int, max_uses: Callable[[Any], int],
                    now_step: int) -> tuple[int, int, int]:
    """(position, uses, verification steps left) of `ladder` after the rungs `done` [(rung, step it was taken
    at)], oldest first, as the engine walks them: a rung taken again counts one more use, a later rung moves
    the position on (a memory rung chosen by evidence may also move it back); a repeatable rung whose
    verification window passed without a recurrence is fresh again (uses 0), as in the engine."""
    names = [r.kind for r in LADDERS[ladder]]
    pos, uses, at = 0, 0, None
    for rung, step in done:
        idx = next((i for i in range(pos, len(names)) if names[i] == rung), None)
        idx = names.index(rung) if idx is None else idx
        repeatable = max_uses(LADDERS[ladder][idx]) > 1
        if idx == pos and uses and not (repeatable and at is not None and step - at >= verify_steps):
            uses += 1
        else:
            pos, uses = idx, 1
        at = step
    left = max(0, verify_steps - (now_step - at)) if at is not None else 0
    if left == 0 and pos < len(names) and max_uses(LADDERS[ladder][pos]) > 1:
        uses = 0
    return pos, uses, left


def restore_ladders(sup: StartupRun) -> None:
    """The telemetry replay walks the engine's ladders through the findings it sees again, but not through a
    crash's or a hang's decision (the exit handling and the clock made those, not a record): after re-adoption
    the next crash would start its ladder at rung 0 again and a bounded rung (`max_crash_restarts`) would get
    its uses afresh. The store has every decision taken (each action's `ladder` and `rung`): a ladder the
    store shows further along than the replay left it is set to the store's position."""
    eng = sup.engine
    ladders = getattr(eng, "ladders", None)
    if not isinstance(ladders, dict):
        return  # an engine without ladders (a test's stand-in): nothing to restore
    done: dict[str, list[tuple[str, int]]] = {}
    for ladder, rung, step in sup.store.ladder_rungs(sup.run_id):  # one query: a long run has 10^5 actions
        if ladder in LADDERS and rung in {r.kind for r in LADDERS[ladder]}:
            done.setdefault(ladder, []).append((rung, step))
    now_step = eng.last_step if eng.last_step is not None else (sup.last_step or 0)
    policy = eng.policy
    for ladder, rungs in done.items():
        pos, uses, left = ladder_position(ladder, rungs, policy.verify_steps, lambda a: a.max_uses(policy), now_step)
        st = ladders.get(ladder)
        if st is not None and (st.position, st.uses) >= (pos, uses):
            continue  # the replay walked it as far (a telemetry finding's rung): its own state is exact
        st = ladders.setdefault(ladder, LadderState())
        st.position, st.uses, st.verify_left = pos, uses, max(st.verify_left, left)
        st.exhausted = st.exhausted or (ladder in NON_FATAL and pos < len(LADDERS[ladder])
                                        and LADDERS[ladder][pos].kind == "alert")
        log.info("engine ladder restored from the store", ladder=ladder, rung=LADDERS[ladder][pos].kind,
                 position=pos, uses=uses, verify_left=st.verify_left)


def warm_engine(sup: StartupRun, attempt: int) -> int | None:
    """Feed the current attempt's already-processed records to a fresh engine (baselines, hang clock)
    and drop its decisions: they were acted upon by the previous daemon. Returns the config version the
    attempt's own records say it runs (None when they say none)."""
    assert sup.reader is not None
    limit = sup.reader.cursor.offset
    if limit <= 0 or not sup.telemetry_path.exists():
        return None
    # The engine's snapshot at or before the cursor (telemetry/engine_snapshot.py): only the records after it
    # are replayed. Without a usable one, every record from the start.
    start, reported = engine_snapshot.restore(sup, sup.reader.cursor.inode, limit)
    warm = TelemetryReader(sup.telemetry_path, Cursor(sup.reader.cursor.inode, start) if start else None)
    fed = 0
    while warm.cursor.offset < limit:
        scanned = warm.scanned_to
        batch = warm.read()
        if not batch and warm.scanned_to == scanned:  # bad lines or an over-long one still move it
            break
        for rec, off in batch:
            if off > limit:
                break
            decisions.track(sup, rec)
            if rec.attempt == attempt:
                version = rec.config_version if isinstance(rec, StepRecord) else rec.fields.get("config_version")
                if type(version) is int:
                    reported = version
            # Every attempt's records, at their own timestamps: restart history (budget), known-good
            # tags and baselines come back as they were; `started` events re-run the engine's restarts.
            try:
                sup.engine.observe(rec, rec.time if rec.time is not None else decisions.engine_now(sup))
            except Exception as exc:  # noqa: BLE001
                log.warning("engine warm-up failed on a record", error=repr(exc))
            fed += 1
    log.info("engine warmed from telemetry", records=fed, from_offset=start, up_to_offset=limit, attempt=attempt,
             reported_config_version=reported)
    return reported
