"""Memory spike: a step's max-allocated memory (max over ranks) jumps above ratio × its rolling baseline,
or reaches a fraction of the device capacity, or the allocator's reserved memory does (fragmentation: the
caching allocator holds blocks it cannot reuse, and an OOM comes when reserved cannot grow); names the rank
that holds the peak. The engine chooses the change from these numbers (remediation/memory_evidence.py).
`Footprint`: the running attempt's own measured steady peak, which tells a transient OOM from the config's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ulyssesd.remediation.detectors.base import Finding, MedianWindowDetector, fmt
from ulyssesd.remediation.records import Record, StepRecord


class MemorySpikeDetector(MedianWindowDetector):
    symptom = "memory_spike"

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        mem = rec.mem_max_allocated_gib
        if mem is None or mem != mem:
            return []
        self._clock.advance(rec.step)
        cfg = self.cfg
        cap = cfg.device_memory_gib
        near_cap = cap is not None and mem >= cfg.memory_capacity_frac * cap
        reserved = rec.mem_reserved_gib
        near_reserved = (cap is not None and reserved is not None and reserved == reserved
                         and reserved >= cfg.memory_capacity_frac * cap)
        base = self._win.med
        over_base = (base is not None and self._clock.since_start(rec.step) >= cfg.warmup_steps
                     and mem > cfg.memory_spike_ratio * base and mem - base >= cfg.memory_min_delta_gib)
        if not (near_cap or over_base or near_reserved):
            if self._ep.active:
                self._ep.normal(rec.step)
            self._win.add(mem)
            return []
        if not self._ep.anomalous(rec.step):
            return []
        rank = rec.mem_max_rank
        ev = {"mem_max_allocated_gib": mem, "baseline_gib": base, "rank": rank, "capacity_gib": cap,
              "mem_reserved_gib": rec.mem_reserved_gib, "since_step": self._ep.started_step}
        who = f"rank {rank}" if rank is not None else "a rank"
        parts = []
        if over_base:
            assert base is not None  # over_base implies a baseline
            parts.append(f"{mem / base:.2f}x its {len(self._win)}-step baseline {fmt(base)} GiB")
        if near_cap:
            assert cap is not None  # near_cap implies a capacity
            parts.append(f"{mem / cap:.0%} of the {fmt(cap)} GiB device")
        elif near_reserved:
            assert cap is not None and reserved is not None  # near_reserved implies both
            parts.append(f"{fmt(reserved)} GiB reserved = {reserved / cap:.0%} of the {fmt(cap)} GiB device")
        msg = f"step {rec.step}: {who} peaked at {fmt(mem)} GiB allocated, {' and '.join(parts)}."
        return [Finding(self.symptom, rec.step, "critical" if near_cap or near_reserved else "warning", ev, msg, now)]


# A first step's peak misses what it allocates late (the optimizer moments: 67.7 vs 78.2 GiB at steps 1 and 2
# of gpt-1b at 32K on an H200, bench/results/gpu_call13_raw.tgz): two measured steps make a steady peak.
MIN_STEADY_STEPS = 2


@dataclass
class Footprint:
    """The running attempt's own measured memory under one config version (its step records'
    mem_max_allocated_gib), and the last transient-OOM episode, which outlives the attempt."""

    restarts: int = 0                  # attempts started (the engine's on_restart)
    attempt: int | None = None         # the running attempt's number
    config_version: int | None = None  # of the steps counted
    steps: int = 0                     # step records with a measured peak under `config_version`
    peak_gib: float | None = None      # their max mem_max_allocated_gib
    first_step: int | None = None      # the first of them
    last_step: int | None = None       # the attempt's last completed step (an OOM comes in the next one)
    started: tuple[int | None, int] | None = None   # (attempt, start step) of the last `started` event
    checkpoint: tuple[str, int] | None = None       # the newest saved tag (an OOM leaves the weights sound)
    last_record: StepRecord | None = None   # the newest step record of any attempt (its sample range)
    episode: dict[str, Any] | None = None   # the last transient OOM: restarts, oom_step, peak_gib, skipped

    def restart(self, attempt: int | None) -> None:
        self.restarts, self.attempt, self.steps = self.restarts + 1, attempt, 0
        self.config_version = self.peak_gib = self.first_step = self.last_step = None

    def observe(self, rec: Record) -> None:
        """One telemetry record (a StepRecord or EventRecord; cheap, it sees every record)."""
        if not isinstance(rec, StepRecord):
            if rec.event == "started" and isinstance(rec.fields.get("start_step"), int):
                self.started = (rec.attempt, rec.fields["start_step"])
            elif rec.event == "checkpoint_saved" and rec.step is not None:
                self.checkpoint = (str(rec.fields.get("tag") or f"step-{rec.step:08d}"), rec.step)
            return
        if rec.config_version != self.config_version:   # a new config version has its own footprint
            self.config_version, self.steps, self.peak_gib, self.first_step = rec.config_version, 0, None, None
        self.last_step, self.last_record = rec.step, rec
        peak = rec.mem_max_allocated_gib
        if peak is not None and math.isfinite(peak):   # the quiet path: a few attribute writes per record
            self.steps += 1
            if self.peak_gib is None or peak > self.peak_gib:
                self.peak_gib = peak
            if self.first_step is None:
                self.first_step = rec.step

    def oom_step(self) -> int | None:
        at = self.last_step
        if at is None and self.started is not None and self.started[0] == self.attempt:
            at = self.started[1]   # nothing completed yet: the step after the one it resumed from
        return None if at is None else at + 1

    def steady_peak(self) -> float | None:
        return self.peak_gib if self.steps >= MIN_STEADY_STEPS else None
