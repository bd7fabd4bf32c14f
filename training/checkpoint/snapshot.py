"""Host-memory snapshots of a rank's checkpoint state for the asynchronous writer (saving.AsyncCheckpointWriter):
pinned buffers kept between saves (`PinnedPool`), the copy itself (`host_snapshot`), and the optional device
staging of a save whose buffers do not exist yet (`device_snapshot` + `to_host`). torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
