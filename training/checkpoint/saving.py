"""Checkpoint saves: what a failed write looks like (errno, free bytes, the `checkpoint_save_failed` fields),
and the asynchronous writer that keeps DeepSpeed's file layout and commits the manifest once every rank is durable.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..durable import atomic_write, atomic_write_text, fsync_dir
from .files import (
    MANIFEST_NAME,
    point_latest_to,
    write_manifest,
)
from .retention import bytes_free, existing_ancestor

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


class AsyncSaveError(RuntimeError):
    """The previous background save failed; `failure` is save_failure()'s dict (errno, path, tag, rank)."""

    def __init__(self, failure: dict[str, Any]):
        super().__init__(f"background checkpoint save of {failure.get('tag')} failed on rank "
                         f"{failure.get('rank')}: {failure.get('errno')} ({failure.get('error')}) "
                         f"writing {failure.get('path')}")
        self.failure = failure


class PinnedPool:
    """Host buffers of one rank's snapshots, kept between saves and handed out again by (dtype, shape).

    Allocating pinned memory is the slow part of a first snapshot (the driver locks every page); the copy
    itself runs at PCIe speed. The state dicts of successive saves have the same tensors, so every save after
    the first takes its buffers from here and only copies. Used by one thread at a time: the writer takes
    buffers in collect() and gives them back only after the background write ended (begin() waits for it)."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, tuple[int, ...], bool], list[Any]] = {}
        self.held_bytes = 0        # bytes of host memory the pool owns (free or lent out)
        self.allocated_bytes = 0   # bytes allocated by the last snapshot (0 once every buffer is reused)

    def take(self, like: Any, pin: bool) -> Any:
        import torch

        key = (like.dtype, tuple(like.shape), pin)
        free = self._free.get(key)
        if free:
            return free.pop()
        nbytes = like.numel() * like.element_size()
        self.held_bytes += nbytes
        self.allocated_bytes += nbytes
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)

    def covers(self, obj: Any) -> bool:
        """Whether every device tensor of `obj` has a free buffer here (a snapshot would allocate nothing)."""
        import torch

        need: dict[tuple[Any, tuple[int, ...], bool], int] = {}
        stack = [obj]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                if x.is_cuda:
                    key = (x.dtype, tuple(x.shape), True)
                    need[key] = need.get(key, 0) + 1
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
        return all(len(self._free.get(k, ())) >= n for k, n in need.items())

    def give_back(self, tensors: list[Any]) -> None:
        for t in tensors:
            self._free.setdefault((t.dtype, tuple(t.shape), t.is_pinned()), []).append(t)

    def clear(self) -> None:
        """Drop every free buffer (the memory goes back to torch's host allocator)."""
        self._free.clear()
        self.held_bytes = 0


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """`obj` with every tensor leaf replaced by fn(tensor); other leaves deep-copied, containers rebuilt."""
    import copy

    import torch

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, dict):
            items = {k: walk(v) for k, v in x.items()}
            return items if type(x) is dict else type(x)(items)   # OrderedDict (module state dicts) stays one
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(walk(v) for v in x)
        return copy.deepcopy(x)

    return walk(obj)


def device_tensor_bytes(obj: Any) -> tuple[int, int]:
    """(bytes of the device tensors in `obj`, how many there are) - what a snapshot of it copies."""
    import torch

    total, count = 0, 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                total, count = total + x.numel() * x.element_size(), count + 1
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total, count


def device_snapshot(obj: Any) -> tuple[Any, Any]:
    """A copy of a state dict whose device tensors are cloned on the device (microseconds per GB): for a save
    whose host buffers do not exist yet, so training does not wait for pinned memory to be allocated.
    Returns (copy, CUDA event after the clones); `to_host` moves it to host memory later."""
    import torch

    snap = _map_tensors(obj, lambda t: t.detach().clone())
    event = torch.cuda.Event()
    event.record()
    return snap, event


