"""Telemetry contract (DESIGN.md): rank 0 appends JSON lines to `{run_dir}/telemetry.jsonl`.

- `TelemetryWriter`: v=1 records, flushed per record, non-finite floats written as "nan"/"inf"/"-inf".
- `gather_step_stats`: ONE all_gather per step of a small float vector per rank, from which every rank
  learns the mean loss, the max step time / memory and which rank had them, and whether any rank wants
  to stop (SIGTERM seen) - so a slow or bloated rank anywhere shows in rank 0's stream.
- `validate_record`: the contract as a function the daemon and tests reuse.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1
EVENTS = ("started", "checkpoint_saving", "checkpoint_saved", "checkpoint_loaded", "checkpoint_invalid",
          "control_applied", "fault_injected", "exiting")
EXIT_REASONS = ("completed", "sigterm", "error")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.item() if value.numel() == 1 else value.tolist())
    return value


def encode_record(record: dict[str, Any]) -> str:
    return json.dumps(_jsonable(record), allow_nan=False, separators=(",", ":"))


class TelemetryWriter:
    """Append-only JSONL writer; a no-op on ranks other than 0."""

    def __init__(self, path: str | Path | None, attempt: int, config_version: int | None, enabled: bool = True):
        self.attempt = attempt
        self.config_version = config_version
        self._fh = None
        if enabled and path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the job

    def _write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        self._fh.write(encode_record(record) + "\n")
        self._fh.flush()  # the daemon tails this file; a record must never sit in a buffer
        if record.get("kind") == "event":
            os.fsync(self._fh.fileno())  # events (exiting, checkpoint_saved) must survive a host crash

    def step(self, step: int, loss: float, **fields: Any) -> None:
        self._write({"v": SCHEMA_VERSION, "kind": "step", "time": time.time(), "attempt": self.attempt,
                     "step": step, "loss": loss, "config_version": self.config_version, **fields})

    def event(self, event: str, step: int | None, **fields: Any) -> None:
        self._write({"v": SCHEMA_VERSION, "kind": "event", "time": time.time(), "attempt": self.attempt,
                     "step": step, "event": event, **fields})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# ------------------------------------------------------------------------------------ validation
_NUM = (int, float)
_STEP_FIELDS: dict[str, tuple[type, ...]] = {
    "grad_norm": _NUM, "lr": _NUM, "loss_scale": _NUM, "skipped": (bool,), "step_time_s": _NUM,
    "step_time_max_s": _NUM, "slowest_rank": (int,), "tokens": (int,), "tokens_per_s": _NUM,
    "mem_allocated_gib": _NUM, "mem_max_allocated_gib": _NUM, "mem_max_rank": (int,), "mem_reserved_gib": _NUM,
    "config_version": (int,), "samples": (list,),
}
_NONFINITE = ("nan", "inf", "-inf")


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, _NUM) or value in _NONFINITE


def validate_record(rec: Any) -> list[str]:
    """Problems of one decoded telemetry record against the contract; [] when it conforms."""
    if not isinstance(rec, dict):
        return [f"record is {type(rec).__name__}, not an object"]
    problems = []
    if rec.get("v") != SCHEMA_VERSION:
        problems.append(f"v={rec.get('v')!r}: expected {SCHEMA_VERSION}")
    kind = rec.get("kind")
    if kind not in ("step", "event"):
        problems.append(f"kind={kind!r}: expected 'step' or 'event'")
    if "time" in rec and not _is_number(rec["time"]):
        problems.append(f"time={rec['time']!r}: expected a number")
    if "attempt" in rec and not (isinstance(rec["attempt"], int) and not isinstance(rec["attempt"], bool)):
        problems.append(f"attempt={rec['attempt']!r}: expected an integer")
    step = rec.get("step")
    if kind == "step":
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            problems.append(f"step={step!r}: expected a non-negative integer")
        if "loss" not in rec or not _is_number(rec["loss"]):
            problems.append(f"loss={rec.get('loss')!r}: expected a number or 'nan'/'inf'/'-inf'")
        for key, types in _STEP_FIELDS.items():
            value = rec.get(key)
            if value is None:
                continue
            if types == _NUM:
                if not _is_number(value):
                    problems.append(f"{key}={value!r}: expected a number")
            elif not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
                problems.append(f"{key}={value!r}: expected {types[0].__name__}")
        samples = rec.get("samples")
        if samples is not None and not (len(samples) == 2 and all(isinstance(x, int) for x in samples)
                                        and samples[0] <= samples[1]):
            problems.append(f"samples={samples!r}: expected [start, end) integers")
    elif kind == "event":
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            problems.append(f"step={step!r}: expected an integer or null")
        event = rec.get("event")
        if not isinstance(event, str) or not event:
            problems.append(f"event={event!r}: expected a non-empty string")
        elif event in ("checkpoint_saving", "checkpoint_saved", "checkpoint_loaded", "checkpoint_invalid") \
                and not isinstance(rec.get("tag"), str):
            problems.append(f"event {event} needs a string tag, got {rec.get('tag')!r}")
        elif event == "exiting" and rec.get("reason") not in EXIT_REASONS:
            problems.append(f"exiting reason={rec.get('reason')!r}: expected one of {EXIT_REASONS}")
        elif event == "control_applied" and not isinstance(rec.get("control_version"), int):
            problems.append(f"control_applied needs an integer control_version, got {rec.get('control_version')!r}")
        elif event == "fault_injected" and not isinstance(rec.get("fault"), str):
            problems.append(f"fault_injected needs a string fault kind, got {rec.get('fault')!r}")
    return problems


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


def gather_step_stats(loss: float, step_time_s: float, mem_max_gib: float, stop: bool,
                      device: torch.device) -> StepStats:
    """One all_gather of [loss, step_time, mem, stop] across the world (gloo or NCCL)."""
    import torch.distributed as dist

    mine = torch.tensor([loss, step_time_s, mem_max_gib, 1.0 if stop else 0.0], dtype=torch.float64,
                        device=device)
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
                     stop_requested=bool((rows[:, 3] > 0).any()))
