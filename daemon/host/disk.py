"""Storage trouble: a job whose checkpoint save failed (full disk, quota, read-only filesystem), the daemon's
own writes failing for the same reasons, and what torchrun says about each rank's exit code.

Sources, most reliable first: the job's `checkpoint_save_failed` event (errno name, tag, path, bytes free),
then the log's diagnosis label (`disk_full`), then the filesystem itself (statvfs: read-only flag).
"""

from __future__ import annotations

import errno
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.host.disk_budget import BudgetRun, checkpoint_root
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.ports import Lifecycle
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, Severity, Symptom

log = get_logger("ulyssesd.supervisor")

#: errno names that mean "no room" (prune, then resume) and "read-only" (stop cleanly, delete nothing).
NO_SPACE = frozenset({"ENOSPC", "EDQUOT"})
READ_ONLY = "EROFS"
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
#: The job's exit code when a checkpoint save failed (training/train_checkpoints.py EXIT_SAVE_FAILED).
EXIT_SAVE_FAILED = 4
#: The job's `exiting` reasons that mean "refused" -> the exit code they stand for (docs/CONTRACTS.md).
JOB_REFUSAL_EXIT = {"config_rejected": 2, "no_checkpoint": 3}
READ_ONLY_REASON = "run directory is read-only"
#: Below this much free space the filesystem counts as full whatever the checkpoint size.
MIN_FREE_BYTES = 64 << 20

# torchrun's failure report, one block per failed rank (real text, torch 2.13):
#   "  exitcode  : 2 (pid: 7245)"   and the agent's line "failed (exitcode: 2) local_rank: 0 (pid: 7245)"
_EXITCODE_LINE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid", re.M)
_AGENT_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+")
# The job's own refusal (training/__main__.py prints SpecError: a header, then one "  - " line per problem).
_REFUSAL_HEADER = re.compile(r"ulysses-train: (.*)")
_PROBLEM_LINE = re.compile(r"^\s*- (.+)$")
MAX_PROBLEM_LINES = 40


class DiskRun(BudgetRun, Lifecycle, Protocol):
    """What the disk-full and read-only handling uses of the run (and the budget's `BudgetRun`)."""


def rank_exit_codes(log_text: str) -> list[int]:
    """Each failed rank's own exit code as torchrun reports it (torchrun itself exits 1)."""
    codes = [int(m.group(1)) for m in _EXITCODE_LINE.finditer(log_text)]
    return codes or [int(m.group(1)) for m in _AGENT_LINE.finditer(log_text)]


def refusal_lines(log_text: str) -> list[str]:
    """The job's refusal message lines (header and problems), each once although every rank printed them."""
    out: list[str] = []
    in_block = False
    for line in log_text.splitlines():
        m = _REFUSAL_HEADER.search(line)
        if m:
            text, in_block = m.group(0).strip(), True
        elif in_block and _PROBLEM_LINE.match(line):
            text = line.strip()
        else:
            in_block = False
            continue
        if text not in out:
            out.append(text)
        if len(out) >= MAX_PROBLEM_LINES:
            break
    return out


