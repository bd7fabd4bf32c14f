"""Host-memory snapshots of a rank's checkpoint state for the asynchronous writer (saving.AsyncCheckpointWriter):
pinned buffers kept between saves (`PinnedPool`), the copy itself (`host_snapshot`), and the optional device
staging of a save whose buffers do not exist yet (`device_snapshot` + `to_host`); and `SnapshotPool`, registered
pageable memory built in the background at attempt start, which the copy uses first. torch is imported lazily.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

#: Free GPU memory (outside torch's reserve) a device-staged snapshot must leave.
DEVICE_STAGING_MARGIN_BYTES = 4 << 30


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
                  taken: list[Any] | None = None, arena: SnapshotPool | None = None) -> Any:
    """A copy of a state dict whose tensors live in host memory (pinned for device tensors when asked), so
    training may change the originals while the copy is written. Non-tensor leaves are deep-copied.
    Device tensors go into `arena`'s views first (a ready SnapshotPool with room); the others into `pool`'s
    buffers (their list is appended to `taken`, to be given back once written), or fresh ones without it."""
    import copy

    import torch

    cuda_seen = False

    def walk(x: Any) -> Any:
        nonlocal cuda_seen
        if isinstance(x, torch.Tensor):
            t = x.detach()
            pin = pin_memory and t.is_cuda
            cuda_seen = cuda_seen or t.is_cuda
            out = arena.take(t) if arena is not None and t.is_cuda else None
            if out is not None:
                arena.copy_into(out, t)   # type: ignore[union-attr]
                return out
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


# --------------------------------------------------------------------- registered snapshot pool
#: Alignment of each view carved from the snapshot pool (any dtype's element size divides it).
POOL_ALIGN_BYTES = 256
#: Bytes registered per cudaHostRegister call by default: the call stalls the training stream about as long
#: as it runs; on the H200 host (bench/results/gpu_call11_probe.log, 17 GiB) 256 MiB chunks stalled a GPU loop
#: <= 93 ms each, ~1.5 s in all, where 4 GiB chunks stalled it 0.71 s each.
POOL_CHUNK_BYTES = 256 << 20
#: Seconds the pool's builder rests between chunks by default, so the stalls are spread over many steps.
POOL_PAUSE_S = 0.05


class HostRegistrar(Protocol):
    """The seam to the driver: page-lock a range of host memory for DMA, and undo it. Real: CudaHostRegistrar;
    tests: a fake that records the calls."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaHostRegistrar:
    """cudaHostRegister / cudaHostUnregister through torch's cudart bindings (they release the GIL). The
    registration is made with `device` current: it counts for that device's context."""

    def __init__(self, device: int) -> None:
        self.device = device

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        import torch

        with torch.cuda.device(self.device):
            err = fn()
        code = int(err)
        if code != 0:
            raise RuntimeError(f"{what} failed on cuda:{self.device}: CUDA error {code} "
                               f"({torch.cuda.cudart().cudaGetErrorString(err)})")

    def register(self, ptr: int, nbytes: int) -> None:
        import torch

        self._call(f"cudaHostRegister of {nbytes} bytes at {ptr:#x}",
                   lambda: torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))

    def unregister(self, ptr: int) -> None:
        import torch

        self._call(f"cudaHostUnregister at {ptr:#x}", lambda: torch.cuda.cudart().cudaHostUnregister(ptr))


