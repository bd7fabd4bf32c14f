"""Memory spike: a step's max-allocated memory (max over ranks) jumps above ratio × its rolling baseline,
or reaches a fraction of the device capacity, or the allocator's reserved memory does (fragmentation: the
caching allocator holds blocks it cannot reuse, and an OOM comes when reserved cannot grow); names the rank
that holds the peak. The engine chooses the change from these numbers (remediation/memory_evidence.py)."""

from __future__ import annotations

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
