"""An attempt's exit, noticed by the tick: requested ends (complete / stop / pause / fail / relaunch) and
unrequested ones (a crash): diagnosis of the log tail -> incident -> the engine's crash playbook -> relaunch.
"""

from __future__ import annotations

import re
import signal
import traceback
from typing import Any, Protocol

from ulyssesd.daemon.core import attempt_diagnosis
from ulyssesd.daemon.core.decisions import (
    DecisionsRun,
    _split_outputs,
    action_kind,
    on_record,
    patch_of,
)
from ulyssesd.daemon.core.files import _read_tail
from ulyssesd.daemon.core.relaunch import Relaunch, schedule_relaunch
from ulyssesd.daemon.core.states import TERMINAL
from ulyssesd.daemon.core.termination import UNREQUESTED, Termination, TerminationPlan, Then
from ulyssesd.daemon.host import disk, host_oom
from ulyssesd.daemon.host.disk_budget import checkpoint_root
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.job import checkpoint_watch
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.daemon.telemetry import declared_total, unread_exit
from ulyssesd.remediation.diagnosis import Diagnosis
from ulyssesd.remediation.diagnosis.facts import scheduler_ended
from ulyssesd.remediation.playbook import ladder_for_crash

log = get_logger("ulyssesd.supervisor")
# A "killed" diagnosis whose sender is the scheduler (time limit, preemption, cancellation, pod eviction).
_SCHEDULER_END = re.compile(r"CANCELLED AT|DUE TO (?:TIME LIMIT|PREEMPTION)|kubernetes-pod-termination|NODE_FAIL")
S = RunState


class ExitRun(DecisionsRun, Protocol):
    """What handling an attempt's exit uses of the run (and the decisions path's `DecisionsRun`)."""

    rank_lost: dict[str, Any] | None  # evidence when the rank watch ended the attempt
    attempt_started_mono: float

    def collect_stacks(self, t: Termination) -> str: ...


