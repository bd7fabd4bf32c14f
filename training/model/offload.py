"""Checkpointed block inputs offloaded to host memory during forward, prefetched back during backward
(`model.offload_checkpoints`; DeepSpeed ALST's third ingredient for long sequences, docs/TRAINING.md).

With activation checkpointing the only per-block tensor kept for backward is each checkpointed chunk's input
(`[b, s/sp, h]` in the model dtype); over L blocks that is L·b·s/sp·h·d bytes, 96 GiB for gpt-1b at 1M
tokens. torch's non-reentrant checkpoint saves its tensor inputs through the saved-tensor hooks that are
active when `checkpoint(...)` is called (`_CheckpointFrame.save_inputs`), while the ops inside the region go
through the checkpoint's own hooks. So a `saved_tensors_hooks` context around each checkpoint call sees
exactly the chunk inputs, and nothing else, and composes with ZeRO-3's module hooks (they save nothing) and
with `checkpoint_keep_attention` (a context_fn inside the region). That is why this and not
DeepSpeed's `activation_checkpointing.cpu_checkpointing`, which lives in DeepSpeed's own checkpoint functions
(module-global flags; adopting it replaces torch's checkpoint and its selective `context_fn`), nor plain
`torch.autograd.graph.save_on_cpu(pin_memory=True)`, whose copies are queued on the compute stream (no
overlap), come back on demand in backward (no prefetch), and cover every saved tensor in its scope.

CUDA: the device-to-host copy runs on a side stream into pinned memory after that stream waits for the
compute stream; the GPU tensor stays referenced until its copy is done, and at most `max_in_flight` copies
are pending (older ones are waited for), so forward holds at most that many extra block inputs. In backward,
unpacking chunk i (just before its recompute) makes the compute stream wait for i's host-to-device copy and
starts chunk i-1's copy on the side stream (backward visits chunks in reverse): two chunk inputs on the GPU.
CPU: plain copies into fresh host tensors (the same code path, which the CPU tests exercise).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Entry:
    """One offloaded chunk input."""

    host: torch.Tensor | None           # the host copy (pinned on CUDA) until it is brought back
    device: torch.device
    gpu: torch.Tensor | None = None     # forward: the source kept alive until copied; backward: the prefetch
    copied: Any = None                  # CUDA event: device-to-host copy done
    ready: Any = None                   # CUDA event: host-to-device copy done


@dataclass
class OffloadStats:
    """What one forward pass offloaded (read by tests and the job's one-time log line)."""

    tensors: int = 0          # chunk inputs offloaded
    bytes: int = 0            # their bytes (the host memory they occupy until backward)
    restored: int = 0         # chunk inputs brought back in backward
    host_bytes: int = 0       # host memory taken for them (pinned blocks rounded up to a power of two)


class HostMemoryError(RuntimeError):
    """The offloaded inputs of one forward would not fit in the host RAM this rank may use."""


# Left to the OS, page cache and the rest of the process when checking the first forward's host budget.
HOST_RESERVE_BYTES = 2 << 30


def host_bytes_available() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def first_forward_host_budget() -> int | None:
    """Host bytes one rank may pin for its first forward: (MemAvailable - reserve) / ranks on this node.
    Only the first forward is checked: later ones reuse the pinned blocks torch's host cache keeps."""
    avail = host_bytes_available()
    if avail is None:
        return None
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, avail - HOST_RESERVE_BYTES) // ranks


def _pinned_bytes(nbytes: int) -> int:
    # torch's CUDA caching host allocator rounds pinned blocks up to a power of two (as the planner counts).
    return 1 << max(0, nbytes - 1).bit_length()


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device):
    # One copy stream per GPU, shared by all passes: copies are ordered among themselves.
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


