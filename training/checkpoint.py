"""File-level checkpoint library: manifests, validation, quarantine, `latest`, retention, disk guard.

Pure Python on the directories DeepSpeed writes (no engine calls), so the daemon can use it too:

    {ckpt_dir}/latest                      DeepSpeed's pointer (tag name, no newline)
    {ckpt_dir}/step-00000100/              one tag dir: mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt
    {ckpt_dir}/step-00000100/manifest.json written LAST and atomically: a tag without a valid manifest does
                                           not exist for resume (a crash mid-save leaves a partial dir)
    {ckpt_dir}/step-00000050.corrupt-1764444444   a quarantined tag (renamed, never deleted)

The manifest records every file's size and sha256, so truncation and bit flips are caught before
DeepSpeed loads (or half-loads) a bad tag. All ranks' files must be complete before rank 0 writes it
(barrier after `save_checkpoint`), and the directory must be visible to rank 0 (shared filesystem).
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .durable import atomic_write, atomic_write_text, fsync_dir

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"  # DeepSpeed's pointer file
MANIFEST_VERSION = 1
HASH_CHUNK = 8 << 20  # 8 MiB reads: few syscalls, bounded memory on multi-GB shards
_TAG_RE = re.compile(r"^step-(\d{8,})$")
_QUARANTINE_RE = re.compile(r"^(step-\d{8,})\.corrupt-\d+(?:-\d+)?$")
_DELETING_PREFIX = ".deleting-"
# hashlib releases the GIL on large updates, so threads hash several shards in parallel.
_HASH_WORKERS = max(1, min(8, os.cpu_count() or 1))


class ManifestError(ValueError):
    """A manifest is missing, unreadable or malformed."""


# ------------------------------------------------------------------------------------- tags
def tag_for_step(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def step_of_tag(tag: str) -> int | None:
    """Step of a tag name (`step-00000100` -> 100); None for anything else (quarantined, foreign)."""
    m = _TAG_RE.match(Path(tag).name)
    return int(m.group(1)) if m else None


def list_tags(ckpt_dir: str | Path) -> list[str]:
    """Tag directory names sorted by step (quarantined, temporary and foreign entries ignored)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and step_of_tag(p.name) is not None]
    return sorted(tags, key=lambda t: step_of_tag(t))  # type: ignore[arg-type,return-value]


def list_quarantined(ckpt_dir: str | Path) -> list[str]:
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _QUARANTINE_RE.match(p.name))


# ---------------------------------------------------------------------------------- hashing
def sha256_file(path: str | Path, chunk: int = HASH_CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _tag_files(tag_dir: Path) -> list[str]:
    """Relative paths of all regular files of a tag, except the manifest and its temp file."""
    out = []
    for dirpath, _dirnames, filenames in os.walk(tag_dir):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), tag_dir)
            if rel == MANIFEST_NAME or rel.startswith(f".{MANIFEST_NAME}."):
                continue
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _hash_many(tag_dir: Path, rels: list[str]) -> dict[str, str]:
    if len(rels) <= 1:
        return {r: sha256_file(tag_dir / r) for r in rels}
    with ThreadPoolExecutor(max_workers=min(_HASH_WORKERS, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda r: sha256_file(tag_dir / r), rels), strict=True))



def _json_float(x: float | None) -> float | str | None:
    # Same convention as telemetry: non-finite floats as strings, so the file stays strict JSON.
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


