"""Which checkpoint the next attempt resumes from: validate tags newest -> oldest, quarantine bad ones,
and on a rollback set aside the tags after the rollback point (renamed, never deleted: evidence)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ulyssesd.daemon.host.logging import get_logger

log = get_logger("ulyssesd.supervisor")


def choose_checkpoint(ckpt_dir: Path, rollback_to_step: int | None, *, verify: bool, verify_max_gib: float,
                      store: Any, run_id: str, clock: Callable[[], float],
                      say: Callable[[str], None]) -> tuple[str, list[str]]:
    """Validate tags newest -> oldest, quarantine bad ones; return (tag or "none", notes).

    `verify`: checksum verification (checkpoint.verify_checksums), skipped for tags over `verify_max_gib`;
    invalid and set-aside tags are recorded in `store` for `run_id`."""
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

    def first_valid(candidates: list[str]) -> str | None:
        for tag in candidates:
            gib_ok = tag_gib(ckpt_dir, tag) <= verify_max_gib
            ok, reason = ck.validate_tag(ckpt_dir / tag, verify and gib_ok)
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
        for t in ck.list_tags(ckpt_dir):
            if (ck.step_of_tag(t) or 0) > (limit or 0):
                target = ckpt_dir / f"{t}.rolledback-{int(clock())}"
                os.rename(ckpt_dir / t, target)
                log.info("checkpoint set aside", tag=t, to=target.name)
                say(f"  {t} set aside as {target.name} (after the rollback point)")
                store.upsert_checkpoint(run_id, t, step=ck.step_of_tag(t) or 0, valid=False,
                                        invalid_reason=f"rolled back past it (to step {limit})")
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
    try:
        files = json.loads((ckpt_dir / tag / "manifest.json").read_text()).get("files", {})
        return sum(int(f.get("size", 0)) for f in files.values()) / (1 << 30)
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):  # a damaged manifest: size unknown
        return 0.0
