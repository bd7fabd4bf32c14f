"""The job's warm standby: start a rank before it is needed, wait at a gate, then run the attempt.

`python -m ulyssesd.training --standby-gate GATE --run-dir D --attempt N` (the daemon starts it, under the
same launcher as a cold attempt, while the previous attempt still trains: daemon/job/standby.py) does, on
every rank, what does not depend on the attempt's config:

- imports torch, DeepSpeed and the model code (most of a cold start-up on a big node);
- creates the CUDA context on its device (when a GPU is present);
- optionally reads the latest valid checkpoint's files that this rank will load (its own ZeRO shards) into
  host memory (one memfd per file), hashing each 8 MiB chunk as it lands (checked against the tag's
  manifest sha256: one pass, never again at load time), and re-reads them when `latest` moves on; it looks
  at the gate between chunks, so an opened gate stops it within one chunk (the files completed by then are
  kept, the rest is loaded from disk): a restart never waits for a preload;

then waits, bounded, for the daemon to open the gate: an atomically written JSON file
`{"v": 1, "attempt": N, "config": "configs/vK.json", "config_version": K}`. Only then does the job read its
config (so a config a remediation patched after the standby started is the one used) and go on as a cold
attempt would: process group, model build, resume. The load of the resume tag goes through DeepSpeed's
checkpoint engine (`TorchCheckpointEngine.load(path, map_location)`, which is `torch.load`); while it runs,
`Preload.serve` answers it from the preloaded bytes (`torch.load` of the memfd with `mmap=True`: the
tensors map the same bytes, bit for bit, with no copy at load time, so never slower than a load from disk)
for each file whose inode, size and mtime are unchanged since the preload, and from disk for anything else. A preload of a tag other than the one the ranks agreed on is dropped,
never used: the job never resumes from a stale tag.

Exit code 5 (`EXIT_STANDBY`): the gate was not opened within `ULYSSESD_STANDBY_TIMEOUT_S`, or it could not
be read; the message says which. The daemon replaces a standby that timed out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint.digests import StreamCheck
from .startup import STARTUP

log = logging.getLogger("ulyssesd.training")

#: Exit code of a standby whose gate did not open in time or could not be read.
EXIT_STANDBY = 5
#: Seconds a standby waits for its gate before it exits with EXIT_STANDBY (the daemon sets it).
TIMEOUT_ENV = "ULYSSESD_STANDBY_TIMEOUT_S"
#: "1": read this rank's shards of the latest valid checkpoint into host memory while waiting.
PRELOAD_ENV = "ULYSSESD_STANDBY_PRELOAD"
#: The checkpoint directory to preload from (the config is not read before the gate opens).
CKPT_DIR_ENV = "ULYSSESD_STANDBY_CKPT_DIR"
#: The run's `train.device` (cpu / cuda / auto): DeepSpeed's accelerator is chosen when it is imported.
DEVICE_ENV = "ULYSSESD_STANDBY_DEVICE"
DEFAULT_TIMEOUT_S = 86400.0
#: A gate file is a few hundred bytes; anything larger is refused unread.
MAX_GATE_BYTES = 64 << 10
#: How often the wait looks at the gate, and how often at `latest` (a moved tag is preloaded again).
GATE_POLL_S = 0.05
LATEST_POLL_S = 1.0


class StandbyError(RuntimeError):
    """The standby cannot become an attempt (gate timeout or unreadable gate); exit EXIT_STANDBY."""


@dataclass(frozen=True)
class Gate:
    """What the daemon tells a standby when it opens the gate."""

    attempt: int
    config: Path
    config_version: int | None


def read_gate(path: Path) -> Gate | None:
    """The opened gate, None while it is closed (no file yet); StandbyError naming what is wrong otherwise."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_GATE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StandbyError(f"standby gate {path} is unreadable: {exc}") from None
    if len(raw) > MAX_GATE_BYTES:
        raise StandbyError(f"standby gate {path} is larger than {MAX_GATE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise StandbyError(f"standby gate {path} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise StandbyError(f"standby gate {path} must be a JSON object")
    attempt, config, version = data.get("attempt"), data.get("config"), data.get("config_version")
    problems = []
    if type(attempt) is not int or attempt < 1:
        problems.append(f"'attempt' must be a positive integer, got {attempt!r:.60}")
    if not isinstance(config, str) or not config:
        problems.append(f"'config' must be the config file's path, got {config!r:.60}")
    if version is not None and (type(version) is not int or version < 1):
        problems.append(f"'config_version' must be a positive integer or null, got {version!r:.60}")
    if problems:
        raise StandbyError(f"standby gate {path}: " + "; ".join(problems))
    assert isinstance(attempt, int) and isinstance(config, str)  # checked above; says so to the type checker
    return Gate(attempt, Path(config), version)


# ------------------------------------------------------------------------------------------------ preload
#: The preload reads a shard in chunks of this size, hashing each chunk as it lands, and looks at the gate
#: between chunks: an opened gate is noticed within one chunk's read (8 MiB: a few ms at 1-2 GB/s; the
#: gate check is one stat, and the buffer is reused, so smaller chunks cost nothing measurable).
PRELOAD_CHUNK_BYTES = 8 << 20
#: Test knob: seconds slept after each chunk (a slow disk, to show a gate opened mid-preload is noticed).
CHUNK_DELAY_ENV = "ULYSSESD_STANDBY_PRELOAD_CHUNK_DELAY_S"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format: the only one torch.load can mmap


class _Stopped(Exception):
    """The gate opened while a file was being read: the file is dropped, the preload ends."""


@dataclass
class _File:
    fd: int  # a memfd holding the file's verified bytes; torch.load mmaps it (no copy at load time)
    size: int
    ident: tuple[int, int, int]  # (inode, size, mtime_ns) when read: a file replaced since is read from disk

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a dropped preload gives its memory back even if nobody called release()
        self.close()


def _ident(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _read_checked(path: Path, size: int, expected: dict[str, Any], keep: bool, stop: Callable[[], bool],
                  delay_s: float) -> int | None:
    """Read `path` once in PRELOAD_CHUNK_BYTES chunks through one reused buffer, hashing each chunk as it lands
    (one pass: verification is done here, never again at load time). keep=True: the bytes are written on into
    a memfd, returned (its fd) when they match `size` and `expected` (the manifest entry); keep=False: only
    checked, returns -1. None: they do not match. _Stopped: `stop()` said so between two chunks (none kept)."""
    fd = os.memfd_create("ulyssesd-standby-preload", os.MFD_CLOEXEC) if keep else -1
    h = StreamCheck(expected)
    buf = memoryview(bytearray(PRELOAD_CHUNK_BYTES))
    zip_format = False
    try:
        with open(path, "rb", buffering=0) as fh:
            off = 0
            while off < size:
                if stop():
                    raise _Stopped
                got = fh.readinto(buf[:min(PRELOAD_CHUNK_BYTES, size - off)])
                if not got:
                    return None  # shorter than its manifest says
                h.update(buf[:got])
                if h.failed:
                    return None  # a chunk does not match: no need to read the rest
                if off == 0:
                    zip_format = bytes(buf[:4]) == _ZIP_MAGIC
                if keep:
                    # os.write fills the memfd's pages inside the kernel: no user page fault per 4 KiB as
                    # readinto an mmap of it takes
                    done = 0
                    while done < got:
                        done += os.write(fd, buf[done:got])
                off += got
                if delay_s:
                    time.sleep(delay_s)
            if fh.read(1):
                return None  # longer than its manifest says
        if not h.matches():
            return None
        if not keep or not zip_format:
            return -1  # checked; not kept, or not a zip torch.save (it cannot be mmapped): loaded from disk
        out, fd = fd, -1
        return out
    finally:
        buf.release()
        if fd >= 0:
            os.close(fd)


def rank_files(tag_dir: Path, rank: int, manifest_files: dict[str, Any]) -> list[str]:
    """The files of a tag this rank loads itself: DeepSpeed names each ZeRO-3 rank's model and optimizer
    shards `…zero_pp_rank_{R}_mp_rank_…` (R = the rank in the ZeRO group, here the whole world)."""
    key = f"zero_pp_rank_{rank}_"
    return sorted(rel for rel in manifest_files if key in Path(rel).name)


def unowned_files(manifest_files: dict[str, Any]) -> list[str]:
    """Files of a tag no rank's shard pattern names (DeepSpeed's zero_to_fp32.py): rank 0 checks them."""
    return sorted(rel for rel in manifest_files if "zero_pp_rank_" not in Path(rel).name)


@dataclass
class Preload:
    """One rank's shards of one checkpoint tag, in host memory, checked against the tag's manifest."""

    ckpt_dir: Path
    tag: str
    files: dict[str, _File] = field(default_factory=dict)  # absolute path -> its verified bytes (a memfd)
    # relative path -> (inode, size, mtime_ns) of every file this rank checked against the manifest's sha256
    verified: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    verified_in_standby: str | None = None  # the tag rank 0 validated by sizes only (the standby hashed it)
    complete: bool = True  # False: the gate opened mid-preload; only the files read by then are held
    hashed_after_gate: int | None = None  # files of the tag rank 0 still hashed (the standby had not)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def release(self) -> None:
        """Give the host memory back (the memfds; tensors a load returned keep their own pages)."""
        for f in self.files.values():
            f.close()
        self.files.clear()

    @classmethod
    def read(cls, ckpt_dir: Path, rank: int, stop: Callable[[], bool] = lambda: False) -> Preload | None:
        """The tag `latest` names, read and checked; None when there is none or it does not check out (then
        the resume reads from disk as a cold start does, and validates the tag itself). When `stop()` turns
        true (the gate opened) it stops within one chunk and returns what it completed (complete=False):
        whole verified files only; the rest is loaded from disk."""
        from . import checkpoint as ckpt

        t0 = time.monotonic()
        tag = ckpt.read_latest(ckpt_dir)
        if tag is None or not (ckpt_dir / tag).is_dir():
            return None
        tag_dir = ckpt_dir / tag
        try:
            manifest = ckpt.read_manifest(tag_dir)
        except ckpt.ManifestError as exc:
            log.info("standby preload skipped: %s", exc)
            return None
        if not hasattr(os, "memfd_create"):
            log.info("standby preload skipped: no memfd_create on this platform")
            return None
        delay_s = float(os.environ.get(CHUNK_DELAY_ENV) or 0.0)
        out = cls(ckpt_dir, tag)
        mine = rank_files(tag_dir, rank, manifest["files"])
        checked_only = unowned_files(manifest["files"]) if rank == 0 else []
        for rel in mine + checked_only:
            path = (tag_dir / rel).resolve()
            meta = manifest["files"][rel]
            try:
                ident = _ident(path)
                fd = _read_checked(path, int(meta["size"]), meta, rel in mine, stop, delay_s)
            except _Stopped:
                out.complete = False
                log.info("standby preload of %s stopped by the gate after %d of %d files (%.2fs)", tag,
                         len(out.verified), len(mine) + len(checked_only), time.monotonic() - t0)
                break
            except OSError as exc:
                log.info("standby preload of %s dropped: %s", tag, exc)
                out.release()
                return None
            if fd is None:
                log.warning("standby preload of %s dropped: %s does not match its manifest", tag, rel)
                out.release()
                return None
            out.verified[rel] = ident
            if fd >= 0:
                out.files[str(path)] = _File(fd, int(meta["size"]), ident)
        out.seconds = time.monotonic() - t0
        return out

    def verified_files(self, ckpt_dir: Path, run_dir: Path, attempt: int,
                       world: int) -> tuple[str, frozenset[str], frozenset[str]] | None:
        """`verified_files` (below), for the Trainer that holds a preload (it does not import this module);
        whether it covered the whole tag is remembered for the `standby_preload_used` event."""
        got = verified_files(ckpt_dir, run_dir, attempt, world)
        self.verified_in_standby = got[0] if got is not None and got[1] == got[2] else None
        return got

    def validate_newest(self, root: Path, run_dir: Path, attempt: int, world: int, threads: int | None,
                        invalid: Callable[[str, str], None]) -> str | None:
        """Rank 0 after the gate: the newest tag, validated with what this attempt's standby ranks already
        checked (`verified_files`): every file's size, the sha256 of only the files they had not (all after a
        preload the gate cut short at once, none after finished ones). None: no coverage (the caller validates
        as on a cold start), or the tag failed (`invalid` quarantines it; older tags are checked in full)."""
        from . import checkpoint as ckpt

        got = self.verified_files(root, run_dir, attempt, world)
        if got is None or not got[1]:
            return None
        tag, covered, _ = got
        ok, reason = ckpt.validate_tag(root / tag, verify_checksums=False)
        if ok:
            files = ckpt.read_manifest(root / tag)["files"]
            rest = {rel: meta for rel, meta in files.items() if rel not in covered}
            self.hashed_after_gate = len(rest)
            failed = ckpt.verify_checksums_parallel(root / tag, rest, threads)
            if failed is None:
                log.info("checkpoint %s: %d of %d files hashed by the standby, %d now", tag, len(covered),
                         len(files), len(rest))
                return tag
            reason = failed
        invalid(tag, reason)
        return None

    def still_latest(self) -> bool:
        from . import checkpoint as ckpt

        return ckpt.read_latest(self.ckpt_dir) == self.tag

    def _lookup(self, path: str) -> _File | None:
        f = self.files.get(str(Path(path).resolve()))
        if f is None or f.fd < 0:
            return None
        try:
            if _ident(Path(path)) != f.ident:
                return None  # replaced since the preload (a rolled-back timeline's tag saved again): disk
        except OSError:
            return None
        return f

    @contextlib.contextmanager
    def serve(self, engine: Any, ckpt_dir: Path, tag: str, event: Callable[..., None]) -> Iterator[None]:
        """While DeepSpeed loads `tag`, answer its checkpoint engine's loads from memory where the preload
        holds that very file. A preload of another tag or directory is dropped (never a stale resume)."""
        if tag != self.tag or Path(ckpt_dir).resolve() != self.ckpt_dir.resolve():
            log.warning("standby preload of %s dropped: resuming from %s", self.tag, tag)
            event("standby_preload_dropped", preloaded=self.tag, resume=tag)
            self.release()
            yield
            return
        import torch

        ce = engine.checkpoint_engine
        disk_load = ce.load

        def load(path: str, map_location: Any = None) -> Any:
            f = self._lookup(path)
            if f is None:
                self.misses += 1
                return disk_load(path, map_location=map_location)
            self.hits += 1
            # What TorchCheckpointEngine.load does, from the same (already verified) bytes, without copying
            # them: the tensors map the memfd's pages (MAP_SHARED: the memfd is this process's own, so a
            # tensor written later, e.g. a CPU-offloaded optimizer state, has no second copy-on-write copy).
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
                return torch.load(f"/proc/self/fd/{f.fd}", map_location=map_location, weights_only=False,
                                  mmap=True)

        ce.load = load
        try:
            yield
        finally:
            del ce.load  # the class's own load again
            event("standby_preload_used", tag=tag, from_memory=self.hits, from_disk=self.misses,
                  preloaded_bytes=self.nbytes, preload_seconds=round(self.seconds, 3),
                  preload_complete=self.complete, checksums_verified_in_standby=self.verified_in_standby == tag,
                  files_hashed_after_gate=self.hashed_after_gate)
            self.release()  # the memfds go; the loaded tensors keep only the pages they map


# -------------------------------------------------------------------------------------------- the wait
def _warm_imports() -> str:
    """Everything config-free that a start-up does (startup.py `warm_up`: imports, the CUDA context, the
    device's libraries, the process group); returns the device's name."""
    from .startup import warm_up

    def job_code() -> None:  # after DS_ACCELERATOR is settled (warm_up), before the lazy modules
        from . import train  # noqa: F401 - the model, data and checkpoint code
        from .model import attention  # noqa: F401

    return warm_up(os.environ.get(DEVICE_ENV, "auto"), job_code)


def _write_ready(run_dir: Path, attempt: int, rank: int, fields: dict[str, Any]) -> None:
    """`{run_dir}/standby/attempt-N-rank-R.ready`: this rank is warm (the daemon's status and tests read it)."""
    d = run_dir / "standby"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".attempt-{attempt}-rank-{rank}.ready.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), **fields}))
        os.replace(tmp, d / f"attempt-{attempt}-rank-{rank}.ready")
    except OSError as exc:  # only informative
        log.warning("standby ready file not written: %s", exc)


def wait_at_gate(gate_path: Path, run_dir: Path, attempt: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> tuple[Gate, Preload | None]:
    """Warm up, then wait for the gate (bounded); returns the gate and this rank's preload (or None)."""
    t0 = clock()
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    rank = int(os.environ.get("RANK", "0"))
    device = _warm_imports()
    preload_on = os.environ.get(PRELOAD_ENV, "0") == "1" and bool(os.environ.get(CKPT_DIR_ENV))
    ckpt_dir = Path(os.environ.get(CKPT_DIR_ENV) or ".")

    def gate_written() -> bool:  # between two chunks of a preload: a restart never waits for a preload
        return gate_path.exists()

    preload = Preload.read(ckpt_dir, rank, stop=gate_written) if preload_on else None
    warm_s = clock() - t0
    log.info("standby warm in %.1fs (%s); preload %s; waiting for the gate %s (at most %.0fs)", warm_s, device,
             f"{preload.tag} ({preload.nbytes} bytes)" if preload else "none", gate_path, timeout_s)
    import resource

    def ready(preload: Preload | None) -> None:
        _write_ready(run_dir, attempt, rank, {
            "warm_s": round(warm_s, 3), "device": device, "preloaded": preload.tag if preload else None,
            "preloaded_bytes": preload.nbytes if preload else 0,
            "verified": {"tag": preload.tag, "files": preload.verified} if preload else None,
            # what a waiting standby costs in host RAM (Linux: KiB)
            "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})

    ready(preload)
    STARTUP.mark("standby_warm")
    deadline = clock() + timeout_s
    next_latest = clock() + LATEST_POLL_S
    refused: str | None = None  # a tag whose preload did not check out: not hashed again every second
    while True:
        gate = read_gate(gate_path)
        if gate is not None:
            if gate.attempt != attempt:
                raise StandbyError(f"standby gate {gate_path} opens attempt {gate.attempt}, this standby is "
                                   f"attempt {attempt}")
            if preload is not None and not preload.still_latest():
                preload.release()
                preload = None  # moved on at the last moment: the resume reads from disk
            STARTUP.mark("standby_gate")
            log.info("standby gate open after %.1fs: attempt %d, config %s", clock() - t0, gate.attempt,
                     gate.config)
            return gate, preload
        now = clock()
        if now >= deadline:
            raise StandbyError(f"standby gate {gate_path} was not opened within {timeout_s:.0f}s "
                               f"({TIMEOUT_ENV})")
        if preload_on and now >= next_latest:
            next_latest = now + LATEST_POLL_S
            if preload is None or not preload.still_latest():
                if preload is not None:
                    preload.release()  # the old bytes go first: never two tags in memory
                preload = None
                from . import checkpoint as ckpt

                latest = ckpt.read_latest(ckpt_dir)
                preload = (Preload.read(ckpt_dir, rank, stop=gate_written)
                           if latest is not None and latest != refused else None)
                refused = latest if preload is None else None
                if preload is not None:
                    log.info("standby preloaded %s (%d bytes, %.2fs%s)", preload.tag, preload.nbytes,
                             preload.seconds, "" if preload.complete else ", stopped by the gate")
                    ready(preload)
                continue  # the gate is looked at right away: it may have opened during the read
        sleep(GATE_POLL_S)


def verified_files(ckpt_dir: Path, run_dir: Path, attempt: int,
                   world: int) -> tuple[str, frozenset[str], frozenset[str]] | None:
    """(newest tag of `ckpt_dir`, the files of it that this attempt's standby ranks checked against its
    manifest's sha256 while they waited (their ready files) and that did not change since (inode, size,
    mtime), all the files its manifest lists); None without a tag or a readable manifest. Rank 0 hashes the
    files not in the set (a rank's missing or stale ready file, a preload the gate cut short, a rewritten
    file): a check is moved before the failure, never skipped."""
    from . import checkpoint as ckpt

    tags = ckpt.list_tags(ckpt_dir)
    if not tags:
        return None
    tag, claimed = tags[-1], {}
    for r in range(world):
        try:
            got = json.loads((run_dir / "standby" / f"attempt-{attempt}-rank-{r}.ready").read_text()[:1 << 20])
            got = got["verified"]
            if isinstance(got, dict) and got.get("tag") == tag and isinstance(got.get("files"), dict):
                claimed.update(got["files"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
    try:
        rels = frozenset(ckpt.read_manifest(ckpt_dir / tag)["files"])
    except ckpt.ManifestError:
        return None
    covered = set()
    for rel in rels & claimed.keys():
        with contextlib.suppress(OSError, TypeError):
            if list(_ident(ckpt_dir / tag / rel)) == list(claimed[rel]):
                covered.add(rel)
    return tag, frozenset(covered), rels


def verified_newest(ckpt_dir: Path, run_dir: Path, attempt: int, world: int) -> str | None:
    """The newest tag when the standby ranks together checked every one of its files (`verified_files`)."""
    got = verified_files(ckpt_dir, run_dir, attempt, world)
    return got[0] if got is not None and got[1] == got[2] else None