def errno_of(exc: BaseException) -> str | None:
    """`ENOSPC`/`EDQUOT`/`EROFS` for an OSError of that kind (also wrapped as a cause), else None."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 5:
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return errno.errorcode[e.errno]
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def storage_errno(save_failure: dict[str, Any] | None, diag_label: str | None, ckpt_dir: Path) -> str | None:
    """The storage errno behind an attempt's end: the job's event first, the log's label second, the
    filesystem third (a read-only remount shows in statvfs even when the job could not say so)."""
    if save_failure and isinstance(save_failure.get("errno"), str) and save_failure["errno"] != "unknown":
        return str(save_failure["errno"])
    from ulyssesd.training.checkpoint import filesystem_errno

    if filesystem_errno(ckpt_dir) == errno.EROFS:
        return READ_ONLY
    if diag_label == "disk_full":
        return "ENOSPC"
    return None


#: At least this much free space (and twice what the checkpoint directory holds) and a save's failure was not a
#: full disk, whatever a low-confidence reading of the log said.
PLENTY_FREE_BYTES = 1 << 30
_MAX_WALK = 20_000  # entries of the checkpoint directory summed at most (a bounded look, not a du of a huge tree)


def space_refutes(diag_label: str | None, confidence: str | None, save_failure: dict[str, Any] | None,
                  ckpt_dir: Path) -> str | None:
    """Evidence line when the OS says a `disk_full` read from the log at less than high confidence (the save
    context, no space message) is wrong: the checkpoint filesystem's free space is readable and large (at least
    PLENTY_FREE_BYTES and twice all the checkpoints held: the failed save would have fit even if its partial
    file was freed after the crash). None when there is nothing to refute or the OS cannot say."""
    import os
    import shutil

    if diag_label != "disk_full" or confidence == "high" or (save_failure or {}).get("errno") in NO_SPACE:
        return None
    where = ckpt_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return None
    held, seen = 0, 0
    for root, _dirs, files in os.walk(ckpt_dir):
        for name in files:
            seen += 1
            try:
                held += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
        if seen > _MAX_WALK:
            return None  # too large to size within the bound: the OS cannot say here
    if free < max(PLENTY_FREE_BYTES, 2 * held):
        return None
    return (f"not a full disk: {free / 1e9:.1f} GB free on the filesystem of {where} (checkpoints there hold "
            f"{held / 1e9:.2f} GB): the checkpoint save failed for another reason")


@dataclass
class PruneOutcome:
    """What making room after a failed save did: removed entries, bytes they held, bytes available after,
    what the next save needs, the tags kept, and how many tags the disk can hold."""

    removed: list[str]
    freed_bytes: int
    free_bytes: int | None
    need_bytes: int
    newest_valid: str | None
    newest_known_good: str | None = None
    tags_fit: int | None = None
    held_bytes: int = 0  # removed but not freed (still open or mapped by a process)

    @property
    def enough(self) -> bool:
        """The newest valid tag plus the next save fit (the free space is unknown: something was freed)."""
        if self.free_bytes is None:
            return self.freed_bytes > 0
        return self.free_bytes >= self.need_bytes


def _reading_trusted(failure: dict[str, Any] | None, need: int) -> bool:
    """statvfs's free bytes tell whether the next save fits, unless the failure says otherwise: a quota
    (EDQUOT) does not show in statvfs, nor does a limit below the filesystem's (the write failed with room)."""
    if not failure:
        return True
    if failure.get("errno") == "EDQUOT":
        return False
    free_then = failure.get("bytes_free")
    return not (isinstance(free_then, int) and free_then >= need)


def prune_for_space(sup: DiskRun, failure: dict[str, Any] | None = None) -> PruneOutcome:
    """Make room for the next save after a failed one (the job has exited), in the budget's stated order:
    the failed save's partial and what retention removes anyway, set-aside copies oldest first, anchors beyond
    the newest known-good, the keep_last window down to the newest valid (training/checkpoint/budget.py)."""
    from ulyssesd.daemon.host import disk_budget
    from ulyssesd.training import checkpoint as ck
    from ulyssesd.training.checkpoint import budget as bd

    budget = disk_budget.classify_run(sup)
    tag = disk_budget.next_save_bytes(budget, disk_budget.run_predicted_bytes(sup))
    need = (tag or MIN_FREE_BYTES) + budget.policy.margin_bytes  # unknown size: at least "not nearly full"
    if _reading_trusted(failure, need):
        available = None  # the filesystem's own reading after each removal
    else:
        start = int((failure or {}).get("bytes_free") or 0) if (failure or {}).get("errno") != "EDQUOT" else 0
        available = lambda freed: min(start + freed, ck.bytes_free(budget.root) or 0)  # noqa: E731
    # The failed save's partial and the entries retention dooms go whatever the reading says.
    first = [e for e in bd.room_order(budget, include_in_flight=True) if e.doomed or e.category == "in_flight"]
    removed, freed = [], 0
    for e in first:
        if bd._remove(budget.root, e.name):
            removed.append(e.name)
            freed += e.bytes
    budget = disk_budget.classify_run(sup)
    avail = None if available is None else (lambda f: available(freed + f))  # noqa: E731
    room = bd.make_room(budget, need, include_in_flight=True, available=avail)
    removed += room.removed
    freed += room.freed_bytes
    for tag_name in removed:
        log.info("checkpoint removed for space", tag=tag_name)
    disk_budget.mark_pruned(sup, removed)
    fit = bd.tags_that_fit(room.available_bytes or 0, room.kept_bytes, tag, budget.policy.margin_bytes) \
        if room.available_bytes is not None else None
    return PruneOutcome(removed, freed, room.available_bytes, need, room.newest_valid, room.newest_known_good, fit,
                        room.held_bytes)


