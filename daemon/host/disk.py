"""Storage trouble: a job whose checkpoint save failed (full disk, quota, read-only filesystem), the daemon's
own writes failing for the same reasons, and what torchrun says about each rank's exit code.

Sources, most reliable first: the job's `checkpoint_save_failed` event (errno name, tag, path, bytes free),
then the log's diagnosis label (`disk_full`), then the filesystem itself (statvfs: read-only flag).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, Severity, Symptom

if TYPE_CHECKING:
    from ulyssesd.daemon.supervisor import Supervisor

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


@dataclass
class PruneOutcome:
    """What pruning for space did: removed tags, bytes they held, free bytes after, what the next save needs."""

    removed: list[str]
    freed_bytes: int
    free_bytes: int | None
    need_bytes: int
    newest_valid: str | None

    @property
    def enough(self) -> bool:
        """The next save fits (it is about the newest tag's size), or the free space is unknown but
        something was freed."""
        if self.free_bytes is None:
            return self.freed_bytes > 0
        return self.free_bytes >= self.need_bytes


def prune_for_space(sup: Supervisor) -> PruneOutcome:
    """Remove checkpoints that are neither the newest valid tag nor a known-good anchor (store)."""
    from ulyssesd.training import checkpoint as ck

    anchors = [c.tag for c in sup.store.list_checkpoints(sup.run_id) if getattr(c, "known_good", False)]
    removed, freed, newest = ck.prune_for_space(sup.ckpt_dir, anchors)
    for tag in removed:
        log.info("checkpoint pruned for space", tag=tag)
        try:
            sup.store.mark_checkpoint_pruned(sup.run_id, tag)
        except LookupError:
            pass  # a partial tag (the failed save's) never had a row
    # The next save writes about what the newest tag holds; never less than "nearly full".
    need = max(ck.tag_bytes(sup.ckpt_dir / newest) if newest else 0, MIN_FREE_BYTES)
    return PruneOutcome(removed, freed, ck.bytes_free(sup.ckpt_dir), need, newest)


def resume_after_no_space(sup: Supervisor, iid: int, failure: dict[str, Any] | None) -> bool:
    """The disk_full rung: prune, record what was freed, and say whether the next attempt can save.
    False: the incident is closed failed and the run FAILED (nothing left to prune), never a loop."""
    out = prune_for_space(sup)
    params = {"rung": "prune_and_restart", "removed": out.removed, "bytes_freed": out.freed_bytes,
              "bytes_free_after": out.free_bytes, "next_save_needs_bytes": out.need_bytes,
              "kept_newest_valid": out.newest_valid, "failed_save": failure}
    sup.incidents.action(iid, ActionKind.prune, params, {}, ApplyMode.none)
    sup.say(f"  disk full: pruned {len(out.removed)} checkpoint(s) ({', '.join(out.removed) or 'none'}), "
            f"{out.freed_bytes} bytes freed, {out.free_bytes} free, next save needs ~{out.need_bytes}")
    if out.enough:
        return True
    reason = (f"disk full: nothing left to prune in {sup.ckpt_dir} (kept the newest valid tag "
              f"{out.newest_valid} and the known-good anchors); {out.free_bytes} bytes free, the next save "
              f"needs ~{out.need_bytes}: free space on that filesystem, then start the run again")
    sup.incidents.stopped(iid, reason)
    sup.fail(reason)
    return False


def stop_read_only(sup: Supervisor, where: str, evidence: dict[str, Any], iid: int | None = None) -> None:
    """A read-only filesystem: nothing a relaunch or a prune can fix, and nothing may be deleted."""
    reason = f"{READ_ONLY_REASON} ({where}); nothing was deleted: remount it read-write, then start the run again"
    if iid is None:
        iid = sup.incidents.incident(Symptom.crash, sup.last_step or 0, Severity.critical, reason,
                            {**evidence, "errno": READ_ONLY})
    sup.incidents.stopped(iid, reason)
    sup.fail(reason)
