"""Checkpoint files: tag names, manifests (sizes, sha256, chunk digests), validation, quarantine, `latest`.

The on-disk layout these functions read and write is described in the package docstring
(`ulyssesd.training.checkpoint`). Stdlib only: the daemon and `ulyssesctl` import it without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..durable import atomic_write_text, fsync_dir
from .digests import chunk_list_sha256

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"  # DeepSpeed's pointer file
#: v2: a file entry may also carry `chunk_bytes` and `chunk_sha256` (the digest of each fixed-size chunk, in
#: order). v3: an entry with chunk digests carries `chunk_list_sha256` (sha256 over the chunks' raw 32-byte
#: digests, in order: NOT the `sha256sum` of the file) and may lack the whole-file `sha256`, which the writer
#: no longer takes for files written in chunks (each byte is hashed once). v1/v2 manifests verify as before.
MANIFEST_VERSION = 3
HASH_CHUNK = 8 << 20  # 8 MiB reads: few syscalls, bounded memory on multi-GB shards
#: Size of the chunks a manifest digests separately, so that verification at load hashes one file on several
#: cores. Equal to the O_DIRECT writer's buffer (shard_io), which takes each chunk's digest as it writes it.
DIGEST_CHUNK_BYTES = 64 << 20
# Bounds on a manifest's `chunk_bytes`: a verification thread holds one chunk in memory.
_MIN_CHUNK_BYTES, _MAX_CHUNK_BYTES = 4096, 1 << 30
#: A manifest larger than this is refused unread (a damaged or hostile file must not fill the daemon's memory):
#: ~70 bytes per 64 MiB chunk, so even 10 TB of shards need ~12 MB.
MAX_MANIFEST_BYTES = 256 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
TAG_RE = re.compile(r"^step-(\d{8,})$")
QUARANTINE_RE = re.compile(r"^(step-\d{8,})\.corrupt-(?:\d+|\d{8}T\d{6}Z)(?:-\d+)?$")  # Unix or ISO-like UTC time
DELETING_PREFIX = ".deleting-"
# hashlib releases the GIL on large updates, so threads hash several shards (or chunks) in parallel.
DEFAULT_VERIFY_THREADS = max(1, min(8, os.cpu_count() or 1))


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


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many digests a file of `size` bytes has in chunks of `chunk_bytes` (the last one may be short)."""
    return -(-size // chunk_bytes)


def _sha256_hex(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_file(path: str | Path, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> dict[str, Any]:
    """{"size", "sha256", "chunk_bytes", "chunk_sha256"} of one file, read once, sequentially (HASH_CHUNK reads).

    The whole-file sha256 is taken in this thread and the chunk digests in a helper thread fed the same
    pieces in order (hashlib frees the GIL), so it costs the time of one hash, with a few pieces in memory.
    """
    pieces: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
    chunk_hex: list[str] = []

    def chunk_loop() -> None:
        h, filled = hashlib.sha256(), 0
        while (piece := pieces.get()) is not None:
            view = memoryview(piece)
            while view:
                take = min(len(view), chunk_bytes - filled)
                h.update(view[:take])
                filled, view = filled + take, view[take:]
                if filled == chunk_bytes:
                    chunk_hex.append(h.hexdigest())
                    h, filled = hashlib.sha256(), 0
        if filled:
            chunk_hex.append(h.hexdigest())

    helper = threading.Thread(target=chunk_loop, daemon=True, name="ckpt-chunk-hash")
    helper.start()
    whole, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as fh:
            while piece := fh.read(HASH_CHUNK):
                whole.update(piece)
                size += len(piece)
                pieces.put(piece)
    finally:
        pieces.put(None)
        helper.join()
    return {"size": size, "sha256": whole.hexdigest(), "chunk_bytes": chunk_bytes, "chunk_sha256": chunk_hex}


def _digest_many(tag_dir: Path, rels: list[str], threads: int = DEFAULT_VERIFY_THREADS) -> dict[str, dict[str, Any]]:
    """digest_file of each file, files in parallel."""
    if len(rels) <= 1:
        return {r: digest_file(tag_dir / r) for r in rels}
    with ThreadPoolExecutor(max_workers=min(threads, len(rels)), thread_name_prefix="ckpt-file-hash") as pool:
        return dict(zip(rels, pool.map(lambda r: digest_file(tag_dir / r), rels), strict=True))


def _valid_chunks(entry: dict[str, Any], size: int) -> bool:
    """A digest entry's chunk digests are usable: our chunk size and one well-formed digest per chunk."""
    chunks = entry.get("chunk_sha256")
    return (entry.get("chunk_bytes") == DIGEST_CHUNK_BYTES and isinstance(chunks, list)
            and len(chunks) == chunk_count(size, DIGEST_CHUNK_BYTES)
            and all(isinstance(c, str) and _SHA256_HEX.match(c) for c in chunks))


def _known_entry(entry: dict[str, Any], size: int | None) -> dict[str, Any] | None:
    """A writer's digest entry the manifest can use as is, or None (the file is hashed again): its size still
    matches and it has a whole-file sha256 or usable chunk digests. Chunk digests alone of a file of one
    chunk or less give its sha256 (the one chunk is the whole file)."""
    if size is None or entry.get("size") != size:
        return None
    if isinstance(entry.get("sha256"), str):
        return entry
    if not _valid_chunks(entry, size):
        return None
    if size <= DIGEST_CHUNK_BYTES:
        return entry | {"sha256": entry["chunk_sha256"][0] if entry["chunk_sha256"] else _sha256_hex(b"")}
    return entry


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

    Each file gets its size, whole-file sha256 and (when it is larger than one chunk) the sha256 of each
    DIGEST_CHUNK_BYTES chunk. `known`
    ({relative path: {"size", "sha256"[, "chunk_bytes", "chunk_sha256"]}}) holds digests taken while the files
    were written (the async writer's): a file whose size still matches is not read again (an entry without
    usable chunk digests is recorded without them and verified whole at load). Call it LAST, after every rank's
    files are written. Returns the manifest.
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
    known = {r: k for r, k in ((r, _known_entry(k, sizes.get(r))) for r, k in (known or {}).items())
             if k is not None}
    digests = _digest_many(tag_dir, [r for r in rels if r not in known])
    files: dict[str, dict[str, Any]] = {}
    for r in rels:
        entry = known.get(r) or digests[r]
        files[r] = {"size": sizes[r]} | ({"sha256": entry["sha256"]} if isinstance(entry.get("sha256"), str) else {})
        # A file of one chunk or less: its one chunk digest would be the whole-file sha256 again.
        if sizes[r] > DIGEST_CHUNK_BYTES and _valid_chunks(entry, sizes[r]):
            chunks = list(entry["chunk_sha256"])
            files[r] |= {"chunk_bytes": entry["chunk_bytes"], "chunk_sha256": chunks,
                         "chunk_list_sha256": chunk_list_sha256(chunks)}
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
        if (size := path.stat().st_size) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path}: manifest of {size} bytes exceeds {MAX_MANIFEST_BYTES} (damaged?); not read")
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
        if (not isinstance(meta, dict) or type(meta.get("size")) is not int or meta["size"] < 0
                or not (isinstance(meta.get("sha256"), str) or "chunk_list_sha256" in meta)):
            raise ManifestError(f"{path}: manifest entry for {rel!r} needs integer 'size' and string 'sha256' "
                                "(or, v3, chunk digests with their 'chunk_list_sha256')")
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ManifestError(f"{path}: manifest entry {rel!r} points outside the tag directory")
        if "chunk_bytes" in meta or "chunk_sha256" in meta or "chunk_list_sha256" in meta:
            _check_chunk_entry(path, rel, meta)
    return data


def _check_chunk_entry(path: Path, rel: str, meta: dict[str, Any]) -> None:
    cb, chunks = meta.get("chunk_bytes"), meta.get("chunk_sha256")
    if not isinstance(cb, int) or isinstance(cb, bool) or not _MIN_CHUNK_BYTES <= cb <= _MAX_CHUNK_BYTES:
        raise ManifestError(f"{path}: manifest entry for {rel!r}: 'chunk_bytes' must be an integer in "
                            f"[{_MIN_CHUNK_BYTES}, {_MAX_CHUNK_BYTES}], got {cb!r}")
    want = chunk_count(meta["size"], cb)
    if not isinstance(chunks, list) or len(chunks) != want:
        got = len(chunks) if isinstance(chunks, list) else type(chunks).__name__
        raise ManifestError(f"{path}: manifest entry for {rel!r}: 'chunk_sha256' must list {want} digests "
                            f"({meta['size']} bytes in chunks of {cb}), got {got}")
    if not all(isinstance(c, str) and _SHA256_HEX.match(c) for c in chunks):
        raise ManifestError(f"{path}: manifest entry for {rel!r}: 'chunk_sha256' holds a value that is not a "
                            "64-digit lowercase hex sha256")
    if "chunk_list_sha256" in meta and meta["chunk_list_sha256"] != chunk_list_sha256(chunks):
        raise ManifestError(f"{path}: manifest entry for {rel!r}: 'chunk_list_sha256' does not match its "
                            "'chunk_sha256' list (the manifest was edited or damaged)")
    if "sha256" not in meta and "chunk_list_sha256" not in meta:
        raise ManifestError(f"{path}: manifest entry for {rel!r} has neither 'sha256' nor 'chunk_list_sha256'")


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """Total bytes of the files a manifest lists (the `bytes` of a checkpoint_saved event)."""
    return sum(int(meta["size"]) for meta in manifest["files"].values())


def validate_tag(tag_dir: str | Path, verify_checksums: bool = True,
                 threads: int | None = None) -> tuple[bool, str]:
    """(True, "ok") or (False, reason naming the file). verify_checksums=False checks sizes only (fast).

    Checksums are verified by `threads` workers (default DEFAULT_VERIFY_THREADS): chunk by chunk where the
    manifest has chunk digests (one file on several cores), whole files for a v1 manifest.
    """
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
        reason = verify_checksums_parallel(tag_dir, files, threads)
        if reason is not None:
            return False, reason
    return True, "ok"


def _verify_jobs(tag_dir: Path, files: dict[str, dict[str, Any]]) -> list[tuple[Path, int | None, int, int, str]]:
    """(path, chunk index or None for a whole file, offset, length, expected sha256), in file and offset order,
    so the workers' reads walk each file front to back."""
    jobs: list[tuple[Path, int | None, int, int, str]] = []
    for rel in sorted(files):
        meta = files[rel]
        if "chunk_sha256" in meta:
            cb, size = meta["chunk_bytes"], meta["size"]
            jobs += [(tag_dir / rel, k, k * cb, min(cb, size - k * cb), digest)
                     for k, digest in enumerate(meta["chunk_sha256"])]
        else:
            jobs.append((tag_dir / rel, None, 0, meta["size"], meta["sha256"]))
    return jobs


_READ_BUFFERS = threading.local()   # one reusable HASH_CHUNK read buffer per verification thread


def _read_buffer() -> memoryview:
    buf = getattr(_READ_BUFFERS, "buf", None)
    if buf is None:
        buf = _READ_BUFFERS.buf = bytearray(HASH_CHUNK)
    return memoryview(buf)


def _check_job(job: tuple[Path, int | None, int, int, str]) -> str | None:
    """None when the bytes match, else the reason naming the file (and the chunk and its offset)."""
    path, index, offset, length, expected = job
    try:
        if index is None:
            got = sha256_file(path)
        else:
            # HASH_CHUNK pieces hashed as they arrive: the bytes are still in the CPU cache (one 64 MiB read,
            # then one hash, measured 13 % slower on the 2-core box).
            view, h, done = _read_buffer(), hashlib.sha256(), 0
            fd = os.open(path, os.O_RDONLY)
            try:
                while done < length:
                    n = os.preadv(fd, [view[:min(len(view), length - done)]], offset + done)
                    if n == 0:
                        return (f"{path}: ended at byte {offset + done} while verifying chunk {index} "
                                f"(offset {offset}); the file shrank (truncated)")
                    h.update(view[:n])
                    done += n
            finally:
                os.close(fd)
            got = h.hexdigest()
    except OSError as exc:
        return f"{path}: unreadable file while verifying checksums: {exc}"
    if got == expected:
        return None
    where = "" if index is None else f" of chunk {index} (bytes {offset}..{offset + length})"
    return f"{path}: sha256{where} {got[:12]}… does not match the manifest's {expected[:12]}… (corrupted)"


def verify_checksums_parallel(tag_dir: str | Path, files: dict[str, dict[str, Any]],
                              threads: int | None = None) -> str | None:
    """Hash every file a manifest lists (its `files`) in a bounded thread pool: None when all match, else the
    reason of the first mismatch in file and offset order (the same answer whatever the thread count)."""
    threads = DEFAULT_VERIFY_THREADS if threads is None else threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"verification threads must be an integer >= 1, got {threads!r}")
    jobs = _verify_jobs(Path(tag_dir), files)
    if threads == 1 or len(jobs) <= 1:
        return next((r for r in map(_check_job, jobs) if r is not None), None)
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="ckpt-verify") as pool:
        futures = [pool.submit(_check_job, job) for job in jobs]
        for i, fut in enumerate(futures):
            reason = fut.result()
            if reason is not None:
                for later in futures[i + 1:]:   # the tag is bad: skip what has not started
                    later.cancel()
                return reason
    return None


def list_valid_tags(ckpt_dir: str | Path, verify_checksums: bool = False) -> list[str]:
    """Tags with a valid manifest, oldest first. Sizes only by default (hashing every tag is slow)."""
    root = Path(ckpt_dir)
    return [t for t in list_tags(root) if validate_tag(root / t, verify_checksums)[0]]


def latest_valid_tag(ckpt_dir: str | Path, verify_checksums: bool = True,
                     on_invalid: Callable[[str, str], None] | None = None,
                     threads: int | None = None) -> str | None:
    """Newest tag that validates, scanning newest -> oldest; on_invalid(tag, reason) for each one skipped.
    `threads`: validate_tag's verification threads."""
    root = Path(ckpt_dir)
    for tag in reversed(list_tags(root)):
        ok, reason = validate_tag(root / tag, verify_checksums, threads)
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