def to_host(obj: Any, event: Any, pool: PinnedPool | None, taken: list[Any]) -> Any:
    """The background half of device_snapshot: wait for the clones (`event`), copy each device tensor into a
    pinned host buffer (from `pool`, allocated now if it has none) on a side stream, then drop the clones."""
    import torch

    streams: dict[Any, Any] = {}

    def move(t: Any) -> Any:
        if not t.is_cuda:
            return t
        stream = streams.get(t.device)
        if stream is None:
            stream = streams[t.device] = torch.cuda.Stream(device=t.device)
            stream.wait_event(event)
        with torch.cuda.device(t.device), torch.cuda.stream(stream):
            out = pool.take(t, True) if pool is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            taken.append(out)
            out.copy_(t, non_blocking=True)
        return out

    host = _map_tensors(obj, move)
    for stream in streams.values():
        stream.synchronize()   # the copies landed: the clones may go (their memory returns to torch's cache)
    return host


def host_snapshot(obj: Any, pin_memory: bool = True, pool: PinnedPool | None = None,
                  taken: list[Any] | None = None) -> Any:
    """A copy of a state dict whose tensors live in host memory (pinned for device tensors when asked), so
    training may change the originals while the copy is written. Non-tensor leaves are deep-copied.
    With `pool`, device tensors are copied into the pool's buffers (their list is appended to `taken`, to be
    given back once written)."""
    import copy

    import torch

    cuda_seen = False

    def walk(x: Any) -> Any:
        nonlocal cuda_seen
        if isinstance(x, torch.Tensor):
            t = x.detach()
            pin = pin_memory and t.is_cuda
            cuda_seen = cuda_seen or t.is_cuda
            if pool is not None and t.is_cuda:
                out = pool.take(t, pin)
                if taken is not None:
                    taken.append(out)
            else:
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


#: Bytes per write() of a background shard: each piece is hashed, then written (the GIL is free meanwhile).
WRITE_CHUNK_BYTES = 64 << 20
#: How often the flush-behind thread asks the disk to catch up while a shard is being written.
FLUSH_BEHIND_EVERY_S = 0.25


class _HashingFile:
    """A write-only file object for torch.save that hashes every byte on its way to the file, so the
    manifest's sha256 needs no second read of a shard the size of the GPU's optimizer partition."""

    def __init__(self, fh: Any):
        import hashlib

        self._fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for off in range(0, len(view), WRITE_CHUNK_BYTES):
            piece = view[off:off + WRITE_CHUNK_BYTES]
            self.sha.update(piece)
            self._fh.write(piece)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()

    def tell(self) -> int:
        return self.size


class _FlushBehind:
    """While a big file is written through the page cache, fdatasync it every FLUSH_BEHIND_EVERY_S from a
    side thread: the disk writes from the first second instead of only once the kernel's dirty threshold
    (10 % of RAM by default) is reached, so the final fsync finds little left to do."""

    def __init__(self, fd: int):
        self._fd, self._stop = fd, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckpt-flush-behind")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_BEHIND_EVERY_S):
            try:
                os.fdatasync(self._fd)
            except OSError:   # the writer's own fsync reports what matters
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


#: Free GPU memory (outside torch's reserve) a device-staged snapshot must leave.
DEVICE_STAGING_MARGIN_BYTES = 4 << 30
#: O_DIRECT writes bypass the page cache: on the H200 host the buffered path (page cache, then writeback) wrote
#: 0.91 GB/s where `dd oflag=direct` wrote 1.49 GB/s (bench/RESULTS.md, device call 8). Writes are staged in
#: aligned buffers; hashing and writing run in two threads, one buffer behind the other.
DIRECT_ALIGN = 4096
DIRECT_BUFFER_BYTES = 64 << 20
DIRECT_BUFFERS = 4
_QUEUE_POLL_S = 1.0


