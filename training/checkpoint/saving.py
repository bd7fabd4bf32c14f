"""Checkpoint saves: what a failed write looks like (errno, free bytes, the `checkpoint_save_failed` fields),
and the asynchronous writer that keeps DeepSpeed's file layout and commits the manifest once every rank is durable.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..durable import atomic_write_text, fsync_dir
from .digests import digest_mode
from .files import (
    DIGEST_CHUNK_BYTES,
    MANIFEST_NAME,
    point_latest_to,
    write_manifest,
)
from .retention import bytes_free, existing_ancestor
from .shard_io import write_shard, write_shard_direct
from .snapshot import (
    DEVICE_STAGING_MARGIN_BYTES,
    POOL_CHUNK_BYTES,
    POOL_PAUSE_S,
    HostRegistrar,
    PinnedPool,
    SnapshotPool,
    device_snapshot,
    device_tensor_bytes,
    host_snapshot,
    to_host,
)

log = logging.getLogger("ulyssesd.training")

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




def filesystem_errno(path: str | Path) -> int | None:
    """The errno a write under `path` most likely failed with, asked of the filesystem itself: EROFS when it
    is mounted read-only, ENOSPC when (nearly) full, EACCES when not writable; None when none applies."""
    try:
        st = os.statvfs(existing_ancestor(Path(path)))
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail * st.f_frsize < _NEARLY_FULL_BYTES:
        return errno.ENOSPC
    if not os.access(existing_ancestor(Path(path)), os.W_OK):
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


# ----------------------------------------------------------------------------- asynchronous saves
# Why our own writer: torch.distributed.checkpoint.async_save stages and writes DCP's own format (not the
# DeepSpeed files `load_checkpoint` reads); DeepSpeed's decoupled engine writes from a side process but
# records no sizes or checksums and writes no manifest resume could check. This one plugs in where DeepSpeed calls
# `checkpoint_engine.save(state_dict, path)`, keeps DeepSpeed's file layout, and commits our manifest only
# once every rank's shards are durable, so the previous tag stays the newest valid one until then.
DONE_PREFIX = ".done-rank"       # a rank's marker: all its shards of the tag are written and fsynced
FAILED_PREFIX = ".failed-rank"   # a rank's marker: its background write failed (rank 0's commit stops waiting)
COMMIT_POLL_S = 0.05             # how often rank 0's commit looks for the other ranks' markers
#: Host memory the snapshot pools of a host must leave free: the larger of this and POOL_RESERVE_FRACTION of RAM.
POOL_RESERVE_BYTES = 8 << 30
POOL_RESERVE_FRACTION = 0.10


def pool_refusal(nbytes: int, ranks_on_host: int, available_bytes: int, total_bytes: int) -> str | None:
    """Why a snapshot pool of `nbytes` per rank does not fit this host (every local rank builds one), or None."""
    reserve = max(POOL_RESERVE_BYTES, int(POOL_RESERVE_FRACTION * total_bytes))
    need = nbytes * ranks_on_host
    if need + reserve <= available_bytes:
        return None
    return (f"{ranks_on_host} x {nbytes / 1e9:.2f} GB of snapshot pools + {reserve / 1e9:.1f} GB reserve exceed the "
            f"{available_bytes / 1e9:.1f} GB of host memory available")


class AsyncSaveError(RuntimeError):
    """The previous background save failed; `failure` is save_failure()'s dict (errno, path, tag, rank)."""

    def __init__(self, failure: dict[str, Any]):
        super().__init__(f"background checkpoint save of {failure.get('tag')} failed on rank "
                         f"{failure.get('rank')}: {failure.get('errno')} ({failure.get('error')}) "
                         f"writing {failure.get('path')}")
        self.failure = failure


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
        failed = [r for r in missing if (tag_dir / f"{FAILED_PREFIX}{r}").exists()]
        if failed:
            raise RuntimeError(f"ranks {failed} failed writing {tag_dir.name}; the tag is left without a manifest "
                               "(not loadable)")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"ranks {missing} did not finish writing {tag_dir.name} within {timeout_s:g} s; "
                               "the tag is left without a manifest (not loadable)")
        time.sleep(COMMIT_POLL_S)
    known: dict[str, dict[str, Any]] = {}
    for r in range(world):   # each rank's marker holds the digests its writer took while writing
        known.update(_read_marker(tag_dir / f"{DONE_PREFIX}{r}"))
    for r in range(world):
        (tag_dir / f"{DONE_PREFIX}{r}").unlink(missing_ok=True)
    manifest = write_manifest(tag_dir, step, loss, samples_seen, config_version, extra, known=known)
    if point_latest:
        point_latest_to(tag_dir.parent, tag_dir.name)
    return manifest


