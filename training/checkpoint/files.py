"""Checkpoint files: tag names, manifests (sizes + sha256), validation, quarantine, `latest`.

The on-disk layout these functions read and write is described in the package docstring
(`ulyssesd.training.checkpoint`). Stdlib only: the daemon and `ulyssesctl` import it without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..durable import atomic_write_text, fsync_dir

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"  # DeepSpeed's pointer file
MANIFEST_VERSION = 1
HASH_CHUNK = 8 << 20  # 8 MiB reads: few syscalls, bounded memory on multi-GB shards
TAG_RE = re.compile(r"^step-(\d{8,})$")
QUARANTINE_RE = re.compile(r"^(step-\d{8,})\.corrupt-\d+(?:-\d+)?$")
DELETING_PREFIX = ".deleting-"
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
    m = TAG_RE.match(Path(tag).name)
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
    return sorted(p.name for p in root.iterdir() if p.is_dir() and QUARANTINE_RE.match(p.name))


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
                   config_version: int | None, extra: dict[str, Any] | None = None,
                   known: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Hash every file of the tag and write `manifest.json` atomically (tmp, fsync, rename, fsync dir).

    `known` ({relative path: {"size", "sha256"}}) holds digests taken while the files were written (the async
    writer's): a file whose size still matches is not read again. Call it LAST, after every rank's files are
    written. Returns the manifest.
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
    sizes = {r: (tag_dir / r).stat().st_size for r in rels}
    known = {r: k for r, k in (known or {}).items() if r in sizes and k.get("size") == sizes[r]}
    hashes = {r: known[r]["sha256"] for r in known} | _hash_many(tag_dir, [r for r in rels if r not in known])
    files = {r: {"size": sizes[r], "sha256": hashes[r]} for r in rels}
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