def resume_after_no_space(sup: DiskRun, iid: int, failure: dict[str, Any] | None) -> bool:
    """The disk_full rung: make room, record what was freed, lengthen the save interval when the disk holds fewer
    tags than configured, and say whether the next attempt can save. False only when the disk cannot hold the
    newest valid tag plus one more: the incident is closed failed and the run FAILED, never a loop."""
    from ulyssesd.daemon.host import disk_budget

    out = prune_for_space(sup, failure)
    params: dict[str, Any] = {
        "rung": "prune_and_restart", "removed": out.removed, "bytes_freed": out.freed_bytes,
        "bytes_free_after": out.free_bytes, "next_save_needs_bytes": out.need_bytes,
        "kept_newest_valid": out.newest_valid, "kept_newest_known_good": out.newest_known_good,
        "tags_fit": out.tags_fit, "held_bytes": out.held_bytes, "failed_save": failure}
    diff: dict[str, Any] = {}
    from_v = sup.config_version
    if out.enough:
        keep = int(jc.get_dotted(sup.config, "checkpoint.keep_last", 3) or 3)
        base = _base_interval(sup)
        longer = disk_budget.interval_for(base, out.tags_fit, keep) if base else None
        if longer is not None and longer != jc.get_dotted(sup.config, "checkpoint.interval_steps"):
            _, diff = sup.new_config_version(
                {"checkpoint.interval_steps": longer},
                f"checkpoint disk holds {out.tags_fit} tags, keep_last {keep} + 1 configured: save every "
                f"{longer} steps instead of {base}")
            params["interval_steps"] = longer
    sup.incidents.action(iid, ActionKind.prune, params, diff, ApplyMode.none, from_v, sup.config_version)
    msg = (f"disk full: removed {len(out.removed)} ({', '.join(out.removed) or 'none'}), {out.freed_bytes} bytes "
           f"freed, {out.free_bytes} available, the next save needs ~{out.need_bytes}"
           + (f"; the disk holds {out.tags_fit} tags" if out.tags_fit is not None else "")
           + (f"; saves every {params['interval_steps']} steps now" if "interval_steps" in params else ""))
    sup.say(f"  {msg}")
    if out.enough:
        if out.removed or diff:
            sup.alert("incident", f"checkpoint {msg}", **{k: params[k] for k in ("bytes_freed", "bytes_free_after",
                                                                                 "next_save_needs_bytes", "tags_fit")})
        return True
    kept = " and ".join(t for t in dict.fromkeys([out.newest_valid, out.newest_known_good]) if t)
    reason = (f"disk full: {checkpoint_root(sup)} cannot hold the newest valid tag plus one more: everything else was "
              f"removed (kept {kept or 'nothing: no valid tag'}), {out.free_bytes} bytes are available and the "
              f"next save needs ~{out.need_bytes} (one tag + daemon.min_free_gib): free space on that filesystem "
              f"or set checkpoint.dir to a larger one, then start the run again")
    sup.incidents.stopped(iid, reason)
    sup.fail(reason)
    return False


def _base_interval(sup: DiskRun) -> int | None:
    """The run's own save interval (its first config version's): a lengthened one is never lengthened again."""
    try:
        first = sup.store.list_config_versions(sup.run_id)[0].config
    except (IndexError, AttributeError, LookupError):
        first = sup.config
    value = jc.get_dotted(first, "checkpoint.interval_steps")
    return value if isinstance(value, int) and value > 0 else None