def _read_marker(path: Path) -> dict[str, dict[str, Any]]:
    """A `.done-rank{r}` marker's digests ({relative path: {"size", "sha256"}}); {} for an empty or unreadable
    one (the manifest then hashes those files itself)."""
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items()   # v3: chunk digests alone, the writer's digest mode "chunks"
            if isinstance(v, dict) and (isinstance(v.get("sha256"), str) or isinstance(v.get("chunk_sha256"), list))} \
        if isinstance(data, dict) else {}


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer: one save in flight, back-pressure when the next is due.

        writer.begin(tag_dir)                  # waits for the previous save (raises AsyncSaveError if it failed)
        engine.checkpoint_engine.save = writer.collect   # DeepSpeed hands each shard: snapshot to host memory
        engine.save_checkpoint(...)            # returns once the snapshots are taken
        writer.start(commit=...)               # background: write + fsync each shard, marker, then commit()
        writer.committed                       # polled by the step loop: True once that commit returned

    `prepare_pool(nbytes, registrar)` (once the snapshot's size is known) builds a SnapshotPool in the
    background; collect() copies into it once it is ready and into pinned buffers (`pool`) until then, or for
    what does not fit: such a save loses nothing, it blocks for the pinned allocation and says so (`pool_fields`).

    `commit` (rank 0: `commit_when_durable`) runs in the background thread after this rank's shards are durable.
    `after_commit` (rank 0 of a job without the daemon: retention) runs there after it, off the training thread;
    its failure is logged, never a failed save (the tag is already durable).
    `write_hook(path)` runs before each shard is written (fault injection in tests).
    """

    def __init__(self, rank: int, *, pin_memory: bool = True, write_hook: Callable[[str], None] | None = None,
                 reuse_buffers: bool = True, flush_behind: bool = True, direct_io: bool = True,
                 device_staging: bool = False):
        self.rank = rank
        self.pin_memory = pin_memory
        self.write_hook = write_hook
        #: host buffers kept between saves (None: a fresh allocation every save); the memory stays held.
        self.pool: PinnedPool | None = PinnedPool() if reuse_buffers else None
        self.flush_behind = flush_behind
        #: shards written with O_DIRECT (write_shard_direct; buffered write_shard where False)
        self.direct_io = direct_io
        if direct_io:  # a bogus ULYSSESD_CKPT_DIGEST refuses the writer now, not every save of the run
            digest_mode()
        #: a save whose host buffers do not exist yet is cloned on the GPU when it has room (device_snapshot).
        #: Off by default: measured on the H200 (device call 9), the pinned allocation in the background thread
        #: stalls the training stream as long as it would have blocked the save (cudaHostAlloc), so it moves
        #: the ~0.55 s per GiB of a first save from the save to the next step instead of removing it.
        self.device_staging = device_staging
        self.last_staged_bytes = 0    # bytes of the last save cloned on the device (0: straight to host)
        self._taken: list[Any] = []   # pool buffers of the save being collected / written
        self._thread: Any = None
        self._failure: dict[str, Any] | None = None
        self._tag_dir: Path | None = None
        self._pending: list[tuple[Any, str, Any]] = []   # (snapshot, path, CUDA event of a device clone)
        self.last_bytes = 0          # bytes this rank wrote in its last save
        self.last_shards_s = 0.0     # last save: start of the background write -> this rank's marker written
        self.last_write_s = 0.0      # the same, + rank 0's commit (waiting for every rank, the manifest)
        self.last_alloc_bytes = 0    # host memory newly allocated by the last snapshot (0: all reused)
        self.last_after_commit_s = 0.0   # seconds the last save's after_commit (retention) took in this thread
        #: registered snapshot memory built at attempt start (prepare_pool); None: pinned buffers only
        self.snapshot_pool: SnapshotPool | None = None
        self.snapshot_pool_note = "off"   # why there is no snapshot pool ("off", "refused: ...")
        self.last_pool_bytes = 0          # bytes of the last save copied into the snapshot pool
        self.last_fallback_bytes = 0      # bytes of its device tensors that went to pinned buffers instead
        self.last_pool_state = "off"      # the pool's state when the last save was collected (describe())
        self._committed = threading.Event()   # set once the save in flight is durable (rank 0: committed)

    @property
    def committed(self) -> bool:
        """The save in flight is durable: this rank's shards and marker, and (given a commit) the commit returned.
        Non-blocking; False again from the next start()."""
        return self._committed.is_set()

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

    def take_failure(self) -> dict[str, Any] | None:
        """The finished save's failure (save_failure()'s dict), or None; cleared once taken. Call after wait()."""
        failure, self._failure = self._failure, None
        return failure

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
        self.last_staged_bytes = 0
        if self.pool is not None:
            self.pool.give_back(self._taken)   # the previous save is written: its buffers are free again
            self.pool.allocated_bytes = 0
        self._taken = []
        if self.snapshot_pool is not None:
            self.snapshot_pool.reset()   # the previous save is written: its views are free again
        self.last_pool_bytes = self.last_fallback_bytes = 0
        self.last_pool_state = self.snapshot_pool.describe() if self.snapshot_pool is not None \
            else self.snapshot_pool_note
        return waited

    def prepare_pool(self, nbytes: int, registrar: HostRegistrar, *, chunk_bytes: int = POOL_CHUNK_BYTES,
                     pause_s: float = POOL_PAUSE_S, ranks_on_host: int = 1,
                     memory: tuple[int, int] | None = None) -> str:
        """Start building a SnapshotPool of `nbytes` in the background (once; later calls change nothing),
        unless the host lacks the memory: then the saves keep using pinned buffers and the refusal is logged.
        `memory` = (available, total) host bytes (default: psutil's). Returns the pool's state in words."""
        if self.snapshot_pool is not None:
            return self.snapshot_pool.describe()
        if memory is None:
            import psutil

            vm = psutil.virtual_memory()
            memory = (int(vm.available), int(vm.total))
        refusal = pool_refusal(nbytes, ranks_on_host, *memory)
        if refusal is not None:
            self.snapshot_pool_note = f"refused: {refusal}"
            log.warning("rank %d: no snapshot pool (%s); async saves use pinned buffers allocated at the first "
                        "save (it blocks training ~0.55 s per GiB)", self.rank, refusal)
            return self.snapshot_pool_note
        self.snapshot_pool = SnapshotPool(nbytes, registrar, chunk_bytes=chunk_bytes, pause_s=pause_s,
                                          name=f"snapshot-pool-rank{self.rank}").start()
        log.info("rank %d: building a %.2f GB snapshot pool in the background (%d MiB chunks, %.0f ms apart)",
                 self.rank, nbytes / 1e9, chunk_bytes >> 20, pause_s * 1e3)
        return self.snapshot_pool.describe()

    def pool_fields(self) -> dict[str, Any]:
        """The last save's snapshot-pool fields of its `checkpoint_saved` event."""
        return {"snapshot_pool": self.last_pool_state, "snapshot_pool_bytes": self.last_pool_bytes,
                "snapshot_fallback_bytes": self.last_fallback_bytes}

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the save in flight, then give the snapshot pool back (unregistered, then freed). A write
        still running after `timeout_s` keeps the pool (its snapshot lives there)."""
        if not self.wait(timeout_s):
            log.warning("rank %d: the save in flight is still writing after %g s: the snapshot pool is kept",
                        self.rank, timeout_s)
            return
        if self.snapshot_pool is not None and self.snapshot_pool.release(timeout_s):
            self.snapshot_pool = None

    def collect(self, state_dict: Any, path: str) -> None:
        """DeepSpeed's `checkpoint_engine.save(state_dict, path)`: snapshot now, write in start()'s thread."""
        if self._tag_dir is None:
            raise RuntimeError("AsyncCheckpointWriter.collect called before begin()")
        if self._stage_on_device(state_dict):
            snap, event = device_snapshot(state_dict)
            self._pending.append((snap, str(path), event))
            self.last_staged_bytes += device_tensor_bytes(state_dict)[0]
            return
        arena = self.snapshot_pool
        used_before = arena.used_bytes if arena is not None else 0
        self._pending.append((host_snapshot(state_dict, self.pin_memory, self.pool, self._taken, arena),
                              str(path), None))
        self.last_alloc_bytes = self.pool.allocated_bytes if self.pool is not None else 0
        in_pool = (arena.used_bytes - used_before) if arena is not None else 0
        fallback = device_tensor_bytes(state_dict)[0] - in_pool
        if fallback and arena is not None and not self.last_fallback_bytes:   # one line per save
            log.warning("rank %d: snapshot pool %s: %.2f GB of %s went to pinned buffers (allocated now unless "
                        "kept from an earlier save)", self.rank,
                        arena.describe() if not arena.ready else "too small", fallback / 1e9, Path(path).name)
        self.last_pool_bytes += in_pool
        self.last_fallback_bytes += fallback

    def _stage_on_device(self, state_dict: Any) -> bool:
        """Clone on the GPU instead of copying to host now: only when the pool would have to allocate pinned
        memory (the slow part: ~0.55 s per GiB on the H200 host) and the GPU has the room outside what torch
        already reserves for training (its steady-state peak is inside that reserve)."""
        if not (self.device_staging and self.pin_memory and self.pool is not None) or self.pool.covers(state_dict):
            return False
        if self.snapshot_pool is not None and self.snapshot_pool.ready:
            return False   # the registered pool takes it at copy speed
        nbytes, count = device_tensor_bytes(state_dict)
        if not count:
            return False
        import torch

        free, _total = torch.cuda.mem_get_info()
        return free - nbytes >= DEVICE_STAGING_MARGIN_BYTES

    def start(self, commit: Callable[[], Any] | None = None, after_commit: Callable[[], Any] | None = None) -> None:
        """Write the collected snapshots in a background thread; then this rank's marker; then `commit`; then
        `after_commit` (see the class docstring)."""
        if self._tag_dir is None:
            raise RuntimeError("AsyncCheckpointWriter.start called before begin()")
        tag_dir, pending = self._tag_dir, self._pending
        self._pending = []
        self._committed.clear()
        self._thread = threading.Thread(target=self._write, args=(tag_dir, pending, commit, after_commit),
                                        daemon=True, name=f"ckpt-writer-{tag_dir.name}")
        self._thread.start()

    def _write(self, tag_dir: Path, pending: list[tuple[Any, str, Any]], commit: Callable[[], Any] | None,
               after_commit: Callable[[], Any] | None = None) -> None:
        t0, total, path = time.monotonic(), 0, str(tag_dir)
        try:
            tag_dir.mkdir(parents=True, exist_ok=True)
            digests: dict[str, dict[str, Any]] = {}
            for i, (obj, path, event) in enumerate(pending):
                if event is not None:   # cloned on the device: to pinned host memory first, then free the clones
                    obj = to_host(obj, event, self.pool, self._taken)
                    pending[i] = (None, path, None)
                if self.write_hook is not None:
                    self.write_hook(path)
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                chunks: list[str] = []   # the O_DIRECT writer's per-chunk digests (the buffered one has none)
                size, sha = (write_shard_direct(obj, path, chunk_digests=chunks) if self.direct_io
                             else write_shard(obj, path, flush_behind=self.flush_behind))
                del obj
                total += size
                try:
                    digests[Path(path).relative_to(tag_dir).as_posix()] = {"size": size} | (
                        {"sha256": sha} if sha is not None else {}) | (
                        {"chunk_bytes": DIGEST_CHUNK_BYTES, "chunk_sha256": chunks} if self.direct_io else {})
                except ValueError:   # a shard outside the tag directory: the manifest does not list it
                    pass
            pending.clear()   # drop the snapshots (pool buffers are kept by the pool, the rest freed)
            fsync_dir(tag_dir)
            path = str(tag_dir / f"{DONE_PREFIX}{self.rank}")
            atomic_write_text(Path(path), json.dumps(digests))
            self.last_shards_s = time.monotonic() - t0
            if commit is not None:
                path = str(tag_dir / MANIFEST_NAME)
                commit()
        except Exception as exc:  # noqa: BLE001 - any failure is recorded and raised by the next begin()
            self._failure = save_failure(exc, path, tag_dir.name, self.rank) if isinstance(exc, OSError) else {
                "errno": None, "error": f"{type(exc).__name__}: {exc}", "path": path, "tag": tag_dir.name,
                "rank": self.rank, "bytes_free": bytes_free(tag_dir)}
            try:   # best effort (the disk may refuse even this): rank 0's commit then stops waiting for us
                (tag_dir / f"{FAILED_PREFIX}{self.rank}").touch()
            except OSError:
                pass
            self.last_bytes, self.last_write_s = total, time.monotonic() - t0
            return
        self.last_bytes, self.last_write_s = total, time.monotonic() - t0
        self._committed.set()   # after the figures above: whoever sees it may report them
        if after_commit is not None:
            t1 = time.monotonic()
            try:
                after_commit()
            except Exception as exc:  # noqa: BLE001 - e.g. retention hit a busy dir: the next save's retention retries
                log.warning("after the commit of %s: %s: %s", tag_dir.name, type(exc).__name__, exc)
            self.last_after_commit_s = time.monotonic() - t1