def on_exit(sup: ExitRun, status: ExitStatus) -> None:
    """The attempt's process is gone: close the attempt in the store, then complete / stop / pause / fail /
    relaunch as requested, or handle an unrequested exit as a crash."""
    assert sup.job is not None
    job = sup.job
    sup.job = None
    term = sup.term
    sup.term = None
    if term is not None and term.dump_stacks and term.termed_at is None and term.on_stacks is not None:
        # The attempt ended while we waited for its stack dumps: record the hang with what was written.
        sup.term = term
        term.on_stacks(sup.collect_stacks(term))
        sup.term = None
    survivors = sup.os.job_pids(job, sup.marker())
    if survivors:
        # No orphan rank may outlive its attempt: kill whatever is left and say so.
        sup.os.signal_pids(survivors, signal.SIGKILL)
        log.warning("killed processes that outlived their attempt", pids=survivors)
    ran_s = sup.os.monotonic() - sup.attempt_started_mono
    tail = _read_tail(sup.log_path)
    plan = term.plan if term is not None else UNREQUESTED
    requested = plan.then is not Then.CRASH
    diag_label, diag_evidence, diag_confidence = None, None, None
    crashed = not status.ok and not requested
    # A user's command job that says nothing (no client: no `exiting` event) has completed when it exits 0 of
    # its own accord; after a requested end (an operator stop or pause, a restart, also one carried over a daemon
    # restart) its exit 0 is its SIGTERM handler's, not the end of the training: the plan decides.
    completed = status.ok and (sup.last_exiting == "completed" or (
        sup.last_exiting is None and sup.spec.job_section.kind == "command" and not requested))
    if crashed or (status.ok and not requested and not completed):
        # One function for the daemon and `ulyssesctl diagnose` (daemon/core/attempt_diagnosis.py); a bare SIGKILL
        # asks the host's OOM counters before it is called an OOM kill (daemon/host/host_oom.py).
        d = attempt_diagnosis.diagnose_attempt(tail, status.returncode, status.signal, None)
        host = host_oom.evidence_for_attempt(sup) if d.label == "host_oom_killed" and d.confidence != "high" else None
        if host is not None:
            d = attempt_diagnosis.diagnose_attempt(tail, status.returncode, status.signal, host)
        diag_label, diag_evidence = d.label, list(d.evidence)
        diag_confidence = d.confidence
        attempt_diagnosis.write_record(attempt_diagnosis.record_path(sup.run_dir, sup.attempt), d,
                                       status.returncode, status.signal, host, "log")
    if diag_label is None and sup.hang_diagnosis is not None and sup.hang_diagnosis[0] is not None:
        # Killed by the hang path: the stack dumps, not the log's last lines, say what it was.
        diag_label, diag_evidence = sup.hang_diagnosis[0], sup.hang_diagnosis[1]
        attempt_diagnosis.write_record(
            attempt_diagnosis.record_path(sup.run_dir, sup.attempt),
            Diagnosis(diag_label, list(diag_evidence or []), "high",
                      f"{diag_label}: the daemon's hang path ended this attempt; its stack dumps decided: "
                      f"{(diag_evidence or ['(none)'])[0][:200]!r}."),
            status.returncode, status.signal, None, "hang stacks")
    # A failed checkpoint save: the job's own event names the errno (the log's text may not: torch's C++
    # writer says "basic_ios::clear: iostream error"), so it decides before the log's label.
    save_failure = sup.save_failures.get(sup.attempt)
    refuted = disk.space_refutes(diag_label, diag_confidence, save_failure, checkpoint_root(sup)) if crashed else None
    if refuted is not None:  # the OS says there is room: a save that failed, not a full disk
        diag_label, diag_confidence = "python_exception", "medium"
        diag_evidence = [refuted, *(diag_evidence or [])][:20]
    storage = disk.storage_errno(save_failure, diag_label, checkpoint_root(sup)) if crashed else None
    if storage in disk.NO_SPACE:
        diag_label, diag_confidence = "disk_full", "high"
        if save_failure is not None:
            diag_evidence = [f"checkpoint_save_failed: {save_failure.get('errno')} writing {save_failure.get('path')} "
                             f"({save_failure.get('error')}); {save_failure.get('bytes_free')} bytes free",
                             *(diag_evidence or [])][:20]
    if completed:   # a save made just before the exit: the file system, not a look that came too late, says
        checkpoint_watch.tick(sup, on_record, final=True)
    rank_codes = disk.rank_exit_codes(tail)
    sup.store.end_attempt(sup.run_id, sup.attempt, returncode=status.returncode, signal=status.signal,
                          diagnosis=diag_label, diagnosis_evidence=diag_evidence)
    # A crash is an error (journalctl -p err); a requested end or a completion is progress.
    (log.error if crashed else log.info)("attempt ended", run_id=sup.run_id, attempt=sup.attempt,
                                         status=status.describe(), ran_s=round(ran_s, 1), last_step=sup.last_step,
                                         after="completed" if completed else str(plan), exiting=sup.last_exiting)
    sup.say(f"attempt {sup.attempt} ended: {status.describe()} after {ran_s:.0f}s (last step {sup.last_step})")
    if completed:
        sup.incidents.resolve_all("run completed")
        unread = unread_exit.no_step_record_at_exit(sup)
        if unread is not None:  # unknown is loud: nothing was read, so no final step is claimed
            iid = sup.incidents.incident(Symptom.no_progress, 0, Severity.warning, unread[0],
                                         {"exit": status.describe(), **unread[1]})
            sup.store.update_incident_status(iid, IncidentStatus.escalated, "no step record was understood")
            log.warning("job exited 0 with no step record understood", run_id=sup.run_id, attempt=sup.attempt,
                        **unread[1])
            sup.say(f"WARNING: {unread[0]}")
            sup.set_state(S.COMPLETED, "job exited 0; no step record was understood from its output, so its "
                                       "final step is unknown (see the warning incident for the fix)")
            return
        short = declared_total.short_of_total(sup.telemetry_path, sup.last_step, sup.spec.job_section.total_steps,
                                              sup.attempt) if sup.spec.job_section.kind == "command" else None
        if short is not None:  # exit 0 is the job's word, not proof of the run's length: say it fell short
            iid = sup.incidents.incident(Symptom.no_progress, short[0], Severity.warning,
                                         f"the job exited 0 at step {short[0]} before its declared total "
                                         f"{short[1]}; the run is COMPLETED as the job said, short of its length",
                                         {"exit": status.describe(), "last_step": short[0], "total_steps": short[1]})
            sup.store.update_incident_status(iid, IncidentStatus.escalated, "exited before its declared total")
        sup.set_state(S.COMPLETED, f"reached final step {sup.last_step}" if short is None else
                      f"job exited 0 at step {short[0]}, before its declared total {short[1]}")
        return
    if save_failure is not None and requested:
        # A requested end (stop, pause, a restart) whose final save failed: the run goes on as asked, from
        # the previous valid tag; say so rather than let "saved and exited" stand.
        sym = Symptom.disk_full if save_failure.get("errno") in disk.NO_SPACE else Symptom.crash
        iid = sup.incidents.incident(sym, sup.last_step or 0, Severity.warning,
                            f"the final checkpoint save of {save_failure.get('tag')} failed "
                            f"({save_failure.get('errno')}); the next attempt resumes from the previous valid tag",
                            {"checkpoint_save_failed": save_failure, "after": str(plan)})
        sup.store.update_incident_status(iid, IncidentStatus.escalated, "final save failed; nothing to retry now")
    if plan.then is Then.STOP:
        sup.set_state(S.STOPPED, "job exited after operator stop"
                       + (" (its final save failed)" if save_failure is not None else ""))
        return
    if plan.then is Then.PAUSE:
        sup.set_state(S.PAUSED, "job exited, its final save failed; paused" if save_failure is not None
                       else "job saved and exited; paused")
        return
    if plan.then is Then.FAIL:
        sup.fail(term.reason if term else "stopped by the playbook")
        return
    if plan.relaunch is not None:
        schedule_relaunch(sup, plan.relaunch)
        return
    # Unrequested exit: a crash (or a SIGTERM from someone else). Diagnose -> playbook -> relaunch.
    early = ran_s < sup.dcfg.early_death_s and not sup.attempt_progress
    sup.counters.consecutive_early_deaths = sup.counters.consecutive_early_deaths + 1 if early else 0
    evidence: dict[str, Any] = {"exit": status.describe(), "returncode": status.returncode, "signal": status.signal,
                "diagnosis": diag_label, "diagnosis_confidence": diag_confidence, "evidence_lines": diag_evidence, "log_tail": tail[-8000:],
                "ran_s": round(ran_s, 1), "early_death": early}
    if sup.rank_lost is not None:
        evidence["rank_lost"] = sup.rank_lost
    if rank_codes:
        evidence["rank_exit_codes"] = rank_codes
    if save_failure is not None:
        evidence["checkpoint_save_failed"] = save_failure
    if storage == disk.READ_ONLY:
        disk.stop_read_only(sup, str((save_failure or {}).get("path") or checkpoint_root(sup)), evidence)
        return
    returncode = status.returncode
    meaningless = False
    if returncode not in (2, 3) and status.signal is None:
        if exit_codes_declared(sup):
            # torchrun exits 1 whatever its ranks exited with; their own codes are in its failure report, and
            # the job's `exiting` event says why first (a rank that refused its config may still die by
            # SIGABRT in the process group's teardown, and torchrun then reports -6 and -15, not 2).
            returncode = next((c for c in (2, 3) if c in rank_codes), returncode)
        returncode = disk.JOB_REFUSAL_EXIT.get(sup.last_exiting or "", returncode)  # the job said why
    elif returncode in (2, 3) and not exit_codes_declared(sup) and \
            disk.JOB_REFUSAL_EXIT.get(sup.last_exiting or "") != returncode:
        # A command job that never declared the contract: its own `exit 3` is a crash like any other (it
        # was read as "no valid checkpoint left" and ended the run without a retry).
        meaningless = True
        evidence["exit_code_meaning"] = ("none: the job did not declare ulyssesd's exit codes ([job] "
                                         "exit_codes = \"ulyssesd\", or the client's `exiting` event)")
    symptom = Symptom.launch_failure if early and diag_label == "launcher_error" else Symptom.crash
    if diag_label == "cuda_oom":
        symptom = Symptom.cuda_oom
    elif diag_label == "disk_full":
        symptom = Symptom.disk_full
    if diag_label == "config_rejected" and returncode != 3:
        returncode = 2  # the diagnosis found the refusal (a DeepSpeed/HF config check): the same as exit 2
        meaningless = False
    if diag_label == "killed" and any(_SCHEDULER_END.search(e) or scheduler_ended(e) for e in diag_evidence or []):
        # The scheduler ended the job (time limit, preemption, cancel): restarting inside the allocation is
        # pointless; the scheduler's requeue (if any) restarts the service, which resumes from the checkpoint.
        what = f"the scheduler ended attempt {sup.attempt}: {(diag_evidence or [''])[0][:300]}"
        iid = sup.incidents.incident(Symptom.crash, sup.last_step or 0, Severity.critical, what, evidence)
        sup.incidents.stopped(iid, what)
        sup.fail(what)
        return
    if returncode in (2, 3) and status.signal is None and not meaningless:
        # CONTRACTS.md: 2 = the job rejected its config, 3 = no loadable checkpoint left. Relaunching the
        # same thing cannot help, and starting from scratch would silently discard the run's progress.
        via = "" if returncode == status.returncode else f" from a rank; the launcher exited {status.returncode}"
        problems = disk.refusal_lines(tail)
        evidence["problems"] = problems
        if problems:
            evidence["evidence_lines"] = problems
        what = (f"the job rejected config v{sup.config_version} (exit 2{via})" if returncode == 2
                else f"no valid checkpoint left to resume from (exit 3{via})")
        if problems:
            what += ": " + "; ".join(p.removeprefix("- ") for p in problems[:3])[:400]
        sym = Symptom.crash if returncode == 2 else Symptom.checkpoint_corrupt
        iid = sup.incidents.incident(sym, sup.last_step or 0, Severity.critical, what, evidence)
        sup.incidents.stopped(iid, what)
        sup.fail(what)
        return
    what = (f"rank process(es) {sup.rank_lost['pids']} died; the daemon stopped the waiting ranks"
            if sup.rank_lost is not None else f"attempt {sup.attempt} {status.describe()}")
    if save_failure is not None:
        what = (f"checkpoint save of {save_failure.get('tag')} failed: {save_failure.get('errno')} "
                f"({save_failure.get('bytes_free')} bytes free); {what}")
    iid = sup.incidents.incident(symptom, sup.last_step or 0, Severity.critical,
                        f"{what}; diagnosis {diag_label} ({diag_confidence or 'high'} confidence)",
                        evidence)
    decisions: list[Any] = []
    # The symptoms that mean "this crash": the supervisor's (it knows an early death from a mid-run one) and
    # the crash playbook's for the label (which files a plain exception, launcher_error, as launch_failure).
    this_crash = {symptom.value}
    if sup.engine is not None:
        label = diag_label or "healthy"
        if label == "host_oom_killed" and diag_confidence != "high":
            # A bare SIGKILL with no OOM-killer line in the log (an operator, a chaos test, a node agent):
            # treat it as an unexplained crash (restart within budget) rather than run the host-memory
            # ladder, whose rungs may all be inapplicable and end the run.
            label = "sigkill_unexplained"
        this_crash.add(ladder_for_crash(label)[1])
        replan = _memory_replanner(sup) if label == "cuda_oom" else None
        _, decisions = _split_outputs(sup.engine.on_crash(label, diag_evidence or [], sup.steady.now(), replan=replan))
    relaunch = Relaunch(f"crash: {diag_label}" if diag_label else "crash", iid)  # quoted as "launched (crash: x)"
    acted = False
    for dec in decisions:
        dec_apply = dec.apply
        reason = dec.reason or (f"crash: {diag_label}" if diag_label else "crash")
        params = {"rung": dec.action_kind, "ladder": dec.ladder,
                  "apply": dec_apply, "reason": reason}
        if dec.ladder == "memory" and getattr(sup.engine, "memory_evidence", None):
            params["evidence"] = sup.engine.memory_evidence   # the OOM numbers and plans (memory_evidence.py)
        target = iid
        if dec.symptom not in this_crash:
            # e.g. crash_loop / no_progress: its own incident, so the budget stop is visible as such.
            target = sup.incidents.incident(Symptom(dec.symptom), sup.last_step or 0, Severity.critical, reason,
                                   {"after_incident": iid})
        if dec_apply == "stop":
            sup.incidents.action(target, ActionKind.stop, params, {}, ApplyMode.none)
            sup.store.update_incident_status(target, IncidentStatus.failed, reason)
            if target != iid:
                sup.store.update_incident_status(iid, IncidentStatus.failed, reason)
            sup.fail(reason)
            return
        no_room = dec_apply == "restart_latest" and dec.action_kind == "prune_and_restart"
        if no_room and not disk.resume_after_no_space(sup, iid, save_failure):
            return  # nothing left to prune: the run ended FAILED with that incident
        if dec_apply == "none":
            observe = dec.would_apply is not None
            sup.incidents.action(target, ActionKind.observe_only_noop if observe else action_kind(dec),
                        {**params, "would_apply": dec.would_apply,
                         "patch": dec.config_patch}, {}, ApplyMode.none, observe_only=observe)
            continue
        from_v = sup.config_version
        patch = patch_of(sup, dec)
        to_v, diff = sup.new_config_version(patch, f"crash {diag_label}: {reason}") if patch else (from_v, {})
        if dec_apply == "rollback_skip":
            relaunch.rollback_to_step = dec.rollback_to_step
        params["rollback_to_step"] = relaunch.rollback_to_step
        sup.incidents.action(target, action_kind(dec), params, diff, ApplyMode.restart, from_v, to_v)
        sup.say(f"  action: {params['rung']} — {reason}" + (f" (config v{from_v}->v{to_v})" if to_v != from_v else ""))
        acted = True
    if sup.spec.remediation.mode == "observe":
        # Observe-only acts on nothing, restarts included: the run ends here, with what would have happened.
        sup.incidents.action(iid, ActionKind.observe_only_noop, {"would": "restart from the latest valid checkpoint"},
                    {}, ApplyMode.none, observe_only=True)
        sup.store.update_incident_status(iid, IncidentStatus.escalated, "observe-only: not restarted")
        sup.fail(f"observe-only mode: attempt {sup.attempt} ended ({status.describe()}) and was not restarted")
        return
    if not acted:
        sup.incidents.action(iid, ActionKind.restart, {"reason": "crash: restart from the latest valid checkpoint"}, {},
                    ApplyMode.restart, sup.config_version, sup.config_version)
    sup.store.update_incident_status(iid, IncidentStatus.remediating, "relaunching")
    schedule_relaunch(sup, relaunch, early=early)


