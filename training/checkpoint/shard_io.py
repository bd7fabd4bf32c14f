"""How the asynchronous writer puts one shard on disk: torch.save streamed through a file object that hashes
(sha256) on the way, with O_DIRECT from aligned buffers (`write_shard_direct`, the default) or through the page
cache with flush-behind (`write_shard`); temp file, fsync, rename. torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import IO, Any, cast

from ..durable import atomic_write
from .digests import DIGEST_MODES, digest_mode
from .files import DIGEST_CHUNK_BYTES


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


#: O_DIRECT writes bypass the page cache: on the H200 host the buffered path (page cache, then writeback) wrote
#: 0.91 GB/s where `dd oflag=direct` wrote 1.49 GB/s (bench/RESULTS.md, device call 8). Writes are staged in
#: aligned buffers; each buffer's chunk digest is taken by a pool while the write thread writes it.
DIRECT_ALIGN = 4096
#: One buffer is one manifest chunk: the chunk digests are taken per buffer, at offsets that are multiples of it.
DIRECT_BUFFER_BYTES = DIGEST_CHUNK_BYTES
#: Threads taking the chunk digests (one sha256 stream runs at ~1.24 GB/s on the H200 host's cores, below its
#: 1.49 GB/s disk: no single stream may be on the write's path; 4 leave room for a GIL-busy training thread).
CHUNK_HASH_THREADS = 4
#: Buffers of DIRECT_BUFFER_BYTES per writer: one being filled, the rest being hashed and written.
DIRECT_BUFFERS = 6
_QUEUE_POLL_S = 1.0


class _DirectPipelineFile:
    """A write-only file object for torch.save: bytes are copied into page-aligned buffers; a hash thread
    takes each full buffer in order, hands it to a pool for its own chunk digest (and, digest mode "whole"
    only, feeds the whole-file sha256, one serial stream), then a write thread writes it with O_DIRECT (pwrite
    at its offset) while its digest is taken and returns it once both are done. The
    last, partial block is written without O_DIRECT. Falls back to buffered
    writes where the filesystem refuses O_DIRECT (tmpfs). `close()` joins both threads, fsyncs, and
    raises the first error either thread met."""

    def __init__(self, path: Path, direct: bool = True, mode: str = "chunks"):
        import hashlib
        import mmap
        import queue
        from concurrent.futures import ThreadPoolExecutor

        if mode not in DIGEST_MODES:
            raise ValueError(f"checkpoint digest mode {mode!r}: expected one of {', '.join(DIGEST_MODES)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        #: the whole-file sha256 (mode "whole" only; None in mode "chunks": each byte is hashed once, per chunk)
        self.sha = hashlib.sha256() if mode == "whole" else None
        self.size = 0
        #: sha256 of each DIRECT_BUFFER_BYTES chunk of the file, in order (the manifest's `chunk_sha256`)
        self.chunk_sha256: list[str] = []
        self._chunk_pool = ThreadPoolExecutor(max_workers=CHUNK_HASH_THREADS, thread_name_prefix="ckpt-chunk-hash")
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
            buf, n, off = item
            chunk = None
            if self._error is None:
                try:
                    chunk = self._chunk_pool.submit(_chunk_digest, buf, n)
                    if self.sha is not None:
                        with memoryview(buf) as view:
                            self.sha.update(view[:n])
                except BaseException as exc:  # noqa: BLE001 - handed to the producer
                    self._error = exc
            self._to_write.put((buf, n, off, chunk))

    def _write_loop(self) -> None:
        import fcntl

        while True:
            item = self._to_write.get()
            if item is None:
                return
            buf, n, off, chunk = item
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
            try:
                if chunk is not None:   # in order: the write loop takes the buffers as the hash loop sent them
                    self.chunk_sha256.append(chunk.result())
            except BaseException as exc:  # noqa: BLE001 - handed to the producer
                self._error = self._error or exc
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
            self._chunk_pool.shutdown()
            os.close(self.fd)
            while not self._free.empty():
                with contextlib.suppress(BufferError):   # a view still alive: the mmap goes with the GC
                    self._free.get().close()


def _chunk_digest(buf: Any, n: int) -> str:
    import hashlib

    with memoryview(buf) as view:
        return hashlib.sha256(view[:n]).hexdigest()


def write_shard_direct(obj: Any, path: str | Path, chunk_digests: list[str] | None = None,
                       mode: str | None = None) -> tuple[int, str | None]:
    """write_shard through _DirectPipelineFile: temp file written with O_DIRECT (chunk digests taken in a
    pool meanwhile), fsync, rename, fsync of the directory. `mode`: the digest mode (None: digest_mode(), the
    env switch). Returns (size, whole-file sha256 hex: mode "whole", or a file of one chunk; else None);
    `chunk_digests`, when given, is filled with the sha256 of each DIGEST_CHUNK_BYTES chunk (the manifest's
    `chunk_sha256`)."""
    import torch

    from ..durable import durable_replace, temp_path_for

    path = Path(path)
    tmp = temp_path_for(path)
    try:
        f = _DirectPipelineFile(tmp, mode=digest_mode() if mode is None else mode)
        try:
            with _CRC_LOCK:
                crc = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
                try:
                    torch.save(obj, cast(IO[bytes], f))  # a write()/flush() file-like is all torch.save uses
                finally:
                    torch.serialization.set_crc32_options(crc)
        finally:
            f.close()
        durable_replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if chunk_digests is not None:
        chunk_digests[:] = f.chunk_sha256
    if f.sha is not None:
        return f.size, f.sha.hexdigest()
    # a file of one chunk (or none): its chunk digest is its whole-file sha256, which small files keep
    return f.size, (f.chunk_sha256[0] if f.chunk_sha256 else hashlib.sha256(b"").hexdigest()) \
        if len(f.chunk_sha256) <= 1 else None


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
                    torch.save(obj, cast(IO[bytes], hashing))
                finally:
                    torch.serialization.set_crc32_options(crc)
            hashing.flush()
        finally:
            if behind is not None:
                behind.stop()
        out["size"], out["sha256"] = hashing.size, hashing.sha.hexdigest()

    atomic_write(path, write)
    return out["size"], out["sha256"]
