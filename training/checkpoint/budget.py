"""The checkpoint directory's one budget: every entry in a named category with its bytes, what routine
retention removes, the order a save that does not fit makes room in, and how many tags a filesystem can hold.

Categories (docs/CHECKPOINT_DISK.md):

    newest_valid  the newest tag with a valid manifest: never removed
    rollback_target  the tag a decided rollback will load (rollback_guard.py): never removed while it is pending
    tainted       valid tags saved at or after a pending rollback's onset: never the newest valid, never removed
    keep_last     the other valid tags of the `keep_last` window
    anchor        known-good tags kept outside the window for rollbacks: at most `max_anchors`, spaced at least
                  `anchor_spacing_steps` apart; the newest known-good one is never removed
    in_flight     tags newer than the newest valid one without a valid manifest (a save being written; once
                  its job has exited, the failed save's partial)
    set_aside     copies kept for forensics: rolled back (`*.rolledback-<time>`), quarantined (`*.corrupt-<time>`),
                  and partial tags older than the newest valid one; capped in count and bytes, the first to go
    surplus       valid tags outside the window that are not a kept anchor (routine retention removes them)
    deleting      `.deleting-*` leftovers of an interrupted removal
    other         anything else (`latest`, foreign files): counted, never touched

Stdlib only: the daemon, `ulyssesctl` and the job import it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..durable import atomic_write_text
from .entries import SET_ASIDE_ANY_RE, SET_ASIDE_RE, Recogniser, entry_kind
from .files import DELETING_PREFIX, MANIFEST_NAME, step_of_tag
from .retention import held_entries, remove_dir, tree_bytes
from .rollback_guard import PendingRollback, holds, read_pending

CATEGORIES = ("newest_valid", "rollback_target", "keep_last", "anchor", "in_flight", "tainted", "set_aside", "surplus",
              "deleting", "other")
#: Tags kept for the run to go on from (what the directory holds besides the next save and set-aside copies).
KEPT = ("newest_valid", "rollback_target", "keep_last", "anchor")
#: The file the daemon publishes its budget in ({run_dir}/checkpoint_budget.json), read by the job before a save.
BUDGET_FILE = "checkpoint_budget.json"
#: The fewest tags a run can go on with: the newest valid one plus room for the next save.
MIN_TAGS = 2
#: Bytes per parameter of a ZeRO-3 tag: fp32 master + Adam m, v (gpt-1b: 16,969,339,735 B for 1,414,105,088
#: params, 12.0 B/param; the model-states file with no weights under ZeRO-3 is ~55 KB).
TAG_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class BudgetPolicy:
    """What the checkpoint directory may hold (the run's `[checkpoint] keep_last` and `[daemon]` budget settings)."""

    keep_last: int = 3                      # valid tags kept, the newest included
    max_anchors: int = 2                    # known-good tags kept outside the window, the newest known-good first
    anchor_spacing_steps: int = 0           # two kept anchors are at least this many steps apart (0: any)
    set_aside_keep: int = 1                 # set-aside copies kept, newest first
    set_aside_max_bytes: int | None = None  # ... and at most this many bytes of them (None: the count decides)
    margin_bytes: int = 0                   # free space a save must leave on the filesystem

    def __post_init__(self) -> None:
        problems = []
        if self.keep_last < 1:
            problems.append(f"keep_last={self.keep_last}: keep at least the newest valid tag (>= 1)")
        if self.max_anchors < 1:
            problems.append(f"max_anchors={self.max_anchors}: the newest known-good tag is always kept (>= 1)")
        if self.anchor_spacing_steps < 0 or self.set_aside_keep < 0 or self.margin_bytes < 0:
            problems.append("anchor_spacing_steps, set_aside_keep and margin_bytes must be >= 0")
        if self.set_aside_max_bytes is not None and self.set_aside_max_bytes < 0:
            problems.append(f"set_aside_max_bytes={self.set_aside_max_bytes} must be >= 0 (or None: one tag)")
        if problems:
            raise ValueError("checkpoint budget: " + "; ".join(problems))

    @property
    def tag_slots(self) -> int:
        """Tags the settings imply at the peak: the window, the anchors, and the save in flight."""
        return self.keep_last + self.max_anchors + 1

    def set_aside_cap(self, tag_bytes: int) -> int:
        """Bytes of set-aside copies budgeted: `set_aside_max_bytes`, or `set_aside_keep` tags' worth."""
        by_count = self.set_aside_keep * tag_bytes
        return by_count if self.set_aside_max_bytes is None else min(by_count, self.set_aside_max_bytes)

    def budget_bytes(self, tag_bytes: int) -> int:
        """Bytes the settings may put in the directory (tags at `tag_bytes` each, the set-aside cap) + the margin."""
        return self.tag_slots * tag_bytes + self.set_aside_cap(tag_bytes) + self.margin_bytes


@dataclass
class Entry:
    """One directory entry and the category it belongs to; `doomed`: routine retention removes it."""

    name: str
    category: str
    step: int | None
    bytes: int
    mtime: float
    doomed: bool = False


@dataclass
class DirBudget:
    """The checkpoint directory by category (see the module doc), with the free space left."""

    root: Path
    policy: BudgetPolicy
    entries: list[Entry]
    free_bytes: int | None
    newest_valid: str | None
    newest_known_good: str | None
    tag_bytes: int  # what the next save needs: the newest valid tag's bytes (0 when there is none)
    rollback_target: str | None = None  # the tag a pending rollback will load (never removed)

    def by_category(self) -> dict[str, dict[str, int]]:
        out = {c: {"count": 0, "bytes": 0} for c in CATEGORIES}
        for e in self.entries:
            out[e.category]["count"] += 1
            out[e.category]["bytes"] += e.bytes
        return out

    def by_name(self) -> dict[str, Entry]:
        return {e.name: e for e in self.entries}

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

    def doomed(self) -> list[Entry]:
        return [e for e in self.entries if e.doomed]

    def to_dict(self) -> dict[str, Any]:
        return {"dir": str(self.root), "free_bytes": self.free_bytes, "total_bytes": self.total_bytes,
                "tag_bytes": self.tag_bytes, "budget_bytes": self.policy.budget_bytes(self.tag_bytes),
                "newest_valid": self.newest_valid, "newest_known_good": self.newest_known_good,
                "categories": self.by_category(),
                "set_aside": [e.name for e in self.entries if e.category == "set_aside"],
                "policy": asdict(self.policy)}


def free_bytes(path: Path) -> int | None:
    """The filesystem's free bytes, read through the package (`ck.bytes_free`: the seam tests replace)."""
    from ulyssesd.training import checkpoint as ck

    return ck.bytes_free(path)


def select_anchors(known_good_steps: Iterable[int], max_anchors: int, spacing: int) -> list[int]:
    """Known-good steps kept as anchors, newest first: the newest always, then each older one at least
    `spacing` steps below the last kept, until `max_anchors`. Pure."""
    kept: list[int] = []
    for s in sorted(set(known_good_steps), reverse=True):
        if len(kept) >= max_anchors:
            break
        if not kept or kept[-1] - s >= spacing:
            kept.append(s)
    return kept


def set_aside_time(name: str, mtime: float) -> float:
    """When a set-aside copy was set aside (Unix seconds), from its name's `<time>` (SET_ASIDE_RE), else `mtime`."""
    m = SET_ASIDE_RE.match(name) or SET_ASIDE_ANY_RE.match(name)
    if not m:
        return mtime
    stamp = m.group(3)
    if stamp.isdigit():
        return float(stamp)
    return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()


def classify(ckpt_dir: str | Path, policy: BudgetPolicy, known_good: Iterable[str] = (),
             free: Callable[[Path], int | None] = free_bytes, recognise: Recogniser | None = None,
             pending: PendingRollback | None = None) -> DirBudget:
    """Every entry of `ckpt_dir` in its category (module doc); `known_good`: tag names followed by a clean
    window (the daemon's store). Validity is judged on sizes (no checksums): cheap enough to run at every save.
    `recognise`: what a checkpoint is in a command job's own naming (files too); default the built-in's tags.
    `pending`: a decided rollback (rollback_guard.py): its target is kept, the tags after its onset are tainted."""
    root = Path(ckpt_dir)
    entries: list[Entry] = []
    if not root.is_dir():
        return DirBudget(root, policy, [], free(root), None, None, 0)
    tags: list[tuple[int, str, bool, int, float]] = []
    for p in root.iterdir():
        try:
            st = p.lstat()
        except OSError:
            continue  # removed meanwhile
        size = tree_bytes(p) if p.is_dir() and not p.is_symlink() else st.st_size
        kind = entry_kind(p, recognise)
        if kind is not None and not kind.set_aside and kind.step is not None:
            tags.append((kind.step, p.name, kind.complete, size, st.st_mtime))
        elif kind is not None:
            entries.append(Entry(p.name, "set_aside", kind.step, size, st.st_mtime))
        elif p.name.startswith(DELETING_PREFIX):
            entries.append(Entry(p.name, "deleting", None, size, st.st_mtime, doomed=True))
        else:
            entries.append(Entry(p.name, "other", None, size, st.st_mtime))
    tags.sort()
    tainted, target = holds([(t[0], t[1]) for t in tags if t[2]], pending)
    valid = [t for t in tags if t[2] and t[1] not in tainted]
    newest = valid[-1] if valid else None
    window = {t[1] for t in valid[-policy.keep_last:]}
    kg_names = {Path(k).name for k in known_good}
    kg_steps = [t[0] for t in valid if t[1] in kg_names]
    anchors = set(select_anchors(kg_steps, policy.max_anchors, policy.anchor_spacing_steps))
    newest_kg = next((t[1] for t in reversed(valid) if t[1] in kg_names), None)
    for step, name, ok, size, mtime in tags:
        if name == target or name in tainted:
            cat = "rollback_target" if name == target else "tainted"
        elif ok:
            cat = ("newest_valid" if newest and name == newest[1] else "keep_last" if name in window
                   else "anchor" if step in anchors else "surplus")
        else:
            cat = "in_flight" if newest is None or step > newest[0] else "set_aside"
        entries.append(Entry(name, cat, step, size, mtime, doomed=cat == "surplus"))
    tag_bytes = newest[3] if newest else 0
    # Set-aside copies over their caps go, oldest first (the newest are the likeliest to be asked about).
    cap, kept_n, kept_b = policy.set_aside_max_bytes, 0, 0
    for e in sorted((e for e in entries if e.category == "set_aside"), key=lambda e: set_aside_time(e.name, e.mtime),
                    reverse=True):
        if kept_n < policy.set_aside_keep and (cap is None or kept_b + e.bytes <= cap):
            kept_n, kept_b = kept_n + 1, kept_b + e.bytes
        else:
            e.doomed = True
    return DirBudget(root, policy, entries, free(root), newest[1] if newest else None, newest_kg, tag_bytes, target)


def _remove(root: Path, name: str) -> bool:
    """Remove one entry; False when it was already gone (another remover: the daemon and the job both prune)."""
    p = root / name
    try:
        if name.startswith(DELETING_PREFIX):
            shutil.rmtree(p, ignore_errors=True)  # the other remover may be deleting it too
        elif p.is_dir():
            remove_dir(p)
        else:
            p.unlink()
    except FileNotFoundError:
        return False
    return True


def apply_retention(budget: DirBudget) -> list[Entry]:
    """Routine retention: remove the entries the budget dooms (surplus tags, set-aside copies over their caps,
    `.deleting-*` leftovers). Returns what was removed."""
    removed = []
    for e in budget.doomed():
        if _remove(budget.root, e.name):
            removed.append(e)
    return removed


@dataclass
class RoomOutcome:
    """What making room for a save did, and whether the save now fits."""

    need_bytes: int
    removed: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    available_bytes: int | None = None
    newest_valid: str | None = None
    newest_known_good: str | None = None
    kept_bytes: int = 0  # bytes of the tags that remain (what the directory holds besides the next save)
    #: bytes removed that did not come back as free space: a process still has the file open or mapped (a job
    #: resumed from that tag, CPU tensors loaded with mmap), or the filesystem frees late; more had to go instead
    held_bytes: int = 0
    skipped_held: list[str] = field(default_factory=list)  # left alone: a process maps a file of theirs
    #: with `only_if_it_fits`: the most that removing every candidate could make available (None: not asked)
    reachable_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.available_bytes >= self.need_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"need_bytes": self.need_bytes, "removed": self.removed, "freed_bytes": self.freed_bytes,
                "available_bytes": self.available_bytes, "fits": self.fits, "newest_valid": self.newest_valid,
                "newest_known_good": self.newest_known_good, "held_bytes": self.held_bytes,
                "skipped_held": self.skipped_held}