class _DirectPipelineFile:
    """A write-only file object for torch.save: bytes are copied into page-aligned buffers; a hash thread
    takes each full buffer in order (sha256), then a write thread writes it with O_DIRECT (pwrite at its
    offset) and returns it. The last, partial block is written without O_DIRECT. Falls back to buffered
    writes where the filesystem refuses O_DIRECT (tmpfs). `close()` joins both threads, fsyncs, and
    raises the first error either thread met."""

    def __init__(self, path: Path, direct: bool = True):
        import hashlib
        import mmap
        import queue

        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        self.sha = hashlib.sha256()
        self.size = 0
        self._error: BaseException | None = None
        self._free: queue.Queue[Any] = queue.Queue()
        for _ in range(DIRECT_BUFFERS):
            self._free.put(mmap.mmap(-1, DIRECT_BUFFER_BYTES))
        self._to_hash: queue.Queue[Any] = queue.Queue()
        self._to_write: queue.Queue[Any] = queue.Queue()
        self._cur = self._take()
        self._fill = 0
        self._offset = 0
        self._threads = [threading.Thread(target=self._hash_loop, daemon=True, name="ckpt-hash"),
                         threading.Thread(target=self._write_loop, daemon=True, name="ckpt-write")]
        for t in self._threads:
            t.start()

    def _take(self) -> Any:
        import queue

        while True:
            self._raise_if_failed()
            try:
                return self._free.get(timeout=_QUEUE_POLL_S)
            except queue.Empty:
                continue

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _hash_loop(self) -> None:
        while True:
            item = self._to_hash.get()
            if item is None:
                self._to_write.put(None)
                return
            buf, n, _off = item
            if self._error is None:
                try:
                    with memoryview(buf) as view:
                        self.sha.update(view[:n])
                except BaseException as exc:  # noqa: BLE001 - handed to the producer
                    self._error = exc
            self._to_write.put(item)

    def _write_loop(self) -> None:
        import fcntl

        while True:
            item = self._to_write.get()
            if item is None:
                return
            buf, n, off = item
            try:
                if self._error is None:
                    with memoryview(buf) as view:
                        whole = n - n % DIRECT_ALIGN if self.direct else n
                        done = 0
                        while done < whole:
                            done += os.pwrite(self.fd, view[done:whole], off + done)
                        if whole < n:   # the file's last partial block: O_DIRECT needs whole blocks
                            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                            while done < n:
                                done += os.pwrite(self.fd, view[done:n], off + done)
            except BaseException as exc:  # noqa: BLE001 - handed to the producer
                self._error = exc
            self._free.put(buf)

    def _submit(self) -> None:
        self._to_hash.put((self._cur, self._fill, self._offset))
        self._offset += self._fill
        self._cur, self._fill = None, 0

    def write(self, data: Any) -> int:
        import numpy as np

        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        pos = 0
        while pos < len(src):
            if self._cur is None:
                self._cur = self._take()
            room = DIRECT_BUFFER_BYTES - self._fill
            n = min(room, len(src) - pos)
            dst = np.frombuffer(self._cur, dtype=np.uint8)
            dst[self._fill:self._fill + n] = src[pos:pos + n]   # numpy copies without holding the GIL
            del dst
            self._fill += n
            pos += n
            if self._fill == DIRECT_BUFFER_BYTES:
                if self._offset % DIRECT_ALIGN:
                    raise AssertionError("direct write offset lost its alignment")
                self._submit()
        self.size += len(src)
        return len(src)

    def flush(self) -> None:
        self._raise_if_failed()

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        """Write what is left, join the threads, fsync, close; raises the first error of any stage."""
        try:
            if self._cur is not None and self._fill:
                self._submit()
            self._to_hash.put(None)
            for t in self._threads:
                t.join()
            self._raise_if_failed()
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            while not self._free.empty():
                with contextlib.suppress(BufferError):   # a view still alive: the mmap goes with the GC
                    self._free.get().close()


def write_shard_direct(obj: Any, path: str | Path) -> tuple[int, str]:
    """write_shard through _DirectPipelineFile: temp file written with O_DIRECT (hash in a parallel thread),
    fsync, rename, fsync of the directory. Returns (size, sha256 hex)."""
    import torch

    from ..durable import durable_replace, temp_path_for

    path = Path(path)
    tmp = temp_path_for(path)
    try:
        f = _DirectPipelineFile(tmp)
        try:
            with _CRC_LOCK:
                crc = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
                try:
                    torch.save(obj, f)
                finally:
                    torch.serialization.set_crc32_options(crc)
        finally:
            f.close()
        durable_replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return f.size, f.sha.hexdigest()