#: The evidence key of a skipped-save incident (one per episode: open from the first skip to the next save).
SKIP_EVIDENCE = "checkpoint_skipped"
# Runs (per store object) known to have no open skipped-save episode: only `save_skipped` opens one, so a written
# save asks the store nothing until then (one incident query per save was a tick's cost: docs/SIMULATION.md).
_no_episode: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_SKIP_COUNT = re.compile(r"^(\d+) saves? skipped")


def open_skip_episode(sup: DiskRun) -> Any | None:
    """The run's open skipped-save incident (the episode in progress), or None."""
    for inc in sup.store.list_incidents(sup.run_id, symptom=Symptom.disk_full, status=IncidentStatus.open,
                                        newest_first=True):
        if SKIP_EVIDENCE in (inc.evidence or {}):
            return inc
    return None


def _skips_of(episode: Any) -> int:
    """The episode's skips so far: kept in its status reason (the store's, so a restarted daemon counts on)."""
    m = _SKIP_COUNT.match(episode.status_reason or "")
    return int(m.group(1)) if m else 1


def _episode_reason(count: int, fields: dict[str, Any], step: int) -> str:
    return (f"{count} save{'s' if count != 1 else ''} skipped so far, the last {fields.get('tag')} at step {step} "
            f"(needs ~{fields.get('need_bytes')} bytes, {fields.get('available_bytes')} available); open until a "
            f"save is written again")


def save_skipped(sup: DiskRun, step: int, fields: dict[str, Any]) -> None:
    """The job skipped a save for lack of space (its `checkpoint_skipped` event): training goes on. One open
    `disk_full` incident per episode: the first skip opens it (with the numbers, an alert), later skips only
    update its count and last numbers (status reason, log), and the next written save resolves it
    (`save_written`). A disk that stays full is one incident, not one per save."""
    need, avail = fields.get("need_bytes"), fields.get("available_bytes")
    log.warning("checkpoint skipped for lack of space", tag=fields.get("tag"), need=need, available=avail)
    _no_episode.get(sup.store, set()).discard(sup.run_id)
    episode = open_skip_episode(sup)
    if episode is not None:
        count = _skips_of(episode) + 1
        sup.store.update_incident_status(episode.id, IncidentStatus.open, _episode_reason(count, fields, step))
        sup.say(f"  checkpoint {fields.get('tag')} skipped for lack of space too ({count} in a row; incident "
                f"#{episode.id})")
        return
    text = (f"checkpoint {fields.get('tag')} skipped for lack of space: needs ~{need} bytes, {avail} available in "
            f"{checkpoint_root(sup)} after removing {len(fields.get('removed') or [])} entries; training goes on")
    iid = sup.incidents.incident(Symptom.disk_full, step, Severity.warning, text, {SKIP_EVIDENCE: fields})
    sup.store.update_incident_status(iid, IncidentStatus.open, _episode_reason(1, fields, step))
    sup.say(f"WARNING: {text}")
    sup.alert("incident", text, need_bytes=need, available_bytes=avail)


def save_written(sup: DiskRun, tag: str, step: int) -> None:
    """A save was written: the skipped-save episode in progress (if any) is resolved, saying how many saves it
    skipped."""
    known_none = _no_episode.setdefault(sup.store, set())
    episode = None if sup.run_id in known_none else open_skip_episode(sup)
    known_none.add(sup.run_id)
    if episode is None:
        return
    count = _skips_of(episode)
    text = f"checkpoint {tag} written at step {step} after {count} skipped save{'s' if count != 1 else ''}"
    sup.store.update_incident_status(episode.id, IncidentStatus.resolved, text)
    log.info("checkpoint disk has room again", incident=episode.id, tag=tag, skipped=count)
    sup.say(f"  {text}: incident #{episode.id} resolved")


def stop_read_only(sup: DiskRun, where: str, evidence: dict[str, Any], iid: int | None = None) -> None:
    """A read-only filesystem: nothing a relaunch or a prune can fix, and nothing may be deleted."""
    reason = f"{READ_ONLY_REASON} ({where}); nothing was deleted: remount it read-write, then start the run again"
    if iid is None:
        iid = sup.incidents.incident(Symptom.crash, sup.last_step or 0, Severity.critical, reason,
                            {**evidence, "errno": READ_ONLY})
    sup.incidents.stopped(iid, reason)
    sup.fail(reason)