def room_order(budget: DirBudget, include_in_flight: bool) -> list[Entry]:
    """The stated order a save that does not fit makes room in: what routine retention would remove; the failed
    save's partial (`include_in_flight`: only once its job has exited); set-aside copies oldest first; anchors
    beyond the newest known-good, oldest first; the keep_last window oldest first, down to the newest valid.
    Never the newest valid tag, the newest known-good one, a pending rollback's target nor a tainted tag (after
    its onset: the relaunch sets it aside, evidence kept; a save with no room waits, it never deletes one)."""
    protected = {budget.newest_valid, budget.newest_known_good, budget.rollback_target}
    by_step = sorted((e for e in budget.entries if e.name not in protected),
                     key=lambda e: (e.step if e.step is not None else -1, e.mtime))
    order = [e for e in budget.entries if e.doomed and e.category != "set_aside"]
    if include_in_flight:
        order += [e for e in by_step if e.category == "in_flight"]
    order += sorted((e for e in budget.entries if e.category == "set_aside"),
                    key=lambda e: set_aside_time(e.name, e.mtime))
    order += [e for e in by_step if e.category == "anchor"]
    order += [e for e in by_step if e.category == "keep_last"]
    seen: set[str] = set()
    return [e for e in order if not (e.name in seen or seen.add(e.name))]  # type: ignore[func-returns-value]


