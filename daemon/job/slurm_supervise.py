"""The supervisor's Slurm hooks (submit mode): how a Slurm job's end becomes a decision, stack dumps through
`scancel`, re-adoption by job id. The supervisor calls these from one line each (docs/SLURM.md):

- `request_stack_dumps`: the hang path's SIGUSR1 goes to every rank through `scancel --signal=USR1` (the
  ranks run on other hosts; the per-rank dump files land in the run directory on the shared filesystem);
- `before_exit`: the attempt's watcher has exited; read how its Slurm job ended (`attempt-N.end.json`, or
  scontrol/sacct when the watcher was killed, after making sure the job is gone). A lost node becomes an
  incident naming the node and its ranks, the node joins `--exclude` (bounded) and the run resumes from the
  latest valid checkpoint; a time limit becomes a continuation in a new allocation that does not count
  against the restart budget; anything else is left to the crash path, with Slurm's record as evidence;
- `after_exit`: the attempt row says where it ran (`host` = "slurm job J on n1,n2") and the Slurm diagnosis;
- `reattach`: a restarted daemon whose attempt's watcher is gone (the host rebooted) but whose job id is in
  the run directory starts a new watcher that attaches to that job (or reads how it ended).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.core.relaunch import Relaunch
from ulyssesd.daemon.core.termination import Termination, TerminationPlan, Then
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import ExitStatus, JobHandle
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.job import elastic
from ulyssesd.daemon.job import slurm as sl
from ulyssesd.daemon.job.slurm_watch import WatchPlan, final_end, read_end, read_job_id
from ulyssesd.daemon.ports import HostSide, JobConfig, Lifecycle, Records, RunFiles
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, Severity, Symptom

log = get_logger("ulyssesd.slurm")


class SlurmRun(RunFiles, JobConfig, Records, Lifecycle, HostSide, Protocol):
    """What supervising an attempt through Slurm uses of the run."""

    last_exiting: str | None  # the job's 'exiting' event, once it said it is ending


def submit_mode(sup: SlurmRun) -> bool:
    slurm = getattr(sup.spec, "slurm", None)
    return slurm is not None and slurm.mode == "submit"


def allocation_mode(sup: SlurmRun) -> bool:
    slurm = getattr(sup.spec, "slurm", None)
    return slurm is not None and slurm.mode == "allocation" and bool(os.environ.get("SLURM_JOB_ID"))


def _allocation_exit(sup: SlurmRun) -> sl.SlurmEnd | None:
    """Allocation mode: the srun step ended unrequested. A node of the allocation that is now DOWN or not
    responding (an allocation made with --no-kill outlives it) is the cause: named, excluded from the next
    srun within the allocation's nodes, resumed from the latest valid checkpoint; anything else: the crash path."""
    if (sup.term is not None and sup.term.plan.then is not Then.CRASH) or sup.last_exiting == "completed":
        return None  # an end the daemon asked for, or the job's own completion
    job_id = os.environ.get("SLURM_JOB_ID", "")
    alloc = sl.expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
    states = {}
    for n in alloc:
        try:
            info = commands(sup).node(n)
        except sl.SlurmError:
            info = None
        if info is not None:
            states[n] = info.get("State", "")
    excluded = [*sup.spec.slurm.exclude, *sl.read_exclusions(sup.run_dir)]
    lost = [n for n in alloc if sl.node_lost(states.get(n, "")) and n not in excluded]  # not blamed twice
    if not lost:
        return None
    step_nodes = [n for n in alloc if n not in excluded][:sup.spec.launcher.nnodes]  # srun's block placement
    by_rank = sl.rank_nodes(step_nodes, sup.spec.launcher.nproc_per_node)
    lost_ranks = {n: sorted(r for r, nn in by_rank.items() if nn == n) for n in lost}
    named = ", ".join(f"{n} (rank{'s' if len(lost_ranks[n]) != 1 else ''} "
                      f"{','.join(map(str, lost_ranks[n])) or 'none'}, state {states[n]})" for n in lost)
    end = sl.SlurmEnd("node_lost", job_id, "RUNNING", "", step_nodes, lost, lost_ranks, states,
                      f"allocation {job_id} lost node {named}",
                      {"scontrol_show_node": {n: commands(sup).raw(["scontrol", "show", "node", n]) for n in lost}})
    _node_lost(sup, end, partition=alloc)
    return end