_CRC_LOCK = threading.Lock()   # torch's crc32 switch is process-wide


def write_shard(obj: Any, path: str | Path, *, flush_behind: bool = True) -> tuple[int, str]:
    """The background writer's torch.save: temp file, fsync, rename, with the sha256 taken on the way.
    torch's own per-record crc32 is skipped (the manifest's sha256 covers every byte; torch.load does not
    need the crc). Returns (size, sha256 hex)."""
    import torch

    path = Path(path)
    out: dict[str, Any] = {}

    def write(fh: Any) -> None:
        hashing = _HashingFile(fh)
        behind = _FlushBehind(fh.fileno()) if flush_behind else None
        try:
            with _CRC_LOCK:   # the crc switch is process-wide: set and restored under one lock
                crc = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
                try:
                    torch.save(obj, hashing)
                finally:
                    torch.serialization.set_crc32_options(crc)
            hashing.flush()
        finally:
            if behind is not None:
                behind.stop()
        out["size"], out["sha256"] = hashing.size, hashing.sha.hexdigest()

    atomic_write(path, write)
    return out["size"], out["sha256"]


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
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)} \
        if isinstance(data, dict) else {}


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer: one save in flight, back-pressure when the next is due.

        writer.begin(tag_dir)                  # waits for the previous save (raises AsyncSaveError if it failed)
        engine.checkpoint_engine.save = writer.collect   # DeepSpeed hands each shard: snapshot to host memory
        engine.save_checkpoint(...)            # returns once the snapshots are taken
        writer.start(commit=...)               # background: write + fsync each shard, marker, then commit()

    `commit` (rank 0: `commit_when_durable`) runs in the background thread after this rank's shards are durable.
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
        return waited

    def collect(self, state_dict: Any, path: str) -> None:
        """DeepSpeed's `checkpoint_engine.save(state_dict, path)`: snapshot now, write in start()'s thread."""
        if self._tag_dir is None:
            raise RuntimeError("AsyncCheckpointWriter.collect called before begin()")
        if self._stage_on_device(state_dict):
            snap, event = device_snapshot(state_dict)
            self._pending.append((snap, str(path), event))
            self.last_staged_bytes += device_tensor_bytes(state_dict)[0]
            return
        self._pending.append((host_snapshot(state_dict, self.pin_memory, self.pool, self._taken), str(path), None))
        self.last_alloc_bytes = self.pool.allocated_bytes if self.pool is not None else 0

    def _stage_on_device(self, state_dict: Any) -> bool:
        """Clone on the GPU instead of copying to host now: only when the pool would have to allocate pinned
        memory (the slow part: ~0.55 s per GiB on the H200 host) and the GPU has the room outside what torch
        already reserves for training (its steady-state peak is inside that reserve)."""
        if not (self.device_staging and self.pin_memory and self.pool is not None) or self.pool.covers(state_dict):
            return False
        nbytes, count = device_tensor_bytes(state_dict)
        if not count:
            return False
        import torch

        free, _total = torch.cuda.mem_get_info()
        return free - nbytes >= DEVICE_STAGING_MARGIN_BYTES

    def start(self, commit: Callable[[], Any] | None = None) -> None:
        """Write the collected snapshots in a background thread; then this rank's marker; then `commit`."""
        if self._tag_dir is None:
            raise RuntimeError("AsyncCheckpointWriter.start called before begin()")
        tag_dir, pending = self._tag_dir, self._pending
        self._pending = []
        self._thread = threading.Thread(target=self._write, args=(tag_dir, pending, commit), daemon=True,
                                        name=f"ckpt-writer-{tag_dir.name}")
        self._thread.start()

    def _write(self, tag_dir: Path, pending: list[tuple[Any, str, Any]], commit: Callable[[], Any] | None) -> None:
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
                size, sha = (write_shard_direct(obj, path) if self.direct_io
                             else write_shard(obj, path, flush_behind=self.flush_behind))
                del obj
                total += size
                try:
                    digests[Path(path).relative_to(tag_dir).as_posix()] = {"size": size, "sha256": sha}
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
