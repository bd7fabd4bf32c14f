"""A decided rollback until its relaunch has chosen a tag: the tag it will load is kept, the tags saved at or after
the incident's onset are never used.

The daemon writes the record ({run_dir}/rollback_pending.json) before it stops the job for a rollback and removes
it once the relaunch has chosen its tag (the tags after that one are then set aside). Meanwhile the budget
(`budget.classify`, the daemon's retention and the job's room making) counts the target under `rollback_target`
(never removed, whatever `keep_last` says) and the tags at or after the onset under `tainted` (never the newest
valid, never in the window); the relaunch never resumes from a tainted tag (daemon/core/launch.py). Found on the
H100 (issue 38, r3): an exit save one step after a NaN became the newest tag, keep_last 1 deleted the pending
target, and the relaunch resumed from the poisoned tag. Stdlib only: the daemon, `ulyssesctl` and the job read it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from ..durable import atomic_write_text

log = logging.getLogger("ulyssesd.checkpoint")

#: The record's file in the run directory.
PENDING_FILE = "rollback_pending.json"


@dataclass(frozen=True)
class PendingRollback:
    """A rollback the daemon decided and has not relaunched yet."""

    onset_step: int                 # first step of the incident: a tag saved at or after it holds weights past it
    target_step: int                # the relaunch loads the newest valid tag at or before this step
    target_tag: str | None = None   # the tag the decision named (None: from the start)
    incident: int | None = None     # the incident the rollback handles

    def __post_init__(self) -> None:
        if self.target_step >= self.onset_step:
            raise ValueError(f"rollback target step {self.target_step} is not before the onset at step "
                             f"{self.onset_step}: a rollback goes to a checkpoint saved before the onset")

    def tainted(self, step: int | None) -> bool:
        """Whether a tag of `step` was saved at or after the onset (its weights went through it)."""
        return step is not None and step >= self.onset_step


def write_pending(run_dir: str | Path, pending: PendingRollback) -> None:
    atomic_write_text(Path(run_dir) / PENDING_FILE, json.dumps({"v": 1, **asdict(pending)}, indent=1))


def read_pending(run_dir: str | Path | None) -> PendingRollback | None:
    """The pending rollback, None when there is none. A record that cannot be read is said (log) and taken as none:
    the relaunch's own rule (no resume after the target) still holds."""
    if run_dir is None:
        return None
    path = Path(run_dir) / PENDING_FILE
    try:
        raw = json.loads(path.read_text())
        tag = raw.get("target_tag")
        inc = raw.get("incident")
        return PendingRollback(int(raw["onset_step"]), int(raw["target_step"]), None if tag is None else str(tag),
                               None if inc is None else int(inc))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("pending rollback record %s unreadable (%s): tags after the onset are not protected by it",
                    path, exc)
        return None


def clear_pending(run_dir: str | Path) -> None:
    """The relaunch chose its tag: the record is done (a missing one is fine)."""
    (Path(run_dir) / PENDING_FILE).unlink(missing_ok=True)


def holds(valid: list[tuple[int, str]], pending: PendingRollback | None) -> tuple[set[str], str | None]:
    """Of the valid tags (step, name): those tainted by the pending rollback, and the one its relaunch will load
    (the newest valid one at or before the target step that is not tainted; None: none on disk). Pure."""
    if pending is None:
        return set(), None
    tainted = {name for step, name in valid if pending.tainted(step)}
    older = [(step, name) for step, name in valid if step <= pending.target_step and name not in tainted]
    return tainted, (max(older)[1] if older else None)