def make_room(budget: DirBudget, need_bytes: int, *, include_in_flight: bool = False,
              available: Callable[[int], int | None] | None = None, only_if_it_fits: bool = False) -> RoomOutcome:
    """Remove entries in `room_order` until `available(freed so far)` >= need_bytes (by default the filesystem's
    free bytes; a caller that cannot trust that reading, e.g. after EDQUOT, counts what it freed instead).
    Entries a process still maps are left alone (`held_entries`): removing them would free nothing now.
    `only_if_it_fits`: remove nothing when even removing every candidate could not make the room (a save that
    cannot fit anyway is skipped with the directory as it was; `reachable_bytes` says how far it could go)."""
    root = budget.root
    avail = available or (lambda _freed: free_bytes(root))
    out = RoomOutcome(need_bytes, newest_valid=budget.newest_valid, newest_known_good=budget.newest_known_good)
    out.available_bytes = avail(0)
    held = held_entries(root) if not out.fits else set()
    order = room_order(budget, include_in_flight)
    if only_if_it_fits and not out.fits:
        removable = sum(e.bytes for e in order if e.name not in held)
        # An upper bound for any `available`: no removal adds more than its own bytes to the reading.
        out.reachable_bytes = (out.available_bytes or 0) + removable
        if out.reachable_bytes < need_bytes:
            out.skipped_held = [e.name for e in order if e.name in held]
            out.kept_bytes = _kept_tag_bytes(budget, set())
            return out
    for e in order:
        if out.fits:
            break
        if e.name in held:
            out.skipped_held.append(e.name)
            continue
        before = out.available_bytes
        if _remove(root, e.name):
            out.removed.append(e.name)
            out.freed_bytes += e.bytes
        out.available_bytes = avail(out.freed_bytes)
        if e.name in out.removed[-1:] and before is not None and out.available_bytes is not None:
            out.held_bytes += max(0, e.bytes - (out.available_bytes - before))
    out.kept_bytes = _kept_tag_bytes(budget, set(out.removed))
    return out


