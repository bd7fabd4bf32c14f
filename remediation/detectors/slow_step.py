"""Slow steps: the step time (slowest rank's when known) stays above ratio × its rolling median for a few
consecutive steps; single slow steps (GC, checkpoint) are normal. Steps right after a checkpoint event are
not counted, nor slow steps inside a learned periodic window (`slow_step_period`: an evaluation every N steps
the job does not announce; learned/periodic.py) - a slowdown that outlasts the window is still found."""

from __future__ import annotations

from ulyssesd.remediation.detectors.base import Finding, MedianWindowDetector, fmt
from ulyssesd.remediation.learned.periodic import in_window
from ulyssesd.remediation.records import EventRecord, Record, StepRecord


def step_time(rec: StepRecord) -> float | None:
    t = rec.step_time_max_s if rec.step_time_max_s is not None else rec.step_time_s
    return t if t is not None and t == t and t > 0 else None


class SlowStepDetector(MedianWindowDetector):
    symptom = "slow_step"
    skip_after_events = ("checkpoint_", "control_applied")

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if isinstance(rec, EventRecord):
            self._note_event(rec)
            return []
        t = rec.step_time_max_s  # step_time(), inlined: this runs for every step record
        if t is None:
            t = rec.step_time_s
        if t is None or not t > 0:  # NaN is not > 0
            return []
        span = self._clock.advance(rec.step)
        if self._skipped():
            return []
        cfg = self.cfg
        win = self._win
        med = win.med
        if med is None or self._clock.since_start(rec.step) < cfg.step_time_warmup() or t <= cfg.slow_step_ratio * med:
            self._normal_step(rec.step)
            win.add(t)
            return []
        if cfg.slow_step_period and in_window(rec.step, cfg.slow_step_period, cfg.slow_step_period_phase,
                                              cfg.slow_step_period_steps):
            return []   # the run's own rhythm: neither counted nor a baseline value; a longer run goes on after it
        if not self._anomalous_steps(rec.step, span, cfg.slow_step_min_consecutive):
            return []
        spread = (rec.step_time_max_s / rec.step_time_s
                  if rec.step_time_max_s and rec.step_time_s else None)
        ev = {"step_time_s": t, "median_s": med, "consecutive": self._run, "rank_spread": spread,
              "slowest_rank": rec.slowest_rank, "since_step": self._ep.started_step}
        msg = (f"step {rec.step}: step time {fmt(t)} s is {t / med:.1f}x the {len(self._win)}-step median "
               f"{fmt(med)} s for {self._run} consecutive steps.")
        return [Finding(self.symptom, rec.step, "warning", ev, msg, now)]