def commands(sup: SlurmRun) -> sl.SlurmCommands:
    """The Slurm seam of this supervisor (tests set `sup.slurm_commands` to a fake before start)."""
    cmds = getattr(sup, "slurm_commands", None)
    if cmds is None:
        cmds = sl.RealSlurm(sup.spec.slurm.command_timeout_s, bin_dir=sup.spec.slurm.bin_dir)
        sup.slurm_commands = cmds  # type: ignore[attr-defined]
    return cmds


def current_job_id(sup: SlurmRun) -> str | None:
    return read_job_id(sup.run_dir, sup.attempt)


def request_stack_dumps(sup: SlurmRun, t: Termination, files: dict[int, Path], now: float) -> bool:
    """SIGUSR1 to every rank of the attempt's job via `scancel --signal=USR1` (steps only: the batch shell
    would die of it). Returns False when there is no job to signal (the caller's local path then runs)."""
    from ulyssesd.daemon.core.files import _size

    job_id = current_job_id(sup)
    if job_id is None:
        return False
    t.stack_offsets = {str(f): _size(f) for f in files.values()}
    try:
        commands(sup).scancel(job_id, signal="USR1")
        sup.say(f"  scancel --signal=USR1 {job_id} (stack dumps of every rank)")
    except sl.SlurmError as exc:
        sup.say(f"  stack dump request failed: {exc}")
    t.dump_until = now + sup.dcfg.stack_dump_wait_s
    return True


def hang_nodes(sup: SlurmRun, ranks: list[int], dumped: list[int] | None = None) -> dict[str, Any]:
    """The nodes of the hang path's suspects (rank -> node from the job's node list), for the hang incident:
    the waited-for ranks (`ranks`), or, when the stacks name none, the ranks that wrote no dump while the others
    did (`dumped`: a stopped or wedged process cannot run its SIGUSR1 handler). {} outside submit mode or
    when Slurm does not know the job."""
    if not submit_mode(sup) or not (ranks or dumped):
        return {}
    job_id = current_job_id(sup)
    if job_id is None:
        return {}
    try:
        job = commands(sup).job(job_id)
    except sl.SlurmError:
        return {}
    nodes = sl.expand_hostlist((job or {}).get("NodeList", ""))
    by_rank = sl.rank_nodes(nodes, sup.spec.launcher.nproc_per_node)
    out: dict[str, Any] = {}
    named = {r: by_rank[r] for r in ranks if r in by_rank}
    silent = sorted(set(by_rank) - set(dumped)) if dumped and not named else []
    if silent and len(silent) < len(by_rank):
        out["silent_ranks"] = silent  # no dump from them, while their peers dumped
        named = {r: by_rank[r] for r in silent}
    if not named:
        return {}
    where = ", ".join(sorted(set(named.values())))
    note = (f"rank{'s' if len(silent) > 1 else ''} {','.join(map(str, silent))} wrote no stack dump: node {where}"
            if silent else f"on node {where}")
    return {**out, "slurm_job": job_id, "waited_for_nodes": sorted(set(named.values())),
            "rank_nodes": {str(r): n for r, n in named.items()}, "note": note}