def exit_handling_failed(sup: ExitRun, status: ExitStatus, plan: TerminationPlan, attempt: int,
                         exc: BaseException) -> None:
    """`on_exit` raised (a bug, a store hiccup). Like a telemetry record whose handling raised, it must not end
    supervision: the traceback goes to the log (the caller logged it) and into a crash incident, and the run
    goes where the plan said: a stop, pause or playbook stop is honoured; a requested relaunch or an
    unrequested exit relaunches within the restart budget (a handler that fails on every exit ends in the
    budget's crash_loop / no_progress FAILED, never in a loop). Only if that fails too does the run end FAILED."""
    tb = traceback.format_exc(limit=30)
    sup.term = None
    what = (f"the daemon's handling of attempt {attempt}'s exit ({status.describe()}) failed: "
            f"{type(exc).__name__}: {str(exc)[:300]}")
    try:
        if sup.job is None:  # not yet relaunched by the handler: close the attempt if it is still open
            try:
                if sup.store.get_attempt(sup.run_id, attempt).ended_at is None:
                    sup.store.end_attempt(sup.run_id, attempt, returncode=status.returncode, signal=status.signal,
                                          diagnosis="internal_error", diagnosis_evidence=[what])
            except Exception as inner:  # noqa: BLE001 - the attempt row is bookkeeping; the incident says it
                log.warning("could not close the attempt after the failed exit handling", error=repr(inner))
        iid = sup.incidents.incident(Symptom.crash, sup.last_step or 0, Severity.critical, what,
                                     {"internal_error": tb[-8000:], "exit": status.describe(), "plan": str(plan),
                                      "attempt": attempt}, attempt=attempt)
        if sup.state in TERMINAL or sup.job is not None or sup.state == S.BACKOFF:
            # The handler got as far as ending the run, launching the next attempt or scheduling it.
            sup.store.update_incident_status(iid, IncidentStatus.resolved, "the exit was handled up to the error")
            return
        if plan.then is Then.STOP:
            sup.set_state(S.STOPPED, f"job exited after stop; its exit handling failed (incident #{iid})")
        elif plan.then is Then.PAUSE:
            sup.set_state(S.PAUSED, f"job exited, paused; its exit handling failed (incident #{iid})")
        elif plan.then is Then.FAIL:
            sup.fail(f"stopped by the playbook; its exit handling failed (incident #{iid})")
        else:
            sup.incidents.action(iid, ActionKind.restart, {"reason": "internal error handling the exit: restart "
                                 "from the latest valid checkpoint"}, {}, ApplyMode.restart,
                                 sup.config_version, sup.config_version)
            sup.store.update_incident_status(iid, IncidentStatus.remediating, "relaunching")
            schedule_relaunch(sup, plan.relaunch or Relaunch(f"internal error handling attempt {attempt}'s exit", iid))
    except Exception:  # noqa: BLE001 - the last resort: end the run honestly, keep the daemon up
        log.exception("recovering from the failed exit handling failed too; the run ends as its plan said, "
                      "else FAILED")
        if sup.state not in TERMINAL:
            try:
                if plan.then in (Then.STOP, Then.PAUSE):  # the operator's stop or pause needs no store to hold
                    if sup.state != S.STOPPING and plan.then is Then.STOP:
                        sup.set_state(S.STOPPING, "operator stop")
                    sup.set_state(S.STOPPED if plan.then is Then.STOP else S.PAUSED,
                                  f"job exited after {plan.then.value}; its exit could not be recorded")
                    return
                sup.fail(f"{what}; recovering from it failed too (see the daemon log)")
            except Exception:  # noqa: BLE001
                log.critical("could not record the run as FAILED; the daemon stays up, the run needs a human",
                             run_id=sup.run_id)


