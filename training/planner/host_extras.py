"""Host memory the product itself takes on a node beside the training step: the snapshot an async save keeps
(`checkpoint.async_save`) and the warm standby of the next attempt (the daemon's `[restart] standby`), and the
host-RAM verdict that names the items and the setting that removes each. Formulas and where their numbers come
from: docs/PLANNER.md "Host memory of saves and restarts".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .inputs import GiB, ZeroSettings
from .rendering import Item

# The async writer sizes each rank's registered snapshot pool as nbytes + nbytes // 100 + 64 MiB, rounded up to
# its 256-byte view alignment (training/train_checkpoints.py POOL_MARGIN_BYTES, training/checkpoint/snapshot.py
# POOL_ALIGN_BYTES; the tests check these copies: the planner must not import torch).
POOL_MARGIN_BYTES = 64 << 20
POOL_MARGIN_DIVISOR = 100
POOL_ALIGN_BYTES = 256
# Max RSS of one waiting standby rank besides its preload (1x H200, gpt-1b: ru_maxrss 1,232,564 KiB = 1.18 GiB).
STANDBY_RSS_GIB = 1.2
# Bytes per parameter of a rank's ZeRO-3 optimizer-states file: fp32 master + Adam m, v (gpt-1b on one GPU:
# 16,969,265,577 B for 1,414,105,088 params; its model-states file is 55 KB and is not counted).
OPTIM_FILE_BYTES_PER_PARAM = 12
STANDBY_RANKS = "warm standby rank processes"


class RestartLike(Protocol):
    """What the planner reads of the daemon's `[restart]` section (daemon/spec.py RestartSection has both)."""

    @property
    def standby(self) -> bool: ...

    @property
    def standby_preload(self) -> bool: ...


@dataclass(frozen=True)
class Restart:
    """`[restart]` as the planner sees it, for callers without a daemon spec (the API, tests)."""

    standby: bool = False          # the next attempt's ranks wait warm on the node
    standby_preload: bool = True   # ... each holding its shards of the newest tag in host memory


NO_STANDBY = Restart()


def pow2ceil(nbytes: int) -> int:
    """torch's CUDA caching host allocator rounds every pinned allocation up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


def snapshot_pool_bytes(shard: int) -> int:
    """One rank's registered snapshot pool: its optimizer state dict's device tensors (12·P/N) + 1 % + 64 MiB."""
    nbytes = OPTIM_FILE_BYTES_PER_PARAM * shard
    total = nbytes + nbytes // POOL_MARGIN_DIVISOR + POOL_MARGIN_BYTES
    return -(-total // POOL_ALIGN_BYTES) * POOL_ALIGN_BYTES


def pinned_snapshot_bytes(shard: int, sub_group_size: int) -> int:
    """One rank's pinned snapshot buffers without the pool: fp32 master, m and v of each optimizer sub-group,
    each its own pinned tensor rounded up to a power of two (sub-groups taken as chunks of sub_group_size of
    the rank's partition: DeepSpeed closes a sub-group once its partition numel reaches sub_group_size)."""
    sub = max(1, min(sub_group_size, shard))
    chunks = [sub] * (shard // sub) + ([shard % sub] if shard % sub else [])
    return sum(3 * pow2ceil(4 * n) for n in chunks)


def async_snapshot_items(shard: int, gpn: int, zero: ZeroSettings, *, async_save: bool,
                         snapshot_pool: bool) -> list[Item]:
    """Per-node host items of `checkpoint.async_save` (none without it)."""
    if not async_save:
        return []
    off = "[checkpoint] async_save = false (saves then block training for the whole write)"
    if zero.offload_optimizer != "none":
        # The optimizer's states are host tensors already; a snapshot copies them into fresh pageable memory
        # (host_snapshot), freed when the background write ends: alive while a write is in flight.
        return [Item("async-save snapshot copy (while a write runs)", OPTIM_FILE_BYTES_PER_PARAM * shard * gpn,
                     "host", "12·P/N·gpus_per_node (copy of the offloaded fp32 master + Adam m, v; pageable)",
                     off=off)]
    if snapshot_pool:
        return [Item("async-save snapshot pool (registered)", snapshot_pool_bytes(shard) * gpn, "host",
                     "(12·P/N + 1 % + 64 MiB)·gpus_per_node (each rank's registered pool, kept for the attempt)",
                     off=off)]
    return [Item("async-save snapshot buffers (pinned)", pinned_snapshot_bytes(shard, zero.sub_group_size) * gpn,
                 "host", "3·Σ pow2ceil(4·sub-group partition)·gpus_per_node (pinned buffers kept between saves)",
                 off=off + "; or [checkpoint] snapshot_pool = true (no power-of-two rounding)")]


def standby_items(shard: int, gpn: int, restart: RestartLike) -> list[Item]:
    """Per-node host items of the warm standby (none without `[restart] standby`)."""
    if not restart.standby:
        return []
    items = [Item(STANDBY_RANKS, int(STANDBY_RSS_GIB * GiB) * gpn, "host",
                  f"{STANDBY_RSS_GIB:g} GiB·gpus_per_node (max RSS of a waiting standby rank, measured)",
                  off="[restart] standby = false (every relaunch is then cold; frees its preload too)")]
    if restart.standby_preload:
        items.append(Item("warm standby preloaded tag (memfd)", OPTIM_FILE_BYTES_PER_PARAM * shard * gpn, "host",
                          "12·P/N·gpus_per_node (each standby rank's optimizer-states file of the newest tag)",
                          off="[restart] standby_preload = false (the standby stays warm, loads from disk)"))
    return items


def host_problem(items: list[Item], host_mem_gib: float) -> str | None:
    """The host-RAM verdict: None when the node holds every host item, otherwise what it needs, the largest
    items, and the settings that would remove some (with what each frees)."""
    host = [it for it in items if it.where == "host"]
    need = sum(it.bytes for it in host)
    if need <= host_mem_gib * GiB:
        return None
    largest = sorted(host, key=lambda it: -it.bytes)[:4]
    msg = (f"host: needs {need / GiB:.0f} GiB ({need / 2**40:.2f} TiB) of RAM per node but the node has "
           f"{host_mem_gib:.0f} GiB: short by {need / GiB - host_mem_gib:.0f} GiB; largest items: "
           + ", ".join(f"{it.name} {it.bytes / GiB:.1f} GiB" for it in largest))
    switches = [(it.off, _freed_by(it, host)) for it in host if it.off]
    if switches:
        msg += "; to free host RAM turn off: " + "; ".join(
            f"{off} (-{freed / GiB:.1f} GiB)" for off, freed in sorted(switches, key=lambda t: -t[1]))
    return msg


def _freed_by(item: Item, host: list[Item]) -> int:
    """Host bytes that turning off `item.off` frees: `[restart] standby = false` takes its preload with it."""
    if item.name == STANDBY_RANKS:
        return sum(it.bytes for it in host if it.name.startswith("warm standby"))
    return item.bytes