def _ensure_gone(sup: SlurmRun, job_id: str) -> None:
    """No Slurm job may outlive its attempt: a watcher killed by SIGKILL could not cancel it."""
    try:
        job = commands(sup).job(job_id)
        if job is not None and job.get("JobState", "").split(" ")[0] not in sl.TERMINAL_STATES:
            commands(sup).scancel(job_id)
            sup.say(f"  scancel {job_id}: the attempt's watcher is gone, its job must not run on unwatched")
    except sl.SlurmError as exc:
        log.warning("could not check/cancel the attempt's Slurm job", job_id=job_id, error=str(exc))


def read_attempt_end(sup: SlurmRun) -> sl.SlurmEnd | None:
    job_id = current_job_id(sup)
    if job_id is None:
        return None
    end = read_end(sup.run_dir, sup.attempt)
    if end is not None and end.job_id == job_id:
        return end
    _ensure_gone(sup, job_id)
    mark = sup.run_dir / sl.SLURM_DIR / sl.TIME_LIMIT_MARK.format(attempt=sup.attempt)
    return final_end(commands(sup), job_id, sup.spec.launcher.nproc_per_node, mark.exists(), [])


def before_exit(sup: SlurmRun, status: ExitStatus) -> sl.SlurmEnd | None:
    """Turn the attempt's Slurm end into the request the exit path carries out (see the module doc)."""
    apply_size(sup)  # a restarted daemon: the size the run has (job/elastic.py)
    if allocation_mode(sup):
        return _allocation_exit(sup)
    if not submit_mode(sup):
        return None
    refused = _refusal(sup)
    if refused is not None and (sup.term is None or sup.term.plan.then is Then.CRASH):
        # A refused submission is the spec's problem (partition, gres, time, account, --exclude): stop now
        # with sbatch's own words rather than resubmit the same thing until the restart budget runs out.
        what = f"sbatch refused attempt {sup.attempt}: {refused}"
        iid = sup.incidents.incident(Symptom.launch_failure, sup.last_step or 0, Severity.critical, what,
                                     {"sbatch_error": refused, "status": status.describe()})
        sup.incidents.stopped(iid, what)
        _then(sup, what, TerminationPlan(Then.FAIL))
        return None
    end = read_attempt_end(sup)
    if end is not None and end.kind == "node_lost" and sup.term is not None and sup.term.plan.relaunch is not None:
        _loss_wins(sup, end)  # a relaunch on the same nodes (a hang's) would ask for the dead node again
    elif end is None or (sup.term is not None and sup.term.plan.then is not Then.CRASH):
        return end  # no job (sbatch refused: the log says why), or an end the daemon asked for
    if end.kind == "node_lost":
        _node_lost(sup, end)
    elif end.kind == "time_limit" and sup.last_exiting != "completed":
        ckpt_step = sup.latest_ckpt[1] if sup.latest_ckpt else None
        # A continuation is free only when the allocation moved the run on: one that saved nothing new (the
        # limit is shorter than start-up + a checkpoint interval) counts, so the no-progress rule ends a loop.
        stalled = ckpt_step is None or ckpt_step == getattr(sup, "slurm_continued_at_step", None)
        sup.slurm_continued_at_step = ckpt_step  # type: ignore[attr-defined]
        reason = (f"time limit continuation: {end.why}; resubmitting in a new allocation from the latest valid "
                  f"checkpoint " + ("(no new checkpoint in this allocation: counted against the restart budget)"
                                    if stalled else "(not a failure, not counted against the restart budget)"))
        sup.incidents.action(None, ActionKind.restart, {"continuation": "time_limit", "slurm_job": end.job_id,
                                                        "state": end.state, "latest_checkpoint": sup.latest_ckpt[0]
                                                        if sup.latest_ckpt else None}, {}, ApplyMode.restart,
                             sup.config_version, sup.config_version)
        sup.say(f"  {reason}")
        _then(sup, reason, TerminationPlan.relaunching(Relaunch(reason, None, counts_against_budget=stalled)))
    return end


