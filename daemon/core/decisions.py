"""The running attempt: its telemetry records -> the engine -> findings and decisions -> incidents, actions
and the job (hot control, new config version + graceful restart, rollback, stop, the hang path).

`read_telemetry` hands each new record to `on_record` (a record whose handling raises is logged, counted and
skipped), which feeds the engine; `handle_outputs` applies what it returns. The incidents' lifecycle
afterwards (settled when nothing acted, resolved when a checkpoint follows the fix) is the `IncidentLog`'s;
the crash path after an attempt ended is `exits.py`, the termination phases are `termination.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

from ulyssesd.daemon import calibration_record
from ulyssesd.daemon.calibration_record import carried_fit  # noqa: F401 - the supervisor calls decisions.carried_fit
from ulyssesd.daemon.clock import SteadyWall
from ulyssesd.daemon.coexist.watch import InnerRestartWatch
from ulyssesd.daemon.core.housekeeping import HousekeepingRun
from ulyssesd.daemon.core.relaunch import Relaunch, RelaunchRun, schedule_relaunch
from ulyssesd.daemon.core.termination import TerminationPlan, Then
from ulyssesd.daemon.host import disk
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job.checkpoint_watch import CheckpointWatchRun
from ulyssesd.daemon.job.early_warning import early_warnings
from ulyssesd.daemon.job.slurm_supervise import SlurmRun
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.telemetry import engine_snapshot, log_source
from ulyssesd.daemon.telemetry.engine_snapshot import EngineSnapshots
from ulyssesd.daemon.telemetry.telemetry_reader import DRAIN_BUDGET_S
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision
from ulyssesd.remediation.hang_stacks import read_hang
from ulyssesd.remediation.records import EventRecord, Record, StepRecord

log = get_logger("ulyssesd.supervisor")
S = RunState


class DecisionsRun(RelaunchRun, HousekeepingRun, CheckpointWatchRun, SlurmRun, Protocol):
    """What the telemetry -> engine -> decisions path uses of the run (and what the parts it calls use)."""

    engine: Any  # the remediation engine
    record_errors: int  # telemetry records whose handling raised
    last_step_record: StepRecord | None
    save_failures: dict[int, dict[str, Any]]  # attempt -> its job's checkpoint_save_failed event
    hang_diagnosis: tuple[str | None, list[str]] | None  # what the hang path read from the stack dumps
    attempt_progress: bool
    last_exiting: str | None
    inner: InnerRestartWatch  # restarts an inner launcher made (daemon/coexist/)
    snapshots: EngineSnapshots  # the engine's learned state saved with the cursor (telemetry/engine_snapshot.py)


def engine_now(sup: Any) -> float:
    """The time the remediation engine is given: the run's clock on a scale that never steps (clock.SteadyWall,
    the supervisor's `steady`), so the hang detector's silence is measured on monotonic time whatever the wall
    clock does. A run without one (a test's) gets its own, made once."""
    steady = getattr(sup, "steady", None) or getattr(sup, "engine_clock", None)
    if steady is None or getattr(steady, "clock", sup.os) is not sup.os:
        steady = SteadyWall(sup.os)
        sup.engine_clock = steady
    return float(steady.now())


def track(sup: DecisionsRun, rec: Record) -> None:
    """What the supervisor remembers of a record: the last step, the job's `exiting` reason, a failed save,
    the newest checkpoint (also for records replayed into a warm engine at re-adoption)."""
    if isinstance(rec, StepRecord):
        sup.last_step = rec.step
        sup.last_step_record = rec
    elif isinstance(rec, EventRecord):
        if rec.event == "exiting" and rec.attempt in (None, sup.attempt):
            sup.last_exiting = str(rec.fields.get("reason"))
        if rec.event == "checkpoint_save_failed":
            sup.save_failures[rec.attempt if rec.attempt is not None else sup.attempt] = dict(rec.fields)
        if rec.event == "checkpoint_saved":
            tag = rec.fields.get("tag")
            if isinstance(tag, str) and rec.step is not None:
                if sup.latest_ckpt is None or rec.step >= sup.latest_ckpt[1]:
                    sup.latest_ckpt = (tag, rec.step)


def read_telemetry(sup: DecisionsRun) -> None:
    """Hand the job's new records to `on_record`, then persist the cursor (after they were acted upon). A
    backlog (the reader stopped at its byte bound) is read on, batch after batch, for up to DRAIN_BUDGET_S of
    the tick while nothing changed the run's state; each batch's cursor is stored before the next is read."""
    assert sup.reader is not None
    log_source.pump(sup)  # [telemetry] source = "stdout": the job's new log lines become records first
    deadline, state, term = sup.os.monotonic() + DRAIN_BUDGET_S, sup.state, sup.term
    while (read_batch(sup) and sup.reader.behind and sup.state == state and sup.term is term
           and sup.os.monotonic() < deadline):
        pass


def read_batch(sup: DecisionsRun) -> bool:
    """One reader batch: its records acted upon, then its cursor stored. False when nothing was consumed."""
    assert sup.reader is not None
    offset_before = sup.reader.cursor.offset
    batch = sup.reader.read()
    if not batch and sup.reader.cursor.offset == offset_before:
        return False
    now = sup.steady.now()  # the engine's clock: a wall-clock step is no hang (daemon/clock.py)
    saved = False
    for rec, _off in batch:
        if rec.attempt is not None and rec.attempt != sup.attempt:
            continue  # a late line of an earlier attempt
        saved = saved or (isinstance(rec, EventRecord) and rec.event == "checkpoint_saved")
        try:
            on_record(sup, rec, now)
        except Exception:  # noqa: BLE001 - one record must not end supervision (and not on every restart)
            sup.record_errors += 1
            log.exception("handling a telemetry record failed; skipped", run_id=sup.run_id,
                          step=rec.step, kind=rec.kind, count=sup.record_errors)
    sync_known_good(sup)
    if saved:  # the checkpoint directory's budget after every save, not only on the retention timer
        retention_after_save(sup)
    # Persisted even when only bad lines were consumed: a restart must not re-read them.
    cur = sup.reader.cursor
    sup.store.set_telemetry_cursor(sup.run_id, path=str(sup.telemetry_path), inode=cur.inode,
                                    offset=cur.offset, last_step=sup.last_step)
    engine_snapshot.after_batch(sup, len(batch))  # exact at the cursor just stored: a restart resumes there
    return True


def retention_after_save(sup: DecisionsRun) -> None:
    from ulyssesd.daemon.core.housekeeping import retention

    try:
        retention(sup)
    except Exception:  # noqa: BLE001 - the timer runs it again; reading telemetry must go on
        log.exception("checkpoint retention after a save failed", run_id=sup.run_id)


def sync_known_good(sup: DecisionsRun) -> None:
    """Mirror the engine's known-good tags (checkpoints followed by a clean window) into the store;
    retention keeps them as anchors and `ulyssesctl status` shows the newest."""
    for tag, step in list(getattr(sup.engine, "known_good", []) or []):
        if tag not in sup.known_good_marked:
            sup.store.upsert_checkpoint(sup.run_id, tag, step=step, known_good=True)
            sup.known_good_marked.add(tag)


def on_record(sup: DecisionsRun, rec: Record, now: float) -> None:
    """One record of the running attempt: progress, the job's events, then the engine and its outputs."""
    track(sup, rec)
    sup.inner.observe(sup.attempt, rec, step=sup.last_step or 0, incident=sup.incidents.incident, say=sup.say,
                      feed_engine=lambda r: on_record(sup, r, now))  # an inner launcher's restart (daemon/coexist/)
    if isinstance(rec, StepRecord) or (isinstance(rec, EventRecord) and rec.event in ("started",)):
        sup.attempt_progress = sup.attempt_progress or isinstance(rec, StepRecord)
        if sup.state == S.STARTING:
            sup.set_state(S.RUNNING, f"attempt {sup.attempt} is training"
                            if isinstance(rec, StepRecord) else f"attempt {sup.attempt} started")
    if isinstance(rec, EventRecord):
        on_event(sup, rec)
    if sup.engine is not None:
        handle_outputs(sup, sup.engine.observe(rec, engine_now(sup)), step=rec.step if rec.step is not None else (sup.last_step or 0))
        if getattr(sup.engine, "calibration_new", False):
            calibration_record.save_calibration(sup)
        if getattr(sup.engine, "new_warnings", None) or getattr(getattr(sup.engine, "preempt", None), "outcomes", None):
            early_warnings(sup)   # said and alerted; a pre-emptive clip applied and verified (daemon/job/early_warning.py)


def on_event(sup: DecisionsRun, rec: EventRecord) -> None:
    """The job's own events: a checkpoint saved (and the fixes it verifies), one it skipped, its exit reason."""
    f = rec.fields
    if rec.event == "checkpoint_saved" and isinstance(f.get("tag"), str):
        sup.store.upsert_checkpoint(sup.run_id, f["tag"], step=rec.step or 0, loss=None, valid=True,
                                     attempt=sup.attempt, config_version=sup.config_version)
        sup.incidents.verify(rec.step or 0, sup.spec.remediation.grace_steps)
        disk.save_written(sup, f["tag"], rec.step or 0)  # ends a skipped-save episode (host/disk.py)
        log.info("checkpoint saved", tag=f["tag"], step=rec.step)
        sup.say(f"checkpoint {f['tag']} saved")
    elif rec.event == "checkpoint_skipped":
        disk.save_skipped(sup, rec.step or 0, dict(f))
    elif rec.event == "checkpoint_loaded" and isinstance(f.get("tag"), str) and sup.spec.job_section.kind == "command":
        from ulyssesd.daemon.job.checkpoint_watch import reported_resume

        reported_resume(sup, f["tag"], rec.step)   # the attempt's "resumed from" follows what the job says
    elif rec.event == "checkpoint_invalid":
        sid = sup.incidents.incident(Symptom.checkpoint_corrupt, rec.step or 0, Severity.warning,
                             f"job skipped invalid checkpoint {f.get('tag')}: {f.get('reason')}",
                             {"tag": f.get("tag"), "reason": f.get("reason"), "source": "job"})
        sup.store.update_incident_status(sid, IncidentStatus.resolved, "the job fell back to the previous valid tag")
    elif rec.event == "exiting":
        sup.last_exiting = str(f.get("reason"))
    elif rec.event == "in_process_restart":
        from ulyssesd.daemon.telemetry.in_process import record_in_process_restart

        record_in_process_restart(sup.incidents, sup.store, sup.say, rec.step, dict(f))
    elif rec.event == "fault_injected":
        log.info("fault injected by the job", fault=f.get("fault", f.get("kind")), step=rec.step)
        sup.say(f"[fault injected by the job: {f.get('fault', f.get('kind'))} at step {rec.step}]")


def handle_outputs(sup: DecisionsRun, out: Iterable[Finding | Decision], step: int) -> None:
    findings, decisions = _split_outputs(out)
    if any(f.symptom == "hang" for f in findings) or any(d.symptom == "hang" for d in decisions):
        from ulyssesd.daemon.job.slurm_supervise import node_loss_pending

        if lost := node_loss_pending(sup):  # the Slurm watcher is ending the job for a lost node: that path decides
            sup.say(f"  no progress: node {', '.join(lost)} lost, the Slurm job is being ended; not a hang")
            findings = [f for f in findings if f.symptom != "hang"]
            decisions = [d for d in decisions if d.symptom != "hang"]
    for fnd in findings:
        if fnd.symptom == "nan_loss" and fnd.step is not None and sup.spec.job_section.kind == "command":
            from ulyssesd.daemon.job.checkpoint_watch import poisoned_from

            poisoned_from(sup, fnd.step)   # a save already on disk at or after this step is never resumed
        if fnd.symptom == "hang":
            if sup.spec.remediation.mode == "observe":
                iid = sup.incidents.finding(fnd)
                sup.incidents.take_unacted("hang")
                sup.incidents.action(iid, ActionKind.observe_only_noop,
                            {"would": "stack dumps, SIGTERM, SIGKILL after grace, restart from latest"}, {},
                            ApplyMode.none, observe_only=True)
                continue
            on_hang(sup, fnd)  # recorded once the stacks are captured
            continue
        from ulyssesd.daemon.job.slurm_supervise import with_nodes

        sup.incidents.finding(with_nodes(sup, fnd))  # a Slurm job's straggler: its node is named too
    for dec in decisions:
        try:
            apply_decision(sup, dec, step)
        except OSError as exc:
            if disk.errno_of(exc) is None:
                decision_failed(sup, dec, step, exc)
                continue
            decision_write_failed(sup, dec, exc)
        except Exception as exc:  # noqa: BLE001 - recorded as the incident's failed action, never skipped
            decision_failed(sup, dec, step, exc)


def decision_failed(sup: DecisionsRun, dec: Decision, step: int, exc: BaseException) -> None:
    """Building or applying a decision raised (e.g. its config patch fails validation): the incident gets
    the failed action with the error, the operator an alert, and the engine forgets the rung (no later
    decision may claim its verification window); the job keeps training unchanged."""
    what = f"{dec.action_kind} for {dec.symptom}"
    err = f"{type(exc).__name__}: {exc}"
    log.warning("a decision could not be applied; recorded, the job continues unchanged", decision=what,
                error=err)
    if sup.engine is not None and hasattr(sup.engine, "not_applied"):
        sup.engine.not_applied(dec, err)
    symptom = Symptom(dec.symptom)
    pending = sup.incidents.take_unacted(symptom.value)
    iid = pending[0][0] if pending else sup.incidents.incident(
        symptom, dec.step if dec.step is not None else step, Severity.warning, dec.reason or what, {})
    sup.incidents.action(iid, ActionKind.alert, {"rung": dec.action_kind, "ladder": dec.ladder, "apply": "none",
                                                 "failed": err, "not_applied": True, "patch": dec.config_patch,
                                                 "reason": dec.reason}, {}, ApplyMode.none)
    sup.store.update_incident_status(iid, IncidentStatus.escalated, f"{what} could not be applied: {err}")
    sup.say(f"  could not apply {what}: {err} (recorded; the job continues unchanged)")
    sup.alert("incident", f"could not apply {what}: {err}", symptom=symptom.value, escalated=True)
    if sup.state == S.REMEDIATING and sup.term is None:
        sup.set_state(S.RUNNING, f"decision not applied: {err}")


def decision_write_failed(sup: DecisionsRun, dec: Decision, exc: OSError) -> None:
    """The daemon could not write control.json / configs/vN.json for a decision (full or read-only disk).
    Degrade: the job keeps training unchanged, the failure is logged and alerted; a recurrence of the
    symptom escalates as usual, and the next launch's write probe handles the disk (prune / clean stop)."""
    what = f"{dec.action_kind} for {dec.symptom}"
    log.warning("a decision's write to the run directory failed; the job continues unchanged",
                decision=what, errno=disk.errno_of(exc), error=repr(exc))
    sup.say(f"  could not apply {what}: {exc} (the job continues unchanged)")
    sup.alert("incident", f"could not apply {what}: {disk.errno_of(exc)} writing to {sup.run_dir}")
    if sup.state == S.REMEDIATING and sup.term is None:
        sup.set_state(S.RUNNING, f"decision not applied: {disk.errno_of(exc)} writing to the run directory")


def action_kind(dec: Decision) -> ActionKind:
    apply = dec.would_apply or dec.apply
    rung = dec.action_kind
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
        return ActionKind.set_config if dec.config_patch else ActionKind.restart
    return ActionKind.alert


def patch_of(sup: DecisionsRun, dec: Decision) -> dict[str, Any]:
    """The decision's JobSpec patch (launcher.env.* keys go to the launch environment instead)."""
    patch = dict(dec.config_patch or {})
    if "data.skip_ranges" in patch:
        # The engine's value is the whole new list (it merges ranges itself).
        patch["data.skip_ranges"] = [list(r) for r in patch["data.skip_ranges"] or []]
    else:
        skips = [list(r) for r in (dec.skip_ranges or [])]
        if skips:
            cur = [list(r) for r in (jc.get_dotted(sup.config, "data.skip_ranges") or [])]
            patch["data.skip_ranges"] = cur + [r for r in skips if r not in cur]
    return patch


def apply_decision(sup: DecisionsRun, dec: Decision, step: int) -> None:
    apply = dec.apply
    symptom = Symptom(dec.symptom)
    dstep = dec.step
    dstep = dstep if dstep is not None else step
    reason = dec.reason or f"{symptom.value} remediation"
    kind = action_kind(dec)
    params: dict[str, Any] = {"rung": dec.action_kind, "ladder": dec.ladder,
              "apply": apply, "reason": reason}
    if dec.ladder == "memory" and getattr(sup.engine, "memory_evidence", None):
        params["evidence"] = sup.engine.memory_evidence   # a spike's numbers and plans (memory_evidence.py)
    if symptom == Symptom.hang and sup.term is not None:
        # The hang path (stack dump -> TERM -> KILL -> relaunch) already owns this attempt.
        if apply == "stop":
            sup.term.plan = TerminationPlan(Then.FAIL)
            sup.term.reason = reason
        return
    pending = sup.incidents.take_unacted(symptom.value)
    iid = pending[0][0] if pending else None
    for other, _ in pending[1:]:  # later findings of the same episode: one incident carries the action
        sup.store.update_incident_status(other, IncidentStatus.resolved, f"same episode as incident {iid}")
    if iid is None:
        iid = sup.incidents.incident(symptom, dstep, Severity.critical if apply in ("stop", "rollback_skip")
                            else Severity.warning, reason, {})
    if apply == "none":
        observe = dec.would_apply is not None
        if params["rung"] == "collect_evidence" and not observe:
            params["evidence"] = host_evidence(sup)
        sup.incidents.action(iid, ActionKind.observe_only_noop if observe else kind,
                    {**params, "would_apply": dec.would_apply,
                     "patch": dec.config_patch, "skip_ranges": dec.skip_ranges},
                    {}, ApplyMode.none, observe_only=observe)
        if not observe:
            sup.store.update_incident_status(iid, IncidentStatus.escalated, reason)
            sup.alert("incident", f"{symptom.value} at step {dstep} escalated: {reason}",
                       symptom=symptom.value, escalated=True)
        sup.say(f"  {'observe-only: would' if observe else 'action:'} {params['rung']} — {reason}")
        return
    if sup.term is not None and apply != "stop":
        sup.say(f"  (attempt already terminating; {params['rung']} folded into the pending restart)")
        # Its incident is settled here: nothing else holds it once taken from the unacted list (simulator seed 1).
        sup.store.update_incident_status(iid, IncidentStatus.resolved, f"{params['rung']} folded into the pending "
                                         f"restart of attempt {sup.attempt}")
        return
    if apply == "stop":
        sup.incidents.action(iid, ActionKind.stop, params, {}, ApplyMode.none)
        sup.store.update_incident_status(iid, IncidentStatus.escalated, reason)
        sup.say(f"  action: stop — {reason}")
        sup.stop_run(reason, fail=True)
        return
    if sup.state in (S.RUNNING, S.STARTING):
        sup.set_state(S.REMEDIATING, f"{symptom.value}: {reason}")
    from_v = sup.config_version
    patch = patch_of(sup, dec)
    if apply == "hot" and log_source.stdout_source(sup.config):
        # The job reads no control.json (telemetry from its log, no client): the fix takes effect on restart.
        apply = params["apply"] = "restart_latest"
        params["hot_unavailable"] = "the job does not read control.json ([telemetry] source = stdout): restart"
        kind = ActionKind.set_config if patch else ActionKind.restart
    if apply == "hot":
        to_v, diff = sup.new_config_version(patch, f"{symptom.value}: {reason}") if patch else (from_v, {})
        hot = {k: v for k, v in dict(dec.hot_control or {}).items() if k != "dump_stacks"}
        ctl = jc.write_control(sup.run_dir, **hot)
        sup.incidents.action(iid, kind, {**params, "control": ctl}, diff, ApplyMode.hot, from_v, to_v)
        sup.store.update_incident_status(iid, IncidentStatus.remediating, f"hot: {reason}")
        sup.say(f"  action: {params['rung']} hot via control.json v{ctl['version']} {hot}")
        if sup.state == S.REMEDIATING:
            sup.set_state(S.RUNNING, "hot fix applied, no restart")
        return
    # restart_latest | rollback_skip: new config version, then a graceful (or suspect) restart.
    rollback = dec.rollback_to_step if apply == "rollback_skip" else None
    to_v, diff = sup.new_config_version(patch, f"{symptom.value}: {reason}") if patch else (from_v, {})
    suspect = apply == "rollback_skip" or bool((dec.hot_control or {}).get("suspect"))
    onset = None
    if rollback is not None:   # before the SIGTERM: retention keeps the target, no tag past the onset is used
        onset = pending_rollback(sup, dec, rollback, dstep, iid)
    if suspect:
        jc.write_control(sup.run_dir, suspect=True)
    params.update(rollback_to_step=rollback, skip_ranges=dec.skip_ranges, suspect=suspect)
    if onset is not None:
        params["rollback_onset_step"] = onset
    sup.incidents.action(iid, kind, params, diff, ApplyMode.restart, from_v, to_v)
    sup.store.update_incident_status(iid, IncidentStatus.remediating, reason)
    sup.say(f"  action: {params['rung']} ({apply})" + (f", rollback to <= step {rollback}" if rollback is not None else "")
            + (f", config v{from_v}->v{to_v}" if to_v != from_v else "") + f" — {reason}")
    relaunch = Relaunch(reason, iid, rollback)
    if sup.job is not None and sup.os.is_alive(sup.job):
        sup.set_state(S.RESTARTING, f"{symptom.value}: stopping attempt {sup.attempt} to apply")
        sup.begin_termination(f"{symptom.value} remediation", TerminationPlan.relaunching(relaunch),
                               grace=sup.dcfg.stop_grace_s)
    else:
        schedule_relaunch(sup, relaunch)


def pending_rollback(sup: DecisionsRun, dec: Decision, rollback: int, step: int, iid: int | None) -> int:
    """Record the decided rollback (training/checkpoint/rollback_guard.py) until its relaunch chooses a tag; returns
    the onset. The engine's onset, else the decision's step; never at or before the target (a target is a save
    before the onset)."""
    from ulyssesd.training.checkpoint import rollback_guard as rg

    onset = dec.rollback_onset if dec.rollback_onset is not None else step
    if onset <= rollback:
        log.warning("rollback onset not after its target: the target's next step is taken", onset=onset,
                    target=rollback)
        onset = rollback + 1
    rg.write_pending(sup.run_dir, rg.PendingRollback(onset, rollback, dec.rollback_tag, iid))
    return onset


def host_evidence(sup: DecisionsRun) -> dict[str, Any]:
    """Slow-step evidence the daemon can see: per-rank step times (telemetry), the job's processes'
    CPU use, and the busiest other processes on the host (CPU hogs)."""
    r = sup.last_step_record
    load = sup.os.host_load()  # psutil scan over a short, bounded interval; rare (only on slow-step evidence)
    ev: dict[str, Any] = {"load_avg": load.load_avg, "cpu_count": load.cpu_count}
    if r is not None:
        ev["step_time_s"], ev["step_time_max_s"], ev["slowest_rank"] = r.step_time_s, r.step_time_max_s, r.slowest_rank
    mine = set(sup.os.job_pids(sup.job, sup.marker())) if sup.job is not None else set()
    rows = load.processes
    ev["job_cpu_percent"] = {pid: cpu for cpu, pid, _ in rows if pid in mine}
    ev["top_other_processes"] = [{"pid": pid, "cpu_percent": cpu, "cmd": cmd} for cpu, pid, cmd in rows
                                 if pid not in mine and pid != os.getpid()][:5]
    return ev


def on_hang(sup: DecisionsRun, fnd: Finding) -> None:
    """Hang: stack dumps of every rank into the incident, then SIGTERM, then SIGKILL after grace."""
    if sup.term is not None or sup.job is None:
        return
    step = fnd.step if fnd.step is not None else (sup.last_step or 0)
    evidence = dict(fnd.evidence or {})
    summary = fnd.message or "no progress"
    attempt = sup.attempt

    def with_stacks(stacks: str) -> None:
        per_rank = sup.term.per_rank_stacks if sup.term is not None else {}
        reading = read_hang(per_rank, unattributed=stacks)
        sup.hang_diagnosis = (reading.label, [reading.summary])
        ev = dict(evidence, stacks=stacks or "(no stack dump written)",
                  threads_dumped=stacks.count("Current thread") + stacks.count("Thread 0x") if stacks else 0,
                  diagnosis=reading.label, stack_reading=reading.summary,
                  waited_for_ranks=list(reading.waited_for))
        from ulyssesd.daemon.job.slurm_supervise import hang_nodes

        on_nodes = hang_nodes(sup, list(reading.waited_for), list(per_rank))  # a Slurm job: the suspects' nodes
        ev.update(on_nodes)
        iid = sup.incidents.incident(Symptom.hang, step, Severity.critical, f"{summary} {reading.summary}" + (
            f" ({on_nodes['note']})" if on_nodes else ""), ev,
                            attempt=attempt)
        if sup.term is not None and sup.term.plan.then is Then.FAIL:
            # The hang ladder's restarts are used up (the decision set the plan): the run ends, say so.
            sup.incidents.action(iid, ActionKind.stop, {"reason": sup.term.reason, "rung": "stop_alert",
                                                        "ladder": "hang"}, {}, ApplyMode.none)
            sup.store.update_incident_status(iid, IncidentStatus.failed, sup.term.reason)
            return
        sup.incidents.action(iid, ActionKind.restart, {"reason": "hang: stack dump, SIGTERM, SIGKILL after grace, "
                                              "restart from latest valid checkpoint",
                                              "rung": "hang_restart", "ladder": "hang"}, {}, ApplyMode.restart,
                    sup.config_version, sup.config_version)
        sup.store.update_incident_status(iid, IncidentStatus.remediating, "restarting after hang")
        if sup.term is not None and sup.term.plan.relaunch is not None:
            sup.term.plan.relaunch.incident_id = iid

    said = summary.rstrip(".")  # the detector's summary usually names the step already: say it once
    sup.set_state(S.REMEDIATING, f"hang: {said}" if f"step {step}" in said else f"hang at step {step}: {said}")
    sup.set_state(S.RESTARTING, "hung attempt is being killed")
    sup.begin_termination("hang", TerminationPlan.relaunching(Relaunch("hang", None)), grace=sup.dcfg.hang_grace_s,
                           dump_stacks=True, on_stacks=with_stacks)


def _split_outputs(out: Iterable[Finding | Decision]) -> tuple[list[Finding], list[Decision]]:
    """The engine's outputs (`observe`/`tick`/`on_crash` return one list of both) -> (findings, decisions)."""
    findings: list[Finding] = []
    decisions: list[Decision] = []
    for item in out:
        if isinstance(item, Decision):
            decisions.append(item)
        else:
            findings.append(item)
    return findings, decisions
