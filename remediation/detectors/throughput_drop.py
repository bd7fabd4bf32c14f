"""Throughput drop: tokens/s stays below (1 - frac) × its rolling baseline for many consecutive steps.
Low steps stay out of the baseline, so a lasting drop keeps being measured against healthy speed."""

from __future__ import annotations

from ulyssesd.remediation.detectors.base import Finding, MedianWindowDetector, fmt
from ulyssesd.remediation.records import EventRecord, Record, StepRecord


def tokens_per_s(rec: StepRecord) -> float | None:
    if rec.tokens_per_s is not None:
        v = rec.tokens_per_s
    elif rec.tokens and rec.step_time_s:
        v = rec.tokens / rec.step_time_s
    else:
        return None
    return v if v == v and v > 0 else None


class ThroughputDropDetector(MedianWindowDetector):
    symptom = "throughput_drop"
    skip_after_events = ("checkpoint_",)

    def baseline(self) -> float | None:
        return self._win.med

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if isinstance(rec, EventRecord):
            self._note_event(rec)
            return []
        v = rec.tokens_per_s
        if v is None:
            v = tokens_per_s(rec)
            if v is None:
                return []
        elif not v > 0:  # tokens_per_s(): NaN and non-positive rates are no measurement
            return []
        span = self._clock.advance(rec.step)
        if self._skipped():
            return []
        cfg = self.cfg
        win = self._win
        base = win.med  # = self.baseline()
        if base is None or self._clock.since_start(rec.step) < cfg.step_time_warmup() or v >= (1 - cfg.throughput_drop_frac) * base:
            self._normal_step(rec.step)
            win.add(v)
            return []
        if not self._anomalous_steps(rec.step, span, cfg.throughput_persist_steps):
            return []
        ev = {"tokens_per_s": v, "baseline_tokens_per_s": base, "consecutive": self._run,
              "since_step": self._ep.started_step}
        msg = (f"step {rec.step}: throughput {fmt(v)} tokens/s is {1 - v / base:.0%} below the baseline "
               f"{fmt(base)} tokens/s for {self._run} consecutive steps.")
        return [Finding(self.symptom, rec.step, "warning", ev, msg, now)]