def node_loss_pending(sup: SlurmRun) -> list[str]:
    """The nodes the attempt's watcher saw lost and is ending the job for (`attempt-N.lost.json`, written before
    its scancel): the hang path leaves such an attempt to the node-loss path. [] when none (or not submit mode)."""
    import json

    if not submit_mode(sup):
        return []
    try:
        data = json.loads((sup.run_dir / sl.SLURM_DIR / f"attempt-{sup.attempt}.lost.json").read_text())
    except (OSError, ValueError, RecursionError):
        return []
    nodes = data.get("nodes") if isinstance(data, dict) and data.get("job_id") == current_job_id(sup) else None
    return [str(n) for n in nodes] if isinstance(nodes, list) else []


def _loss_wins(sup: SlurmRun, end: sl.SlurmEnd) -> None:
    """The attempt ended with a node lost while a relaunch was pending (the hang path took the attempt before
    Slurm called the node DOWN): the node loss decides what follows (exclude or shrink); the relaunch's
    incident says it was this loss."""
    assert sup.term is not None and sup.term.plan.relaunch is not None
    was = sup.term.plan.relaunch
    sup.say(f"  {end.why}: the node loss decides the next attempt, not the pending relaunch ({was.reason})")
    if isinstance(was.incident_id, int):
        sup.store.update_incident_status(was.incident_id, IncidentStatus.resolved,
                                         f"explained by a node loss: {end.why}; handled as a node loss")
    sup.term = None
    _node_lost(sup, end)


