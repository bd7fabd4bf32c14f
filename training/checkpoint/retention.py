"""Checkpoint retention: which tags to keep (last K valid + anchors), pruning, the disk guard, the
known-good anchors a rollback needs, and pruning for space after a failed save. Never removes a quarantined tag.
"""

from __future__ import annotations

import bisect
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .files import (
    DELETING_PREFIX,
    QUARANTINE_RE,
    list_quarantined,
    list_tags,
    step_of_tag,
    tag_for_step,
    validate_tag,
)


# --------------------------------------------------------------------------------- retention
def anchor_set(anchors: Iterable[str | int]) -> set[str]:
    names = set()
    for a in anchors:
        names.add(tag_for_step(a) if isinstance(a, int) else Path(a).name)
    return names


def remove_dir(path: Path) -> None:
    # Rename first (atomic): a crash mid-delete leaves a `.deleting-*` dir that is not a tag, never a
    # half-deleted tag that still looks like one; those leftovers are removed on the next prune.
    doomed = path.with_name(f"{DELETING_PREFIX}{path.name}-{time.time_ns()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def cleanup_deleting(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(DELETING_PREFIX):
            shutil.rmtree(p, ignore_errors=True)


def retention_plan(tags: list[str], valid: set[str], keep_last: int, anchors: set[str]) -> list[str]:
    """Pure decision: which of `tags` (oldest first) to remove.

    Kept: the last `keep_last` valid tags, every anchor, the newest valid tag, and every tag newer than
    the newest valid one (it may be a save in progress). Removed: everything older than the oldest kept
    valid tag. With no valid tag nothing is removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    valid_in_order = [t for t in tags if t in valid]
    if not valid_in_order:
        return []
    window_start = step_of_tag(valid_in_order[-keep_last:][0])
    assert window_start is not None
    return [t for t in tags if step_of_tag(t) < window_start and t not in anchors]  # type: ignore[operator]


def prune(ckpt_dir: str | Path, keep_last: int, anchors: Iterable[str | int] = (), dry_run: bool = False,
          prune_quarantined: bool = False, verify_checksums: bool = False) -> list[str]:
    """Remove tags older than the last `keep_last` valid ones (see `retention_plan`). Returns removed names.

    Quarantined dirs older than the kept window go only with prune_quarantined=True. Validity is judged
    on sizes only unless verify_checksums=True.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    if not dry_run:
        cleanup_deleting(root)
    tags = list_tags(root)
    valid = {t for t in tags if validate_tag(root / t, verify_checksums)[0]}
    doomed = retention_plan(tags, valid, keep_last, anchor_set(anchors))
    if prune_quarantined and valid:
        window_start = step_of_tag([t for t in tags if t in valid][-keep_last:][0])
        for q in list_quarantined(root):
            m = QUARANTINE_RE.match(q)
            assert m is not None
            if step_of_tag(m.group(1)) < window_start:  # type: ignore[operator]
                doomed.append(q)
    if not dry_run:
        for name in doomed:
            remove_dir(root / name)
    return doomed


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _d, filenames in os.walk(path):
        for f in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def disk_guard(ckpt_dir: str | Path, min_free_bytes: int, keep_min: int = 1, anchors: Iterable[str | int] = (),
               usage: Callable[[str], Any] = shutil.disk_usage, dry_run: bool = False,
               verify_checksums: bool = False) -> list[str]:
    """Prune oldest non-anchor tags until `usage(ckpt_dir).free >= min_free_bytes`. Returns removed names.

    Order: invalid tags older than the newest valid one first, then valid tags oldest first while more
    than `keep_min` valid remain (anchors count as valid tags that remain). Never removes anchors, the newest valid tag, or anything newer than it.
    `usage` is shutil.disk_usage-compatible (injectable for tests). dry_run assumes each removal frees
    the tag's bytes.
    """
    if keep_min < 1:
        raise ValueError(f"keep_min must be >= 1, got {keep_min}")
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    anchor_names = anchor_set(anchors)
    tags = list_tags(root)
    valid = [t for t in tags if validate_tag(root / t, verify_checksums)[0]]
    if not valid:
        return []
    newest_valid = step_of_tag(valid[-1])
    older = [t for t in tags if step_of_tag(t) < newest_valid and t not in anchor_names]  # type: ignore[operator]
    order = [t for t in older if t not in valid] + [t for t in older if t in valid]
    valid_left = len(valid)
    removed: list[str] = []
    freed = 0
    for tag in order:
        if usage(str(root)).free + freed >= min_free_bytes:
            break
        if tag in valid:
            if valid_left <= keep_min:
                break
            valid_left -= 1
        if dry_run:
            freed += tree_bytes(root / tag)
        else:
            remove_dir(root / tag)
        removed.append(tag)
    return removed


# -------------------------------------------------------------------------------- known good
def known_good(tag_steps: Iterable[int], anomalous_steps: Iterable[int], window: int, last_step: int) -> list[int]:
    """Steps of tags followed by `window` observed anomaly-free steps (oldest first). Pure.

    A tag at step s is known good when steps s..s+window were all observed (last_step >= s + window) and
    none of them was anomalous. Step s itself counts: an anomaly at the saved step taints its weights.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    bad = sorted(set(anomalous_steps))
    out = []
    for s in sorted(set(tag_steps)):
        if s + window > last_step:
            continue
        k = bisect.bisect_left(bad, s)
        if k < len(bad) and bad[k] <= s + window:
            continue
        out.append(s)
    return out


def known_good_tags(tags: Iterable[str], anomalous_steps: Iterable[int], window: int, last_step: int) -> list[str]:
    """`known_good` over tag names (non-tag names ignored)."""
    by_step: dict[int, str] = {}
    for t in tags:
        step = step_of_tag(t)
        if step is not None:
            by_step[step] = Path(t).name
    return [by_step[s] for s in known_good(by_step, anomalous_steps, window, last_step)]


# ------------------------------------------------------------------------------- free space
def existing_ancestor(path: Path) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def bytes_free(path: str | Path) -> int | None:
    """Free bytes (for an unprivileged writer) on the filesystem holding `path` or its nearest existing parent."""
    try:
        st = os.statvfs(existing_ancestor(Path(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def tag_bytes(tag_dir: str | Path) -> int:
    """Bytes a tag directory holds on disk (every file, manifest or not)."""
    return tree_bytes(Path(tag_dir))


def prune_for_space(ckpt_dir: str | Path, anchors: Iterable[str | int] = (),
                    dry_run: bool = False) -> tuple[list[str], int, str | None]:
    """After a save failed for lack of space (the job has exited): remove every tag that is neither the
    newest valid one nor an anchor (known good, the rollback targets), including the partial tags newer than
    the newest valid one (the failed save's). Quarantined tags (evidence) are kept.

    Returns (removed names oldest first, bytes they held, the newest valid tag or None). With no valid tag
    nothing is removed: a partial tag may then be all that is left of the run."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return [], 0, None
    if not dry_run:
        cleanup_deleting(root)
    tags = list_tags(root)
    valid = [t for t in tags if validate_tag(root / t, verify_checksums=False)[0]]
    if not valid:
        return [], 0, None
    keep = {valid[-1]} | anchor_set(anchors)
    removed, freed = [], 0
    for tag in tags:
        if tag in keep:
            continue
        freed += tree_bytes(root / tag)
        if not dry_run:
            remove_dir(root / tag)
        removed.append(tag)
    return removed, freed, valid[-1]


def held_entries(root: Path, proc: Path = Path("/proc")) -> set[str]:
    """Entries of `root` with a file some process on this host has mapped or open (/proc/*/maps, /proc/*/fd):
    removing one frees nothing until that process lets go (a job resumed from a tag whose CPU tensors were
    loaded with mmap). Empty where /proc cannot be read."""
    prefix = str(root.resolve()) + os.sep
    held: set[str] = set()
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return held
    def add(path: str) -> None:
        i = path.find(prefix)
        if i >= 0:
            held.add(path[i + len(prefix):].split(os.sep, 1)[0].rstrip("\n"))

    for p in pids:
        try:
            with open(p / "maps", errors="replace") as fh:
                for line in fh:
                    add(line)
            for fd in (p / "fd").iterdir():
                add(os.readlink(fd))
        except OSError:
            continue  # gone, or not ours to read
    return held