def exit_codes_declared(sup: ExitRun) -> bool:
    """Whether the job's exit codes 2 and 3 carry ulyssesd's meaning (config rejected, no checkpoint left):
    the built-in job's do; a command job's only with `[job] exit_codes = "ulyssesd"` (a job written to the
    contract). Otherwise only the client's `exiting` event (reason config_rejected / no_checkpoint) gives a
    code that meaning; a bare `exit 3` of a user's script is a crash."""
    js = getattr(sup.spec, "job_section", None)
    return js is None or js.kind == "builtin" or getattr(js, "exit_codes", "none") == "ulyssesd"


def _memory_replanner(sup: ExitRun) -> Any:
    """The planner over the current config for the memory ladder (built-in GPT job on a GPU host), else None.
    Never raises: without it the ladder falls back to the OOM message alone."""
    if sup.spec.job_section.kind != "builtin" or sup.spec.job.train.device == "cpu":   # a CPU run on a GPU host
        return None
    try:
        from ulyssesd.daemon.operator import ctl_plan

        launcher = sup.spec.launcher
        cluster = ctl_plan.detect_local_cluster(launcher.nnodes, launcher.nproc_per_node)
        return ctl_plan.memory_replanner(sup.spec, sup.config, dict(sup.launch_env or {}), cluster)
    except Exception as exc:  # noqa: BLE001 - a planner problem must not break crash handling; say so
        log.warning("memory re-planning unavailable", error=repr(exc))
        return None
