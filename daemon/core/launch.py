"""The next attempt: which checkpoint it resumes from, the pre-launch checks, and spawning it.

`launch` (the supervisor's `launch`) probes the run directory, picks the checkpoint (`choose_checkpoint`:
validate tags newest -> oldest, quarantine bad ones, and on a rollback set aside the tags after the
rollback point: renamed, never deleted, they are evidence), refuses to start a run over from scratch when
every checkpoint is bad, runs the preflight on the config the attempt will run, and spawns the launcher
with bounded retries. The restart budget and backoff before it are `relaunch.py`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import tenacity

from ulyssesd.daemon.core import decisions, relaunch
from ulyssesd.daemon.core.relaunch import Relaunch, RelaunchRun
from ulyssesd.daemon.core.termination import RankWatch
from ulyssesd.daemon.host import disk, disk_budget
from ulyssesd.daemon.host.gpu_health import GpuHealth, gpus_needed
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import JobHandle
from ulyssesd.daemon.job import checkpoint_watch, slurm_supervise
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job.checkpoint_watch import CheckpointWatchRun
from ulyssesd.daemon.job.launcher import LaunchPlan, build_launch
from ulyssesd.daemon.job.standby import StandbyKeeper, StandbyRun
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom

log = get_logger("ulyssesd.supervisor")
S = RunState


class LaunchRun(RelaunchRun, CheckpointWatchRun, StandbyRun, Protocol):
    """What starting an attempt uses of the run (and the parts it calls)."""

    preflight: Callable[[dict[str, Any]], str | None] | None  # the planner's check of a config
    standby: StandbyKeeper  # the next attempt kept warm
    rank_watch: RankWatch
    rank_lost: dict[str, Any] | None
    hang_diagnosis: tuple[str | None, list[str]] | None
    attempt_started_mono: float
    attempt_resume_step: int | None  # the step of the checkpoint a command job's attempt was given
    gpu_health: GpuHealth  # NVML checks before a launch (host/gpu_health.py)


class LaunchError(RuntimeError):
    """The launcher could not be started even after the bounded retries."""



def choose_checkpoint(ckpt_dir: Path, rollback_to_step: int | None, *, verify: bool, verify_max_gib: float,
                      store: Any, run_id: str, clock: Callable[[], float],
                      say: Callable[[str], None], threads: int | None = None,
                      onset: int | None = None) -> tuple[str, list[str]]:
    """Validate tags newest -> oldest, quarantine bad ones; return (tag or "none", notes).

    `verify`: checksum verification (checkpoint.verify_checksums), skipped for tags over `verify_max_gib`,
    hashed by `threads` workers (checkpoint.verify_threads; None: the job's default, min(CPU cores, 8));
    invalid and set-aside tags are recorded in `store` for `run_id`. `onset`: the first step of the incident a
    pending rollback handles (rollback_guard.py): a tag saved at or after it is set aside, never chosen; a
    rollback whose target is gone falls back only to a valid tag between the target and the onset."""
    from ulyssesd.training import checkpoint as ck

    notes: list[str] = []

    def bad(tag: str, reason: str) -> None:
        notes.append(f"{tag} invalid: {reason}")
        try:
            moved = ck.quarantine(ckpt_dir / tag)
            notes[-1] += f"; quarantined as {moved.name}"
        except OSError as exc:
            notes[-1] += f"; quarantine failed: {exc}"
        store.upsert_checkpoint(run_id, tag, step=ck.step_of_tag(tag) or 0, valid=False, invalid_reason=reason)

    if not ckpt_dir.exists():
        return "none", notes
    if not os.access(ckpt_dir, os.R_OK | os.X_OK):
        raise PermissionError(f"checkpoint directory {ckpt_dir} is not readable by uid {os.geteuid()}")
    tags = ck.list_tags(ckpt_dir)

    def set_aside(tag: str, why: str) -> None:
        target = ckpt_dir / f"{tag}.rolledback-{int(clock())}"
        os.rename(ckpt_dir / tag, target)
        log.info("checkpoint set aside", tag=tag, to=target.name)
        say(f"  {tag} set aside as {target.name} ({why})")
        store.upsert_checkpoint(run_id, tag, step=ck.step_of_tag(tag) or 0, valid=False, invalid_reason=why)

    if onset is not None:   # saved at or after the onset: its weights went through it (never a resume point)
        for t in [t for t in tags if (ck.step_of_tag(t) or 0) >= onset]:
            set_aside(t, f"saved at or after the onset at step {onset} of the incident being rolled back")
        tags = ck.list_tags(ckpt_dir)

    def first_valid(candidates: list[str]) -> str | None:
        for tag in candidates:
            gib_ok = tag_gib(ckpt_dir, tag) <= verify_max_gib
            ok, reason = ck.validate_tag(ckpt_dir / tag, verify and gib_ok, threads=threads)
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
            # The rollback target is gone (pruned, or invalid): the valid tag closest after it AND before the
            # onset beats losing the whole run; one at or after the onset holds the weights the rollback undoes.
            if onset is None:
                notes.append(f"no valid checkpoint at or before step {rollback_to_step} (pruned or invalid) and "
                             f"the incident's onset is not recorded: no later tag is known to precede it")
            else:
                between = [t for t in tags if rollback_to_step < (ck.step_of_tag(t) or 0) < onset]
                chosen = first_valid(between)
                notes.append(f"no valid checkpoint at or before step {rollback_to_step} (pruned or invalid); "
                             + (f"rolled back to the oldest valid one before the onset at step {onset}, {chosen}"
                                if chosen else f"none between it and the onset at step {onset} either"))
        # Tags after the rollback point belong to the abandoned (bad) trajectory: set them aside so a
        # later plain restart ("latest") can never resume from them. Renamed, not deleted (evidence).
        limit = ck.step_of_tag(chosen) if chosen else rollback_to_step
        for t in ck.list_tags(ckpt_dir):
            if (ck.step_of_tag(t) or 0) > (limit or 0):
                set_aside(t, f"rolled back past it (to step {limit})")
    if chosen is None:
        return "none", notes
    try:
        ck.point_latest_to(ckpt_dir, chosen)
    except OSError as exc:
        # A full or read-only disk fails this small temp write; the job rewrites `latest` itself before it
        # loads (training/train_checkpoints.py), so the resume still goes to `chosen`. Not a checkpoint problem.
        log.warning("could not rewrite latest (the job will)", tag=chosen, error=repr(exc))
    return chosen, notes


def tag_gib(ckpt_dir: Path, tag: str) -> float:
    """The tag's size from its manifest (0 when unreadable), to skip checksums on huge tags."""
    from ulyssesd.training import checkpoint as ck

    try:  # read_manifest: bounded in size, every entry's size an integer
        return ck.manifest_bytes(ck.read_manifest(ckpt_dir / tag)) / (1 << 30)
    except ck.ManifestError:  # a damaged manifest: size unknown (validate_tag then refuses it)
        return 0.0


def checkpoint_for(sup: LaunchRun, rollback_to_step: int | None) -> tuple[str, list[str]]:
    """Validate tags newest -> oldest, quarantine bad ones; return (tag or "none", notes). The hashing uses the
    job's own `[checkpoint] verify_threads`: this check is on the restart's critical path too."""
    from ulyssesd.training.checkpoint.rollback_guard import read_pending

    threads = jc.get_dotted(sup.config, "checkpoint.verify_threads")
    pending = read_pending(sup.run_dir)   # a decided rollback (decisions.py): no tag at or after its onset
    return choose_checkpoint(
        sup.ckpt_dir, rollback_to_step, verify=bool(jc.get_dotted(sup.config, "checkpoint.verify_checksums", True)),
        verify_max_gib=sup.dcfg.verify_max_gib, store=sup.store, run_id=sup.run_id, clock=sup.os.time,
        say=sup.say, threads=threads if type(threads) is int and threads >= 1 else None,
        onset=pending.onset_step if pending is not None else None)


def launch(sup: LaunchRun, reason: str, rollback_to_step: int | None = None, incident_id: int | None = None) -> bool:
    """Launch the next attempt. Returns False when the run ended instead (FAILED), or when the daemon's
    own writes to the run directory fail for lack of space (retried later, bounded: relaunch.py)."""
    try:
        relaunch.probe_run_dir(sup.run_dir)
        launched = start_attempt(sup, reason, rollback_to_step, incident_id)
    except (OSError, LaunchError) as exc:
        if disk.errno_of(exc) is None:
            raise
        return relaunch.own_write_failed(sup, exc, Relaunch(reason, incident_id, rollback_to_step))
    sup.counters.own_write_failures = 0
    return launched


def start_attempt(sup: LaunchRun, reason: str, rollback_to_step: int | None, incident_id: int | None) -> bool:
    command_job = sup.spec.job_section.kind == "command"
    resume: Path | None | bool = True
    resume_step: int | None = None
    try:
        if command_job:  # the user's own checkpoints, read from its checkpoint_dir (job/checkpoint_watch.py)
            found, passed_over = checkpoint_watch.launch_choice(sup, rollback_to_step)
            notes: list[str] = []   # (a command job's checkpoints are never quarantined: nothing is invalid)
            tag = found.name if found else "none"
            if found and not checkpoint_watch.gives_resume(sup.spec.job_section):
                # Not handed to the job: the record cannot claim it (the job's own report may, later).
                found, tag = None, "none"
                passed_over = [*passed_over, "the command has no {resume}: the job chooses its own checkpoint"]
            resume, resume_step = (found.path, found.step) if found else (None, None)
            sup.attempt_resume_step = resume_step  # where a stdout job's count of printed dicts goes on from
            for note in passed_over:
                log.warning("checkpoint passed over", note=note)
                sup.say(f"  {note}")
        else:
            tag, notes = checkpoint_for(sup, rollback_to_step)
    except (PermissionError, OSError) as exc:
        if disk.errno_of(exc) is not None:
            raise  # our own write failed (full / read-only disk): not a checkpoint problem (_launch)
        sup.fail(f"cannot read checkpoints: {exc}", symptom=Symptom.checkpoint_corrupt)
        return False
    if tag == "none" and notes and rollback_to_step is None:
        # Checkpoints existed and none is valid: like the job's exit 3, refuse to silently start the
        # run over from step 0; everything (quarantined tags included) is kept for a human.
        sid = sup.incidents.incident(Symptom.checkpoint_corrupt, sup.last_step or 0, Severity.critical,
                             "no valid checkpoint left; not restarting from scratch",
                             {"invalid": notes, "ckpt_dir": str(sup.ckpt_dir)}, attempt=sup.attempt + 1)
        sup.incidents.action(sid, ActionKind.stop, {"reason": "no valid checkpoint left"}, {}, ApplyMode.none)
        sup.store.update_incident_status(sid, IncidentStatus.failed, "no valid checkpoint left")
        sup.fail(f"no valid checkpoint left in {sup.ckpt_dir}: {'; '.join(notes)[:300]}")
        return False
    if tag == "none" and rollback_to_step and not command_job:
        return rollback_target_lost(sup, rollback_to_step, notes)
    clear_pending_rollback(sup)   # chosen, and every tag past it set aside: the record is done
    # "latest" = the newest valid tag, which is `tag` now that invalid ones are quarantined; an explicit
    # tag (or "none") only for a rollback; the user's own choice stands on the first attempt.
    want_load = "latest" if rollback_to_step is None else tag
    if sup.attempt == 0:
        want_load = jc.get_dotted(sup.config, "checkpoint.load")
    if want_load != jc.get_dotted(sup.config, "checkpoint.load"):
        sup.new_config_version({"checkpoint.load": want_load},
                                 f"resume from {tag}" + (f" (rollback to <= step {rollback_to_step})"
                                                         if rollback_to_step is not None else ""))
    if notes:
        sid = sup.incidents.incident(Symptom.checkpoint_corrupt, sup.last_step or 0, Severity.warning,
                             f"checkpoint fallback: {notes[0][:120]}; resuming from {tag}",
                             {"invalid": notes, "resumed_from": tag, "ckpt_dir": str(sup.ckpt_dir)},
                             attempt=sup.attempt + 1)
        sup.incidents.action(sid, ActionKind.restart, {"resume_from": tag, "skipped": notes}, {}, ApplyMode.restart)
        sup.store.update_incident_status(sid, IncidentStatus.resolved, f"previous valid checkpoint {tag} used")
        log.warning("checkpoint problem", notes=notes, using=tag)
        sup.say(f"checkpoint problem: {'; '.join(notes)} -> using {tag}")
    if rollback_to_step is not None and not command_job:  # (a command job's: launch_choice)
        from ulyssesd.training.checkpoint import step_of_tag

        sup.latest_ckpt = (tag, step_of_tag(tag) or 0) if tag != "none" else None
        # The set-aside tags' candidacy goes too: a poisoned save must not turn known-good on the new trajectory.
        checkpoint_watch.forget_after(sup.engine, sup.latest_ckpt[1] if sup.latest_ckpt else 0)
    slurm_supervise.before_launch(sup)  # Slurm: the run's node count; grows back when allowed (job/elastic.py)
    if sup.attempt > 0 and sup.preflight is not None:
        verdict = sup.preflight(sup.config)  # fails closed: a planner error is a refusal too
        if verdict is not None:
            sup.fail(f"preflight refused config v{sup.config_version}: {verdict}", symptom=Symptom.launch_failure)
            return False
    gpu = sup.gpu_health.before_launch(sup.spec.launcher.env, gpus_needed(sup.spec.launcher), sup.os.time())
    if gpu.stop_reason is not None:  # never onto a failed GPU (host/gpu_health.py)
        sup.fail(gpu.stop_reason)
        return False
    sup.attempt += 1
    # A fresh attempt reads control.json from scratch: neutral file (no keys = no change).
    jc.write_control(sup.run_dir, suspect=False)
    launcher = sup.spec.launcher
    if sup.launch_env:
        launcher = launcher.model_copy(update={"env": {**launcher.env, **{k: str(v) for k, v in sup.launch_env.items()
                                                                          if v is not None}}})
    launcher = launcher.model_copy(update={"env": {**launcher.env, **gpu.env}}) if gpu.env else launcher
    if not command_job:  # the job checks every save, its first included, against this (docs/CHECKPOINT_DISK.md)
        try:
            disk_budget.publish_budget(sup)
        except OSError:
            sup.attempt -= 1  # not launched: the own-write path retries it, same number
            raise
    plan = build_launch(launcher, run_id=sup.run_id, run_dir=sup.run_dir, attempt=sup.attempt,
                        config_version=sup.config_version, job=sup.spec.job_section,
                        rollback_to_step=rollback_to_step, slurm=sup.spec.slurm, resume=resume)
    takeover = sup.standby.take(sup, plan)  # a warm standby's gate opened, or why not (job/standby.py)
    plan, reason = takeover.plan or plan, reason + takeover.note
    try:
        job = takeover.job or spawn_with_retries(sup, plan)
    except LaunchError as exc:
        if disk.errno_of(exc) is not None:
            sup.attempt -= 1  # not launched (its log file could not be written): retried later, same number
            raise
        sup.store.add_attempt(sup.run_id, number=sup.attempt, command=plan.argv,
                               config_version=sup.config_version, resumed_from=tag, host=socket.gethostname())
        sup.store.end_attempt(sup.run_id, sup.attempt, returncode=127, diagnosis="launcher_error",
                               diagnosis_evidence=[str(exc)])
        sup.fail(str(exc), symptom=Symptom.launch_failure)
        return False
    sup.job = job
    sup.store.add_attempt(sup.run_id, number=sup.attempt, command=plan.argv, config_version=sup.config_version,
                           resumed_from=None if tag == "none" else tag, host=socket.gethostname(),
                           pid=job.pid, pgid=job.pgid, proc_start_time=job.start_time)
    sup.attempt_started_mono = sup.os.monotonic()
    sup.attempt_progress = False
    sup.last_exiting = None
    sup.hang_diagnosis, sup.rank_lost = None, None
    sup.rank_watch = RankWatch(sup.dcfg.rank_exit_grace_s, sup.dcfg.rank_watch_every_s)
    sup.incidents.settle_unacted("the attempt ended before any action on it")
    if sup.engine is not None:
        if resume_step is None and tag != "none":
            from ulyssesd.training.checkpoint import step_of_tag
            resume_step = step_of_tag(tag)
        # What the attempt resumed: a NaN right after it makes that checkpoint suspect (engine_parts.py).
        sup.engine.on_restart(decisions.engine_now(sup), attempt=sup.attempt,
                              resumed=(tag, resume_step) if tag != "none" and resume_step is not None else None)
    if sup.state != S.STARTING:
        sup.set_state(S.STARTING, f"attempt {sup.attempt} launched ({reason}) from "
                       + (tag if tag != "none" else "the start (no checkpoint)"))
    log.info("launched", run_id=sup.run_id, attempt=sup.attempt, pid=job.pid, resume=tag, reason=reason,
             config_version=sup.config_version, **({"resume_step": resume_step} if resume_step is not None else {}))
    sup.say(f"attempt {sup.attempt} launched (pid {job.pid}, config v{sup.config_version}, resume {tag}): {reason}")
    return True


def rollback_target_lost(sup: LaunchRun, rollback_to_step: int, notes: list[str]) -> bool:
    """A rollback with no valid tag at or before its target and none between it and the onset: stop loudly with what
    was tried; never step 0 once the run has made progress, never a tag past the onset (issue 39)."""
    why = (f"rollback to <= step {rollback_to_step}: no valid checkpoint to resume from; not resuming from a tag "
           f"saved after the incident's onset nor from step 0")
    sid = sup.incidents.incident(Symptom.checkpoint_corrupt, sup.last_step or 0, Severity.critical, why,
                                 {"tried": notes, "ckpt_dir": str(sup.ckpt_dir)}, attempt=sup.attempt + 1)
    sup.incidents.action(sid, ActionKind.stop, {"reason": why, "tried": notes}, {}, ApplyMode.none)
    sup.store.update_incident_status(sid, IncidentStatus.failed, why)
    sup.fail(f"{why}: {'; '.join(notes)[:300]}")
    return False


def clear_pending_rollback(sup: LaunchRun) -> None:
    from ulyssesd.training.checkpoint.rollback_guard import clear_pending

    try:
        clear_pending(sup.run_dir)
    except OSError as exc:   # the next launch's choice honours it again; retention keeps the target meanwhile
        log.warning("could not remove the pending rollback record", error=repr(exc))


def spawn_with_retries(sup: LaunchRun, plan: LaunchPlan) -> JobHandle:
    """Bounded retries with exponential backoff + jitter for launches that fail to start at all
    (fork/exec errors, a missing interpreter). The waits are short and bounded (≤ ~10 s total)."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(sup.dcfg.launch_retries + 1),
        wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=4.0, jitter=0.5),
        retry=tenacity.retry_if_exception_type(OSError),
        before_sleep=lambda rs: log.warning("launch failed, retrying", attempt=rs.attempt_number,
                                            error=repr(rs.outcome.exception() if rs.outcome else None)),
        reraise=True,
    )
    try:
        return retrying(sup.os.spawn, plan.argv, plan.env, plan.cwd, plan.log_path)
    except OSError as exc:
        raise LaunchError(f"cannot start the launcher after {sup.dcfg.launch_retries + 1} tries: "
                          f"{plan.argv[0]}: {exc}") from exc