def _kept_tag_bytes(budget: DirBudget, gone: set[str]) -> int:
    return sum(e.bytes for e in budget.entries if e.name not in gone and e.step is not None and e.category in KEPT)


def tags_that_fit(available_bytes: int, kept_tag_bytes: int, tag_bytes: int, margin_bytes: int = 0) -> int | None:
    """How many tags of `tag_bytes` the directory can hold: the free space (less the margin) plus what the tags
    kept there now hold. None when the tag size is unknown."""
    if tag_bytes <= 0:
        return None
    return max(0, (available_bytes - margin_bytes + kept_tag_bytes) // tag_bytes)


# ------------------------------------------------------------------------------- the published budget
def write_budget_file(run_dir: str | Path, policy: BudgetPolicy, known_good: Iterable[str],
                      predicted_tag_bytes: int = 0) -> None:
    """The daemon's budget for the job's own pre-save check (`read_budget_file`)."""
    atomic_write_text(Path(run_dir) / BUDGET_FILE, json.dumps(
        {"v": 1, "policy": asdict(policy), "known_good": sorted(set(known_good)),
         "predicted_tag_bytes": int(predicted_tag_bytes)}, indent=1))


def read_budget_file(run_dir: str | Path) -> tuple[BudgetPolicy, list[str], int] | None:
    """(policy, known-good tags, predicted tag bytes) the daemon published; None without a readable file."""
    try:
        raw = json.loads((Path(run_dir) / BUDGET_FILE).read_text())
        policy = BudgetPolicy(**raw["policy"])
        return policy, [str(t) for t in raw.get("known_good", [])], int(raw.get("predicted_tag_bytes") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def describe_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------ the job's check
#: How long a save that does not fit waits for the daemon's retention pass over the newest save (its budget file
#: rewritten) before it is skipped: steps can be shorter than the daemon's reaction to a save (issue 33: <= 2 s).
DAEMON_PASS_WAIT_S = 1.5


def room_for_save(ckpt_dir: str | Path, run_dir: str | Path, tag: str, keep_last: int, *, under_daemon: bool,
                  log: logging.Logger, predicted_bytes: int = 0, daemon_pass_wait_s: float = DAEMON_PASS_WAIT_S,
                  sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> dict[str, Any] | None:
    """`_room_once`; when the save does not fit under a daemon whose published budget predates the newest tag (its
    known-good list is stale: the job outran the daemon's pass after that save), wait up to `daemon_pass_wait_s`
    for the daemon to publish again, then check once more."""
    skip = _room_once(ckpt_dir, run_dir, tag, keep_last, under_daemon=under_daemon, log=log,
                      predicted_bytes=predicted_bytes)
    if skip is None or not under_daemon or daemon_pass_wait_s <= 0:
        return skip
    published_at = _mtime(Path(run_dir) / BUDGET_FILE)
    newest = newest_tag_mtime(Path(ckpt_dir))
    if published_at is None or newest is None or published_at >= newest:
        return skip
    deadline = clock() + daemon_pass_wait_s
    while clock() < deadline:
        sleep(0.05)
        if (_mtime(Path(run_dir) / BUDGET_FILE) or 0.0) > published_at:
            log.info("checkpoint %s did not fit; the daemon published its budget again: checking once more", tag)
            return _room_once(ckpt_dir, run_dir, tag, keep_last, under_daemon=under_daemon, log=log,
                              predicted_bytes=predicted_bytes)
    return skip


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def newest_tag_mtime(root: Path) -> float | None:
    """When the newest tag's manifest (written last, once its shards are durable) was written; None: none."""
    stamps = [_mtime(p / MANIFEST_NAME) for p in root.glob("step-*") if step_of_tag(p.name) is not None]
    return max((t for t in stamps if t is not None), default=None)


def _room_once(ckpt_dir: str | Path, run_dir: str | Path, tag: str, keep_last: int, *, under_daemon: bool,
               log: logging.Logger, predicted_bytes: int = 0) -> dict[str, Any] | None:
    """The job's check before every save, the first included (rank 0): None when the next tag plus the margin
    fits, after making room in `room_order`; else the fields of a `checkpoint_skipped` event. Under the daemon
    the policy, the known-good tags and the predicted tag size are the ones it publishes (BUDGET_FILE, written
    before it launches each attempt); without that file under a daemon only set-aside and surplus entries may go
    (the anchors are unknown here) and the margin is 0 (said in the log). The tag size is the newest valid tag's,
    else the daemon's prediction, else `predicted_bytes` (the job's own, from its model). Nothing is removed for
    a save that could not fit even with every candidate gone. A failure to look or remove is logged and the save
    goes ahead: a real failure of the write then says what it is."""
    root = Path(ckpt_dir)
    try:
        published = read_budget_file(run_dir)
        if published is None and under_daemon:
            log.warning("no readable %s in %s: checking checkpoint %s with keep_last %d and no margin, removing only "
                        "set-aside and surplus entries", BUDGET_FILE, run_dir, tag, keep_last)
        policy, known_good, predicted = published or (BudgetPolicy(keep_last=keep_last), [], 0)
        budget = classify(root, policy, known_good, pending=read_pending(run_dir))
        if budget.free_bytes is None:
            return None  # no reading (the directory's filesystem cannot be asked): the write says what happens
        tag_bytes = budget.tag_bytes or predicted or max(0, predicted_bytes)
        need = tag_bytes + policy.margin_bytes
        if need <= 0 or budget.free_bytes >= need:
            return None
        if published is None and under_daemon:
            budget.entries = [e for e in budget.entries if e.category in ("set_aside", "surplus", "deleting")]
        room = make_room(budget, need, include_in_flight=True, only_if_it_fits=True)
    except OSError as exc:
        log.warning("making room for checkpoint %s failed: %s", tag, exc)
        return None
    if room.removed:
        log.info("made room for checkpoint %s: removed %s%s", tag, ", ".join(room.removed),
                 f" ({room.held_bytes} bytes of them still held open, not freed)" if room.held_bytes > 4096 else "")
    if room.fits:
        return None
    return {"tag": tag, "reason": "no_space", "need_bytes": need, "available_bytes": room.available_bytes,
            "reachable_bytes": room.reachable_bytes, "tag_bytes": tag_bytes, "margin_bytes": policy.margin_bytes,
            "removed": room.removed, "held_bytes": room.held_bytes,
            "kept": [t for t in (room.newest_valid, room.newest_known_good) if t]}


def predicted_tag_bytes(engine: Any) -> int:
    """The first save's size before any tag exists: the model's parameters (ZeRO-3 keeps each one's full count
    in `ds_numel`) x the bytes a tag holds per parameter; 0 when it cannot be counted (no engine yet)."""
    try:
        params = engine.module.parameters()
        return TAG_BYTES_PER_PARAM * sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    except Exception:  # noqa: BLE001 - only a prediction: the budget file's or the tags' sizes come first
        return 0