@dataclass
class CheckpointInputOffloader:
    """Offloads the inputs of the checkpoints of ONE forward pass; make a new one per forward."""

    max_in_flight: int = 2                    # device-to-host copies pending before forward waits for the oldest
    host_budget: int | None = None            # host bytes this pass may take (None = unchecked)
    stats: OffloadStats = field(default_factory=OffloadStats)
    _entries: list[_Entry] = field(default_factory=list)
    _pending: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight} must be >= 1")

    def region(self, x: torch.Tensor):
        """Context for one `checkpoint(fn, x, ...)` call: offloads the saved tensor that is `x` (same storage,
        shape and dtype); other inputs (rotary tables shared by all blocks) are kept as they are."""
        if not x.requires_grad and x.grad_fn is None:
            return contextlib.nullcontext()

        # Identify x by value, not by reference: torch keeps the pack hook with every saved tensor, so a
        # closure over x itself would keep the device copy alive and free nothing.
        key = (x.data_ptr(), x.shape, x.dtype)

        def pack(t: torch.Tensor):
            return self._offload(t) if (t.data_ptr(), t.shape, t.dtype) == key else t

        return torch.autograd.graph.saved_tensors_hooks(pack, self._restore)

    # ------------------------------------------------------------------------------------ forward
    def _offload(self, t: torch.Tensor) -> int:
        nbytes = t.numel() * t.element_size()
        host = _pinned_bytes(nbytes) if t.is_cuda else nbytes
        if self.host_budget is not None and self.stats.host_bytes + host > self.host_budget:
            raise HostMemoryError(
                f"model.offload_checkpoints: checkpointed block input {self.stats.tensors + 1} needs "
                f"{host / 2**30:.2f} GiB more host RAM, {self.stats.host_bytes / 2**30:.2f} GiB are taken by the "
                f"earlier ones, and this rank may use {self.host_budget / 2**30:.2f} GiB (MemAvailable minus "
                f"{HOST_RESERVE_BYTES >> 30} GiB, over LOCAL_WORLD_SIZE ranks). `ulyssesctl plan` shows the host "
                "RAM the run needs; use more GPUs (SP or nodes), fewer checkpointed blocks, or turn the option off")
        entry = _Entry(host=None, device=t.device)
        if t.is_cuda:
            self._bound_in_flight()
            compute, side = torch.cuda.current_stream(t.device), _side_stream(t.device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                entry.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                entry.host.copy_(t, non_blocking=True)
                entry.copied = torch.cuda.Event()
                entry.copied.record(side)
            entry.gpu = t   # the allocator must not reuse t's memory before the copy has read it
            self._pending.append(entry)
        else:
            entry.host = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        self._entries.append(entry)
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        self.stats.host_bytes += host
        return len(self._entries) - 1

    def _bound_in_flight(self) -> None:
        while self._pending and self._pending[0].copied.query():
            self._pending.popleft().gpu = None
        while len(self._pending) >= self.max_in_flight:
            oldest = self._pending.popleft()
            oldest.copied.synchronize()
            oldest.gpu = None

    # ----------------------------------------------------------------------------------- backward
    def _restore(self, packed):
        if not isinstance(packed, int):
            return packed
        entry = self._entries[packed]
        if entry.host is None and entry.gpu is None:
            raise RuntimeError(f"offloaded checkpoint input {packed} was already restored once (a second "
                               "backward through the same graph needs retain_graph without offload)")
        if entry.device.type != "cuda":
            out, entry.host = entry.host, None
        else:
            self._prefetch(entry)
            torch.cuda.current_stream(entry.device).wait_event(entry.ready)
            out, entry.gpu = entry.gpu, None
            if packed > 0:
                self._prefetch(self._entries[packed - 1])   # the next chunk backward will recompute
        self.stats.restored += 1
        return out

    def _prefetch(self, entry: _Entry) -> None:
        if entry.ready is not None or entry.host is None:
            return
        compute = torch.cuda.current_stream(entry.device)
        if entry.gpu is not None:
            # Forward's source is still referenced (one of the last `max_in_flight` chunks, which backward
            # needs first): use it as it is, no copy back.
            entry.ready = torch.cuda.Event()
            entry.ready.record(compute)
            entry.host = None
            return
        side = _side_stream(entry.device)
        # Allocated on the compute stream (which frees and reuses it); the side stream waits for the
        # compute stream so earlier users of that memory are done before the copy writes it.
        entry.gpu = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            entry.gpu.copy_(entry.host, non_blocking=True)
            entry.ready = torch.cuda.Event()
            entry.ready.record(side)
        entry.host = None   # the pinned block returns to torch's host cache once the copy is done