def aligned_bytes(nbytes: int) -> int:
    """`nbytes` rounded up to POOL_ALIGN_BYTES: what one tensor takes in the pool."""
    return -(-nbytes // POOL_ALIGN_BYTES) * POOL_ALIGN_BYTES


def snapshot_pool_bytes(objs: list[Any], device_only: bool = True) -> int:
    """Pool bytes a snapshot of `objs` (state dicts) needs: each device tensor (each tensor, with
    device_only=False) rounded up to the alignment."""
    import torch

    total = 0
    stack = list(objs)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_cuda or not device_only:
                total += aligned_bytes(x.numel() * x.element_size())
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def engine_snapshot_bytes(engine: Any, device_only: bool = True) -> int:
    """snapshot_pool_bytes of what a DeepSpeed engine's save_checkpoint hands its checkpoint engine: the
    optimizer's state dict (ZeRO: fp32 partitions + optimizer states) and, below ZeRO-3, the module's weights.
    Under ZeRO-3 the save hands the module's parameters as empty placeholders (even the persistent ones that
    module.state_dict() shows whole), so only its buffers count there (small: the caller adds a margin).
    Cheap: the state dicts hold references, nothing is copied or gathered."""
    objs = [engine.optimizer.state_dict()]
    if not engine.zero_optimization_partition_weights():
        objs.append(engine.module.state_dict())
    return snapshot_pool_bytes(objs, device_only)


def tag_snapshot_bytes(files: dict[str, dict[str, Any]], world: int) -> int:
    """One rank's snapshot bytes estimated from a ZeRO tag's manifest `files` (before anything is loaded):
    the largest optimizer-states file plus the largest model-states file (a file holds its tensors' bytes and a
    little pickle). 0 when the tag was not written by `world` ranks (its partitions are not this run's)."""
    optim = [int(m["size"]) for name, m in files.items() if name.endswith("optim_states.pt")]
    model = [int(m["size"]) for name, m in files.items() if name.endswith("model_states.pt")]
    if len(optim) != world:
        return 0
    return max(optim) + max(model, default=0)


class SnapshotPool:
    """One rank's snapshot memory: one arena of pageable host memory, touched and registered with the driver
    chunk by chunk in a background thread, then carved into views of any dtype and shape at each save.

    Why not pinned allocations: `torch.empty(pin_memory=True)` (cudaHostAlloc) stalls the training stream
    for the whole allocation whichever thread calls it (0.58 s per GiB on the H200 host), so a 17 GB first
    snapshot blocked training 8-10 s. Filling pageable memory costs the GPU nothing, and registering it in
    chunks with pauses spreads the smaller stall of cudaHostRegister over many steps; copies into registered
    memory run as fast as into pinned memory (bench/RESULTS.md, call 10).
    States: "filling" -> "ready" (usable) or "failed: why" (nothing held); "released" after release().
    One save at a time carves it: reset() at the next save frees every view of the previous one."""

    def __init__(self, nbytes: int, registrar: HostRegistrar, *, chunk_bytes: int = POOL_CHUNK_BYTES,
                 pause_s: float = POOL_PAUSE_S, name: str = "snapshot-pool") -> None:
        if nbytes <= 0:
            raise ValueError(f"snapshot pool size must be positive, got {nbytes} bytes")
        if chunk_bytes <= 0 or chunk_bytes % POOL_ALIGN_BYTES:
            raise ValueError(f"snapshot pool chunk of {chunk_bytes} bytes: must be a positive multiple of "
                             f"{POOL_ALIGN_BYTES}")
        self.nbytes = aligned_bytes(nbytes)
        self.chunk_bytes = chunk_bytes
        self.pause_s = pause_s
        self.registrar = registrar
        self.state = "filling"
        self.registered_bytes = 0     # bytes registered so far (== nbytes once ready)
        self.build_s = 0.0            # seconds the builder took (fill + register + pauses)
        self.register_s = 0.0         # of which inside cudaHostRegister
        self._arena: Any = None       # the anonymous mmap holding the memory (None once released)
        self._buffer: Any = None      # a uint8 tensor over all of it (the builder fills through it)
        self._base = 0                # its address (page-aligned)
        self._registered: list[int] = []   # chunk addresses, in registration order
        self._offset = 0              # carving position of the save being collected
        self.used_bytes = 0           # bytes of tensors carved since reset() (without the alignment padding)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._build, daemon=True, name=name)

    def start(self) -> SnapshotPool:
        self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.state == "ready"

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the pool is ready (True) or `timeout_s` passes or it failed (False)."""
        self._ready.wait(timeout_s)
        return self.ready

    def describe(self) -> str:
        """The pool's state in words, for a save's event and log line."""
        if self.state == "filling":
            return f"filling ({self.registered_bytes / 1e9:.2f} of {self.nbytes / 1e9:.2f} GB registered)"
        return self.state

    def _build(self) -> None:
        import torch

        t0 = time.monotonic()
        try:
            # Anonymous pageable memory, nothing touched yet. An mmap rather than one torch tensor: each view is
            # then a tensor over its own bytes (torch.frombuffer), so torch.save writes that tensor's bytes,
            # where a slice of one big tensor would write the whole arena's storage with every shard.
            self._arena = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE)   # like malloc's large blocks
            buffer = torch.frombuffer(self._arena, dtype=torch.uint8)
            self._buffer, self._base = buffer, buffer.data_ptr()
            for start in range(0, self.nbytes, self.chunk_bytes):
                if self._stop.is_set():
                    return
                end = min(start + self.chunk_bytes, self.nbytes)
                buffer[start:end].fill_(0)   # fault the pages in here, not in the driver's call
                t1 = time.monotonic()
                self.registrar.register(self._base + start, end - start)
                self.register_s += time.monotonic() - t1
                self._registered.append(self._base + start)
                self.registered_bytes = end
                if end < self.nbytes and self.pause_s > 0 and self._stop.wait(self.pause_s):
                    return
            self.state = "ready"
        except Exception as exc:  # noqa: BLE001 - a failed build holds nothing; saves use pinned buffers
            self.state = f"failed: {type(exc).__name__}: {exc}"[:300]
            self._unregister_and_free()
        finally:
            self.build_s = time.monotonic() - t0
            self._ready.set()

    def reset(self) -> None:
        """The previous save is written: every view it took is free again."""
        self._offset = self.used_bytes = 0

    def take(self, like: Any) -> Any | None:
        """A view of the pool shaped and typed like `like`, or None (not ready, or no room left)."""
        if not self.ready:
            return None
        import torch

        nbytes = like.numel() * like.element_size()
        if self._offset + nbytes > self.nbytes:
            return None
        start = self._offset
        self._offset += aligned_bytes(nbytes)
        self.used_bytes += nbytes
        if nbytes == 0:
            return torch.empty(like.shape, dtype=like.dtype)   # holds no bytes: nothing to carve
        return torch.frombuffer(self._arena, dtype=like.dtype, count=like.numel(), offset=start).view(like.shape)

    def copy_into(self, out: Any, src: Any) -> None:
        """out.copy_(src) from the device, split where the pool's registrations meet (each piece lies inside
        one registered range, so each is one direct DMA)."""
        start = out.data_ptr() - self._base
        if not src.is_contiguous() or start // self.chunk_bytes == (start + out.nbytes - 1) // self.chunk_bytes:
            out.copy_(src, non_blocking=True)
            return
        flat_out, flat_src, size = out.view(-1), src.view(-1), out.element_size()
        pos = 0   # elements
        while pos < flat_out.numel():
            room = (self.chunk_bytes - (start + pos * size) % self.chunk_bytes) // size
            n = min(room, flat_out.numel() - pos)
            flat_out[pos:pos + n].copy_(flat_src[pos:pos + n], non_blocking=True)
            pos += n

    def release(self, timeout_s: float = 30.0) -> bool:
        """Stop the builder, unregister every chunk, then free the memory. False if the builder did not stop
        within `timeout_s` (then nothing is freed: the driver may still be registering a chunk of it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        self._unregister_and_free()
        self.state = "released"
        return True

    def _unregister_and_free(self) -> None:
        # Unregister before the memory goes: freed pages still registered would stay locked in the driver.
        while self._registered:
            self.registrar.unregister(self._registered.pop())
        self.registered_bytes = 0
        # The mmap is unmapped once the last tensor over it is gone (views still being written keep it).
        self._buffer = self._arena = None