def _refusal(sup: SlurmRun) -> str | None:
    import json

    try:
        data = json.loads((sup.run_dir / sl.SLURM_DIR / f"attempt-{sup.attempt}.refused.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return str(data.get("error"))[:1000] if isinstance(data, dict) else None


def _node_lost(sup: SlurmRun, end: sl.SlurmEnd, partition: list[str] | None = None) -> None:
    """`partition`: the nodes a replacement can come from (default: the spec's partition, from sinfo)."""
    slurm = sup.spec.slurm
    current = list(dict.fromkeys([*slurm.exclude, *sl.read_exclusions(sup.run_dir)]))
    if partition is None:
        try:
            partition = commands(sup).partition_nodes(slurm.partition)
        except sl.SlurmError as exc:
            partition = []
            end.evidence["sinfo_error"] = str(exc)
    new, refused = sl.bounded_exclude(current, end.lost_nodes, partition, sup.spec.launcher.nnodes,
                                      slurm.max_excluded)
    evidence = {"slurm": end.to_json(), "exclude_before": current, "exclude_after": new,
                "partition_nodes": partition, "last_step": sup.last_step}
    summary = f"{end.why}; the attempt ended"

    def incident(what: str) -> int:  # the summary says what is done: exclude, continue smaller, or stop
        return sup.incidents.incident(Symptom.crash, sup.last_step or 0, Severity.critical, f"{summary}; {what}",
                                      evidence)

    if refused:
        # No spare: continue on fewer nodes (job/elastic.py), or stop FAILED with why not.
        lost_all = list(dict.fromkeys([*current, *end.lost_nodes]))
        if _shrink(sup, incident, end, lost_all, partition, refused) is not None:
            sl.write_exclusions(sup.run_dir, lost_all, f"lost in attempt {sup.attempt} (Slurm job {end.job_id}): "
                                f"{end.why}; no spare, continuing on fewer nodes")
        return
    iid = incident(f"the next attempt excludes {', '.join(new)}")
    sl.write_exclusions(sup.run_dir, new, f"lost in attempt {sup.attempt} (Slurm job {end.job_id}): {end.why}")
    sup.incidents.action(iid, ActionKind.restart, {"reason": "node lost: resubmit without it, resume from the latest valid "
                                          "checkpoint", "lost_nodes": end.lost_nodes, "exclude": new},
                {}, ApplyMode.restart, sup.config_version, sup.config_version)
    sup.store.update_incident_status(iid, IncidentStatus.remediating, "resubmitting without the lost node")
    sup.say(f"  node lost: {', '.join(end.lost_nodes) or '?'}; the next attempt runs with --exclude={','.join(new)}")
    _then(sup, summary, TerminationPlan.relaunching(Relaunch(f"node {', '.join(end.lost_nodes) or '?'} lost", iid)))


def _shrink(sup: SlurmRun, incident: Callable[[str], int], end: sl.SlurmEnd, excluded: list[str],
            partition: list[str], refused: str) -> str | None:
    """No spare for the lost node: continue on the remaining nodes when `slurm.on_node_loss = "shrink"`, the global
    batch can be kept and the planner says the model fits (daemon/job/elastic.py); else stop FAILED with why.
    Returns None when the run stops, else the decision's text."""
    slurm = sup.spec.slurm
    usable = [n for n in partition if n not in excluded] if partition else []
    why_not = None
    if slurm.on_node_loss != "shrink":
        why_not = "slurm.on_node_loss = \"stop\""
    elif sup.spec.job_section.kind != "builtin":
        why_not = "a command job's checkpoints and batch layout are its own (shrinking is the built-in job's)"
    elif slurm.max_excluded is not None and len(excluded) > slurm.max_excluded:
        why_not = f"slurm.max_excluded={slurm.max_excluded}"
    elif not usable:
        why_not = "no usable node left" + (f" ({end.evidence['sinfo_error']})" if "sinfo_error" in end.evidence else "")
    decision = None
    if why_not is None:
        job = sup.spec.job
        before = elastic.layout_of(_job_of(sup), sup.spec.launcher.nnodes, sup.spec.launcher.nproc_per_node)
        world_set = jc.get_dotted(sup.config, "parallel.world_size") is not None
        try:
            decision = elastic.decide(before, len(usable), min_nnodes=slurm.min_nnodes,
                                      heads=job.resolved_model().num_attention_heads, seq_len=job.train.seq_len,
                                      replan=elastic.replanner(sup.spec, sup.config,
                                                               lambda a: elastic.Decision(True, before, a, "").patch(
                                                                   world_set)))
        except Exception as exc:  # noqa: BLE001 - a planner that cannot decide must not let an unplanned run start
            why_not = f"the re-plan failed: {exc!r}"[:500]
        else:
            why_not = None if decision.ok else decision.reason
    if why_not is not None or decision is None or decision.after is None:
        reason = f"node lost and no node left to replace it: {refused}; not continuing on fewer nodes: {why_not}"
        sup.incidents.stopped(incident(f"{refused}; not continuing on fewer nodes: {why_not}"), reason)
        _then(sup, reason, TerminationPlan(Then.FAIL))  # the exit path fails the run with this reason
        return None
    after = decision.after
    summary = (f"no spare for {', '.join(end.lost_nodes)}: continuing on {after.nnodes} node(s), DP {before.dp} -> "
               f"{after.dp}, SP {before.sp} -> {after.sp}, micro-batch x accumulation {before.micro_batch}x"
               f"{before.accum} -> {after.micro_batch}x{after.accum}, global batch {after.global_batch} kept")
    iid = incident(summary)
    earlier = elastic.read_resize(sup.run_dir) or {}  # a second loss while small: the full size stays the first's
    record = {"nnodes": after.nnodes, "full_nnodes": earlier.get("full_nnodes", before.nnodes),
              "full_layout": earlier.get("full_layout", decision.evidence()["before"]),
              "lost_nodes": [n for n in excluded if n not in slurm.exclude],  # slurm.exclude's were never lost
              "since_attempt": sup.attempt + 1, "incident_id": iid}
    elastic.write_resize(sup.run_dir, record)
    sup.spec.launcher = sup.spec.launcher.model_copy(update={"nnodes": after.nnodes})
    from_v = sup.config_version
    to_v, diff = sup.new_config_version(decision.patch(world_set), f"continue on {after.nnodes} node(s) after "
                                        f"losing {', '.join(end.lost_nodes)}")
    sup.incidents.action(iid, ActionKind.set_config, {"resize": "shrink", "reason": decision.reason,
                                                      "lost_nodes": end.lost_nodes, "exclude": excluded,
                                                      **decision.evidence()}, diff, ApplyMode.restart, from_v, to_v)
    sup.store.update_incident_status(iid, IncidentStatus.remediating, summary)
    sup.say(f"  {summary}; memory: {decision.memory.text if decision.memory else '?'}")
    _then(sup, summary, TerminationPlan.relaunching(Relaunch(summary, iid)))
    return decision.reason


def _job_of(sup: SlurmRun) -> Any:
    """The job spec of the current config version (what the next attempt would run)."""
    from ulyssesd.training.spec import JobSpec

    return JobSpec.model_validate({k: v for k, v in sup.config.items() if k != "launcher"})


def apply_size(sup: SlurmRun) -> None:
    """The run's current node count (a continuation on fewer nodes, job/elastic.py) into the spec's launcher: a
    restarted daemon launches at the size the run has."""
    rec = elastic.read_resize(sup.run_dir)
    if rec is not None and sup.spec.launcher.nnodes != rec["nnodes"]:
        sup.spec.launcher = sup.spec.launcher.model_copy(update={"nnodes": rec["nnodes"]})


def before_launch(sup: SlurmRun) -> None:
    """Before every relaunch: the run's size, and with `slurm.grow_back` the full size again once every node it
    lost answers Slurm in service (not DOWN/DRAIN/not responding): exclusions lifted, the job's layout restored."""
    if not (submit_mode(sup) or allocation_mode(sup)):
        return
    apply_size(sup)
    rec = elastic.read_resize(sup.run_dir)
    if rec is None or not sup.spec.slurm.grow_back:
        return
    states: dict[str, str] = {}
    for n in rec.get("lost_nodes", []):
        try:
            info = commands(sup).node(n)
        except sl.SlurmError:
            info = None
        states[n] = "" if info is None else info.get("State", "")
    if not states or any(not st or sl.node_lost(st) or "DRAIN" in st.upper() or "DOWN" in st.upper()
                         for st in states.values()):
        sup.say(f"  grow_back: still on {rec['nnodes']} node(s) (lost nodes: "
                f"{', '.join(f'{n} {st or chr(63)}' for n, st in states.items())})")
        return
    full = rec["full_layout"]
    small = elastic.record(elastic.layout_of(_job_of(sup), int(rec["nnodes"]), sup.spec.launcher.nproc_per_node))
    keep = [n for n in sl.read_exclusions(sup.run_dir) if n not in states]
    sl.write_exclusions(sup.run_dir, keep, f"grew back: {', '.join(states)} in service again")
    sup.spec.launcher = sup.spec.launcher.model_copy(update={"nnodes": int(rec["full_nnodes"])})
    patch = {"train.gradient_accumulation_steps": full["accum"], "train.micro_batch_size": full["micro_batch"],
             "parallel.sequence_parallel_size": full["sp"]}
    if jc.get_dotted(sup.config, "parallel.world_size") is not None:
        patch["parallel.world_size"] = full["world"]
    from_v = sup.config_version
    to_v, diff = sup.new_config_version(patch, f"grow back to {rec['full_nnodes']} node(s)")
    what = (f"grew back to {rec['full_nnodes']} node(s): {', '.join(f'{n} {st}' for n, st in states.items())} in "
            f"service again (slurm.grow_back); DP, SP and accumulation as before the loss")
    # The node-loss incident that shrank the run gets its second resize (before/after); resolved by it, unless the
    # smaller run's progress resolved it already (then its reason now says it grew back).
    iid = rec.get("incident_id")
    sup.incidents.action(iid if isinstance(iid, int) else None, ActionKind.set_config,
                         {"resize": "grow", "before": small, "after": full, "node_states": states},
                         diff, ApplyMode.restart, from_v, to_v)
    if isinstance(iid, int):
        sup.store.update_incident_status(iid, IncidentStatus.resolved, what)
    elastic.write_resize(sup.run_dir, None)
    sup.say(f"  {what}")


def _then(sup: SlurmRun, reason: str, plan: TerminationPlan) -> None:
    """What the exit path does next: an exit the Slurm record explains is a requested one (a termination
    already over: the job is gone), so the crash path's log diagnosis does not read Slurm's cancel lines."""
    sup.term = Termination(reason=reason, plan=plan, started=sup.os.monotonic(), grace_s=0.0)


def after_exit(sup: SlurmRun, attempt: int, end: sl.SlurmEnd | None) -> None:
    """The closed attempt row: where it ran and, for a Slurm-decided end, the Slurm diagnosis."""
    if end is None:
        return
    changes: dict[str, Any] = {"host": f"slurm job {end.job_id} on {','.join(end.nodes) or '?'}"[:255]}
    if end.kind in ("node_lost", "time_limit"):
        changes["diagnosis"] = end.kind
        changes["diagnosis_evidence"] = [end.why, *(f"{k}: {str(v)[:2000]}" for k, v in end.evidence.items())]
    try:
        sup.store.update_attempt(sup.run_id, attempt, **changes)
    except Exception as exc:  # noqa: BLE001 - bookkeeping; the run's decision is already made
        log.warning("could not record the attempt's Slurm end", error=repr(exc))


def reattach(sup: SlurmRun, attempt: Any) -> JobHandle | None:
    """A re-adopted attempt whose watcher process is gone but whose Slurm job id is recorded: start a new
    watcher for the same attempt; it attaches to the job (or reads how it ended) and exits as the old one
    would have. None when there is nothing to attach to."""
    if not submit_mode(sup):
        return None
    job_id = read_job_id(sup.run_dir, attempt.number)
    plan_path = sup.run_dir / sl.SLURM_DIR / f"attempt-{attempt.number}.plan.json"
    if job_id is None or not plan_path.is_file() or read_end(sup.run_dir, attempt.number) is not None:
        return None
    try:
        WatchPlan.read(plan_path)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    exit_file = sup.run_dir / "attempts" / f"{attempt.number}.exit"
    exit_file.unlink(missing_ok=True)  # the dead watcher's record; the new one writes the real end
    argv = list(attempt.command)
    marker = sup.marker()
    job = sup.os.spawn(argv, {**_env(), "ULYSSESD_RUN_DIR": str(sup.run_dir), marker[0]: marker[1]}, str(sup.run_dir),
                       sup.run_dir / "logs" / f"attempt-{attempt.number}.log")
    sup.store.update_attempt(sup.run_id, attempt.number, pid=job.pid, pgid=job.pgid, proc_start_time=job.start_time)
    log.info("re-attached to the attempt's Slurm job", job_id=job_id, attempt=attempt.number, pid=job.pid)
    sup.say(f"re-attached to Slurm job {job_id} of attempt {attempt.number} (new watcher pid {job.pid})")
    return job


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", ULYSSESD_REATTACHED=str(int(SYSTEM.time())))


def with_nodes(sup: SlurmRun, fnd: Any) -> Any:
    """A straggler finding (submit mode) also names the slowest rank's node: `evidence.slowest_node` and the
    message's `(rank R on node N)`, from the job's node list. Anything else is returned unchanged."""
    rank = (fnd.evidence or {}).get("slowest_rank") if fnd.symptom == "straggler" else None
    if not isinstance(rank, int) or isinstance(rank, bool):
        return fnd
    named = hang_nodes(sup, [rank])
    node = (named.get("rank_nodes") or {}).get(str(rank))
    if node is None:
        return fnd
    fnd.evidence = {**fnd.evidence, "slowest_node": node, "slurm_job": named["slurm_job"]}
    fnd.message = f"{fnd.message} (rank {rank} on node {node})"
    return fnd
