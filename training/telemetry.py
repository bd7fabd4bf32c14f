"""Telemetry of the built-in job: rank 0 appends JSON lines to `{run_dir}/telemetry.jsonl` (docs/CONTRACTS.md).

- `TelemetryWriter`: the client's `Reporter` in synchronous mode (each record written and flushed on the
  caller's thread, events fsynced): the built-in job injects faults that kill the process right after their
  event, which a queued record would not survive. Encoding and validation are the client's
  (`ulyssesd.client.contract`): one implementation for the built-in job and users' jobs.
- `gather_step_stats`: ONE all_gather per step of a small float vector per rank, from which every rank
  learns the mean loss, the max step time / memory and which rank had them, and whether any rank wants
  to stop (SIGTERM seen) - so a slow or bloated rank anywhere shows in rank 0's stream.
- `NvrxHeartbeat`: under NVRx's `ft_launcher` (docs/COEXISTENCE.md), every rank's heartbeat to its rank
  monitor (FT_RANK_MONITOR_IPC_SOCKET): no heartbeat for `--ft-rank-heartbeat-timeout` seconds and the monitor
  kills the rank and ft_launcher restarts the worker group. Outside ft_launcher it does nothing (no import).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ulyssesd.client.contract import EVENTS, EXIT_REASONS, SCHEMA_VERSION, encode_record, validate_record
from ulyssesd.client.reporter import Reporter, ReporterConfig

__all__ = ["EVENTS", "EXIT_REASONS", "SCHEMA_VERSION", "StepStats", "TelemetryWriter", "encode_record",
           "gather_step_stats", "memory_gib", "validate_record"]


class TelemetryWriter(Reporter):
    """Append-only JSONL writer; a no-op on ranks other than 0 (`enabled=False`)."""

    def __init__(self, path: str | Path | None, attempt: int, config_version: int | None, enabled: bool = True):
        super().__init__(path, attempt=attempt, config_version=config_version,
                         rank=0 if enabled and path is not None else 1,
                         config=ReporterConfig(synchronous=True))


# ---------------------------------------------------------------------------------- per-rank stats
def memory_gib(device: torch.device, extra_gib: float = 0.0) -> tuple[float, float, float]:
    """(allocated, max allocated since last reset, reserved) in GiB. On CPU: process RSS for all three
    (there is no allocator to ask), plus `extra_gib` a simulated memory-spike fault reports."""
    gib = float(1 << 30)
    if device.type == "cuda":
        return (torch.cuda.memory_allocated(device) / gib + extra_gib,
                torch.cuda.max_memory_allocated(device) / gib + extra_gib,
                torch.cuda.memory_reserved(device) / gib + extra_gib)
    import psutil
    rss = psutil.Process().memory_info().rss / gib + extra_gib
    return rss, rss, rss


@dataclass
class StepStats:
    """What rank 0 (and every rank) learns from the per-step gather."""

    loss: float
    step_time_max_s: float
    slowest_rank: int
    mem_max_allocated_gib: float
    mem_max_rank: int
    stop_requested: bool
    extra: list[float] | None = None   # the callers' extra values, summed over ranks


def loss_by_source(names: list[str], sums_and_counts: list[float]) -> dict[str, float]:
    """{source: mean token loss of its samples in this step} from [sums per source..., counts per source...];
    sources with no sample in the step are left out."""
    k = len(names)
    sums, counts = sums_and_counts[:k], sums_and_counts[k:2 * k]
    return {name: s / c for name, s, c in zip(names, sums, counts, strict=True) if c > 0}


def gather_step_stats(loss: float, step_time_s: float, mem_max_gib: float, stop: bool,
                      device: torch.device, extra: list[float] | None = None) -> StepStats:
    """One all_gather of [loss, step_time, mem, stop, *extra] across the world (gloo or NCCL); `extra`
    comes back summed over ranks (the per-source loss sums and token counts)."""
    import torch.distributed as dist

    mine = torch.tensor([loss, step_time_s, mem_max_gib, 1.0 if stop else 0.0, *(extra or ())],
                        dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        rows = mine[None]
    else:
        flat = torch.empty(dist.get_world_size() * mine.numel(), dtype=mine.dtype, device=device)
        dist.all_gather_into_tensor(flat, mine)  # gloo wants a flat output
        rows = flat.view(dist.get_world_size(), mine.numel())
    rows = rows.cpu()
    # Every rank's loss is a mean over the same number of tokens, so the global mean is the mean of means.
    t_rank = int(torch.argmax(rows[:, 1]))
    m_rank = int(torch.argmax(rows[:, 2]))
    return StepStats(loss=float(rows[:, 0].mean()), step_time_max_s=float(rows[t_rank, 1]), slowest_rank=t_rank,
                     mem_max_allocated_gib=float(rows[m_rank, 2]), mem_max_rank=m_rank,
                     stop_requested=bool((rows[:, 3] > 0).any()),
                     extra=rows[:, 4:].sum(0).tolist() if extra is not None else None)


RANK_MONITOR_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


class NvrxHeartbeat:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.client: Any = None
        if not (env if env is not None else os.environ).get(RANK_MONITOR_ENV):
            return
        try:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
        except ImportError as exc:  # ft_launcher is this package's own: a broken install, said plainly
            raise RuntimeError(f"{RANK_MONITOR_ENV} is set (the job runs under NVRx's ft_launcher) but "
                               f"nvidia_resiliency_ext cannot be imported in the ranks' Python: {exc}") from exc
        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()

    def beat(self) -> None:
        """After each training step: the rank is alive and making progress."""
        if self.client is not None:
            self.client.send_heartbeat()

    def close(self) -> None:
        """A clean exit: the monitor stops watching (not a missed heartbeat)."""
        if self.client is not None:
            client, self.client = self.client, None
            client.shutdown_workload_monitoring()