# --------------------------------------------------------------------------------- manifest
def write_manifest(tag_dir: str | Path, step: int, loss: float | None, samples_seen: int,
                   config_version: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash every file of the tag and write `manifest.json` atomically (tmp, fsync, rename, fsync dir).

    Call it LAST, after every rank's files are written. Returns the manifest.
    """
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint tag directory not found: {tag_dir}")
    named = step_of_tag(tag_dir.name)
    if named is not None and named != step:
        raise ValueError(f"step {step} does not match tag directory {tag_dir.name}")
    rels = _tag_files(tag_dir)
    if not rels:
        raise ValueError(f"checkpoint tag directory {tag_dir} holds no files to record")
    hashes = _hash_many(tag_dir, rels)
    files = {r: {"size": (tag_dir / r).stat().st_size, "sha256": hashes[r]} for r in rels}
    manifest = {
        "v": MANIFEST_VERSION,
        "tag": tag_dir.name,
        "step": int(step),
        "loss": _json_float(loss),
        "samples_seen": int(samples_seen),
        "config_version": config_version,
        "time": time.time(),
        "files": files,
        "extra": extra or {},
    }
    atomic_write_text(tag_dir / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def read_manifest(tag_dir: str | Path) -> dict[str, Any]:
    """The parsed manifest of a tag; ManifestError names what is wrong."""
    path = Path(tag_dir) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (partial or interrupted save?)") from None
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable manifest: {exc}") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: manifest is not valid JSON: {exc}") from None
    except (RecursionError, ValueError):  # hostile nesting, or an integer beyond Python's digit limit
        raise ManifestError(f"{path}: manifest is not valid JSON (nested too deeply or a number too long)") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: manifest must be a JSON object")
    for key in ("step", "files"):
        if key not in data:
            raise ManifestError(f"{path}: manifest lacks '{key}'")
    if not isinstance(data["step"], int) or isinstance(data["step"], bool):
        raise ManifestError(f"{path}: manifest 'step' must be an integer, got {type(data['step']).__name__}")
    files = data["files"]
    if not isinstance(files, dict) or not files:
        raise ManifestError(f"{path}: manifest 'files' must be a non-empty object")
    for rel, meta in files.items():
        if (not isinstance(meta, dict) or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)):
            raise ManifestError(f"{path}: manifest entry for {rel!r} needs integer 'size' and string 'sha256'")
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ManifestError(f"{path}: manifest entry {rel!r} points outside the tag directory")
    return data


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """Total bytes of the files a manifest lists (the `bytes` of a checkpoint_saved event)."""
    return sum(int(meta["size"]) for meta in manifest["files"].values())


def validate_tag(tag_dir: str | Path, verify_checksums: bool = True) -> tuple[bool, str]:
    """(True, "ok") or (False, reason naming the file). verify_checksums=False checks sizes only (fast)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return False, f"{tag_dir}: tag directory not found"
    try:
        manifest = read_manifest(tag_dir)
    except ManifestError as exc:
        return False, str(exc)
    named = step_of_tag(tag_dir.name)
    if named is not None and manifest["step"] != named:
        return False, f"{tag_dir / MANIFEST_NAME}: manifest step {manifest['step']} does not match tag {tag_dir.name}"
    files: dict[str, dict[str, Any]] = manifest["files"]
    for rel in sorted(files):
        path = tag_dir / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False, f"{path}: file listed in the manifest is missing"
        if size != files[rel]["size"]:
            return False, f"{path}: size {size} bytes, manifest says {files[rel]['size']} (truncated or rewritten)"
    if verify_checksums:
        rels = sorted(files)
        try:
            hashes = _hash_many(tag_dir, rels)
        except OSError as exc:
            return False, f"{tag_dir}: unreadable file while verifying checksums: {exc}"
        for rel in rels:
            if hashes[rel] != files[rel]["sha256"]:
                return False, (f"{tag_dir / rel}: sha256 {hashes[rel][:12]}… does not match the manifest's "
                               f"{files[rel]['sha256'][:12]}… (corrupted)")
    return True, "ok"


def list_valid_tags(ckpt_dir: str | Path, verify_checksums: bool = False) -> list[str]:
    """Tags with a valid manifest, oldest first. Sizes only by default (hashing every tag is slow)."""
    root = Path(ckpt_dir)
    return [t for t in list_tags(root) if validate_tag(root / t, verify_checksums)[0]]


def latest_valid_tag(ckpt_dir: str | Path, verify_checksums: bool = True,
                     on_invalid: Callable[[str, str], None] | None = None) -> str | None:
    """Newest tag that validates, scanning newest -> oldest; on_invalid(tag, reason) for each one skipped."""
    root = Path(ckpt_dir)
    for tag in reversed(list_tags(root)):
        ok, reason = validate_tag(root / tag, verify_checksums)
        if ok:
            return tag
        if on_invalid is not None:
            on_invalid(tag, reason)
    return None


def quarantine(tag_dir: str | Path) -> Path:
    """Rename a bad tag to `{tag}.corrupt-{unixtime}` (kept as evidence, never deleted). Returns the new path."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"cannot quarantine {tag_dir}: not a directory")
    base = f"{tag_dir.name}.corrupt-{int(time.time())}"
    target = tag_dir.with_name(base)
    n = 1
    while target.exists():
        target = tag_dir.with_name(f"{base}-{n}")
        n += 1
    os.rename(tag_dir, target)
    fsync_dir(tag_dir.parent)
    return target


def read_latest(ckpt_dir: str | Path) -> str | None:
    """The tag DeepSpeed's `latest` names, or None."""
    try:
        text = (Path(ckpt_dir) / LATEST_NAME).read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def point_latest_to(ckpt_dir: str | Path, tag: str) -> None:
    """Atomically rewrite DeepSpeed's `latest` to name `tag`.

    Needed before loading an explicit tag without optimizer states (upstream #8499 loads the weights of
    whatever `latest` names) and after a fallback, so DeepSpeed's own pointer never names a bad tag.
    """
    root = Path(ckpt_dir)
    if not (root / tag).is_dir():
        raise FileNotFoundError(f"cannot point latest to {tag}: {root / tag} does not exist")
    atomic_write_text(root / LATEST_NAME, tag)  # DeepSpeed writes the bare tag and strips on read


# --------------------------------------------------------------------------------- retention
def _anchor_names(anchors: Iterable[str | int]) -> set[str]:
    names = set()
    for a in anchors:
        names.add(tag_for_step(a) if isinstance(a, int) else Path(a).name)
    return names


def _remove_dir(path: Path) -> None:
    # Rename first (atomic): a crash mid-delete leaves a `.deleting-*` dir that is not a tag, never a
    # half-deleted tag that still looks like one; those leftovers are removed on the next prune.
    doomed = path.with_name(f"{_DELETING_PREFIX}{path.name}-{time.time_ns()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _cleanup_deleting(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_DELETING_PREFIX):
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
        _cleanup_deleting(root)
    tags = list_tags(root)
    valid = {t for t in tags if validate_tag(root / t, verify_checksums)[0]}
    doomed = retention_plan(tags, valid, keep_last, _anchor_names(anchors))
    if prune_quarantined and valid:
        window_start = step_of_tag([t for t in tags if t in valid][-keep_last:][0])
        for q in list_quarantined(root):
            m = _QUARANTINE_RE.match(q)
            assert m is not None
            if step_of_tag(m.group(1)) < window_start:  # type: ignore[operator]
                doomed.append(q)
    if not dry_run:
        for name in doomed:
            _remove_dir(root / name)
    return doomed


def _tree_bytes(path: Path) -> int:
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
    anchor_names = _anchor_names(anchors)
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
            freed += _tree_bytes(root / tag)
        else:
            _remove_dir(root / tag)
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


# ------------------------------------------------------------------------------- failed saves
#: errnos that mean "no room": the daemon prunes old checkpoints and resumes (docs/CONTRACTS.md).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Below this much free space a write failure without an errno is taken as ENOSPC: a save that ran out of
# room has just used the rest (torch's C++ writer reports "basic_ios::clear: iostream error" / "file write
# failed", with no errno).
_NEARLY_FULL_BYTES = 64 << 20


def errno_name(code: int | None) -> str:
    """`ENOSPC` for 28; "unknown" for None or an errno Python does not name."""
    return errno.errorcode.get(code, "unknown") if code is not None else "unknown"


def _existing_ancestor(path: Path) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def bytes_free(path: str | Path) -> int | None:
    """Free bytes (for an unprivileged writer) on the filesystem holding `path` or its nearest existing parent."""
    try:
        st = os.statvfs(_existing_ancestor(Path(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def filesystem_errno(path: str | Path) -> int | None:
    """The errno a write under `path` most likely failed with, asked of the filesystem itself: EROFS when it
    is mounted read-only, ENOSPC when (nearly) full, EACCES when not writable; None when none applies."""
    try:
        st = os.statvfs(_existing_ancestor(Path(path)))
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail * st.f_frsize < _NEARLY_FULL_BYTES:
        return errno.ENOSPC
    if not os.access(_existing_ancestor(Path(path)), os.W_OK):
        return errno.EACCES
    return None


_IO_ERROR_TEXT = ("basic_ios", "iostream error", "file write failed", "PytorchStreamWriter",
                  "unexpected pos", "No space left", "Read-only file system", "Disk quota exceeded")


def is_write_error(exc: BaseException) -> bool:
    """An OSError, or torch.save's C++ writer failing (a RuntimeError that lost the errno)."""
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _IO_ERROR_TEXT)


def save_failure(exc: BaseException, path: str | Path, tag: str, rank: int) -> dict[str, Any]:
    """The fields of a `checkpoint_save_failed` event for a write that raised `exc` (docs/CONTRACTS.md)."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno else filesystem_errno(path)
    return {"errno": errno_name(code), "errno_code": code, "tag": tag,
            "path": str(getattr(exc, "filename", None) or path), "bytes_free": bytes_free(path),
            "error": f"{type(exc).__name__}: {exc}"[:500], "rank": rank}


def tag_bytes(tag_dir: str | Path) -> int:
    """Bytes a tag directory holds on disk (every file, manifest or not)."""
    return _tree_bytes(Path(tag_dir))


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
        _cleanup_deleting(root)
    tags = list_tags(root)
    valid = [t for t in tags if validate_tag(root / t, verify_checksums=False)[0]]
    if not valid:
        return [], 0, None
    keep = {valid[-1]} | _anchor_names(anchors)
    removed, freed = [], 0
    for tag in tags:
        if tag in keep:
            continue
        freed += _tree_bytes(root / tag)
        if not dry_run:
            _remove_dir(root / tag)
        removed.append(tag)
    return removed, freed, valid[-1]


# ----------------------------------------------------------------------------- asynchronous saves
# Why our own writer: torch.distributed.checkpoint.async_save stages and writes DCP's own format (not the
# DeepSpeed files `load_checkpoint` reads); DeepSpeed's decoupled engine writes from a side process but
# records no sizes or checksums and writes no manifest resume could check. This one plugs in where DeepSpeed calls
# `checkpoint_engine.save(state_dict, path)`, keeps DeepSpeed's file layout, and commits our manifest only
# once every rank's shards are durable, so the previous tag stays the newest valid one until then.
DONE_PREFIX = ".done-rank"       # a rank's marker: all its shards of the tag are written and fsynced
COMMIT_POLL_S = 0.05             # how often rank 0's commit looks for the other ranks' markers


class AsyncSaveError(RuntimeError):
    """The previous background save failed; `failure` is save_failure()'s dict (errno, path, tag, rank)."""

    def __init__(self, failure: dict[str, Any]):
        super().__init__(f"background checkpoint save of {failure.get('tag')} failed on rank "
                         f"{failure.get('rank')}: {failure.get('errno')} ({failure.get('error')}) "
                         f"writing {failure.get('path')}")
        self.failure = failure


def host_snapshot(obj: Any, pin_memory: bool = True) -> Any:
    """A copy of a state dict whose tensors live in host memory (pinned for device tensors when asked), so
    training may change the originals while the copy is written. Non-tensor leaves are deep-copied."""
    import copy

    import torch

    cuda_seen = False

    def walk(x: Any) -> Any:
        nonlocal cuda_seen
        if isinstance(x, torch.Tensor):
            t = x.detach()
            pin = pin_memory and t.is_cuda
            cuda_seen = cuda_seen or t.is_cuda
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            out.copy_(t, non_blocking=pin)
            return out
        if isinstance(x, dict):
            items = {k: walk(v) for k, v in x.items()}
            return items if type(x) is dict else type(x)(items)   # OrderedDict (module state dicts) stays one
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(walk(v) for v in x)
        return copy.deepcopy(x)

    snap = walk(obj)
    if cuda_seen:
        torch.cuda.synchronize()   # the non-blocking device->host copies must land before training resumes
    return snap


def durable_torch_save(obj: Any, path: str | Path) -> int:
    """torch.save to a hidden temp file, fsync, rename into place. Returns the file's size."""
    import torch

    path = Path(path)
    atomic_write(path, lambda fh: torch.save(obj, fh))
    return path.stat().st_size


def commit_when_durable(tag_dir: str | Path, world: int, step: int, loss: float | None, samples_seen: int,
                        config_version: int | None, *, timeout_s: float, extra: dict[str, Any] | None = None,
                        point_latest: bool = True) -> dict[str, Any]:
    """Rank 0's commit of an asynchronous save: wait (bounded) until every rank's marker says its shards are
    durable, drop the markers, write the manifest (hashing every file) and point `latest` at the tag."""
    tag_dir = Path(tag_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world) if not (tag_dir / f"{DONE_PREFIX}{r}").exists()]
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(f"ranks {missing} did not finish writing {tag_dir.name} within {timeout_s:g} s; "
                               "the tag is left without a manifest (not loadable)")
        time.sleep(COMMIT_POLL_S)
    for r in range(world):
        (tag_dir / f"{DONE_PREFIX}{r}").unlink(missing_ok=True)
    manifest = write_manifest(tag_dir, step, loss, samples_seen, config_version, extra)
    if point_latest:
        point_latest_to(tag_dir.parent, tag_dir.name)
    return manifest


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer: one save in flight, back-pressure when the next is due.

        writer.begin(tag_dir)                  # waits for the previous save (raises AsyncSaveError if it failed)
        engine.checkpoint_engine.save = writer.collect   # DeepSpeed hands each shard: snapshot to host memory
        engine.save_checkpoint(...)            # returns once the snapshots are taken
        writer.start(commit=...)               # background: write + fsync each shard, marker, then commit()

    `commit` (rank 0: `commit_when_durable`) runs in the background thread after this rank's shards are durable.
    `write_hook(path)` runs before each shard is written (fault injection in tests).
    """

    def __init__(self, rank: int, *, pin_memory: bool = True, write_hook: Callable[[str], None] | None = None):
        self.rank = rank
        self.pin_memory = pin_memory
        self.write_hook = write_hook
        self._thread: Any = None
        self._failure: dict[str, Any] | None = None
        self._tag_dir: Path | None = None
        self._pending: list[tuple[Any, str]] = []
        self.last_bytes = 0
        self.last_write_s = 0.0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight save is done (True) or `timeout_s` passes (False)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        return True

    def begin(self, tag_dir: str | Path, timeout_s: float | None = None) -> float:
        """Start collecting a save into `tag_dir`; first waits for the previous one. Returns seconds waited."""
        t0 = time.monotonic()
        if not self.wait(timeout_s):
            raise TimeoutError(f"the previous background save ({self._tag_dir}) is still writing after "
                               f"{timeout_s:g} s")
        waited = time.monotonic() - t0
        failure, self._failure = self._failure, None
        if failure is not None:
            raise AsyncSaveError(failure)
        self._tag_dir, self._pending = Path(tag_dir), []
        return waited

    def collect(self, state_dict: Any, path: str) -> None:
        """DeepSpeed's `checkpoint_engine.save(state_dict, path)`: snapshot now, write in start()'s thread."""
        if self._tag_dir is None:
            raise RuntimeError("AsyncCheckpointWriter.collect called before begin()")
        self._pending.append((host_snapshot(state_dict, self.pin_memory), str(path)))

    def start(self, commit: Callable[[], Any] | None = None) -> None:
        """Write the collected snapshots in a background thread; then this rank's marker; then `commit`."""
        import threading

        if self._tag_dir is None:
            raise RuntimeError("AsyncCheckpointWriter.start called before begin()")
        tag_dir, pending = self._tag_dir, self._pending
        self._pending = []
        self._thread = threading.Thread(target=self._write, args=(tag_dir, pending, commit), daemon=True,
                                        name=f"ckpt-writer-{tag_dir.name}")
        self._thread.start()

    def _write(self, tag_dir: Path, pending: list[tuple[Any, str]], commit: Callable[[], Any] | None) -> None:
        t0, total, path = time.monotonic(), 0, str(tag_dir)
        try:
            tag_dir.mkdir(parents=True, exist_ok=True)
            for obj, path in pending:
                if self.write_hook is not None:
                    self.write_hook(path)
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                total += durable_torch_save(obj, path)
            pending.clear()   # drop the host copies as soon as they are on disk
            fsync_dir(tag_dir)
            path = str(tag_dir / f"{DONE_PREFIX}{self.rank}")
            atomic_write_text(Path(path), "")
            if commit is not None:
                path = str(tag_dir / MANIFEST_NAME)
                commit()
        except Exception as exc:  # noqa: BLE001 - any failure is recorded and raised by the next begin()
            self._failure = save_failure(exc, path, tag_dir.name, self.rank) if isinstance(exc, OSError) else {
                "errno": None, "error": f"{type(exc).__name__}: {exc}", "path": path, "tag": tag_dir.name,
                "rank": self.rank, "bytes_free": bytes_free(tag_dir)}
        self.last_bytes, self.last_write_s = total, time.monotonic() - t0
