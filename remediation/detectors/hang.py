"""Hang: no progress (no step record) for longer than a timeout calibrated from the observed step times,
max(floor, k × p99 time between records (step time × the steps a record stands for)); longer while a checkpoint is being saved or loaded and during startup
before the first step; never shorter than the floor. Driven by the clock through `check(now)`."""

from __future__ import annotations

from collections import deque

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import Finding, fmt
from ulyssesd.remediation.records import Record, StepRecord


class HangDetector:
    symptom = "hang"

    def __init__(self, cfg: DetectorsConfig, start_time: float | None = None):
        self.cfg = cfg
        # Plain ring of recent step times; the p99 is only computed when the floor is already exceeded.
        self._times: deque[float] = deque(maxlen=cfg.window)
        self.reset(start_time)

    @property
    def active(self) -> bool:
        return self._fired

    def reset(self, now: float | None = None) -> None:
        """Called at each (re)start: startup phase until the first step record."""
        self._times.clear()
        self._last_progress = now
        self._last_step: int | None = None
        self._resume_step: int | None = None  # the step a restart resumed from (its `started` event)
        self._phase = "startup"
        self._fired = False

    def p99(self) -> float | None:
        if not self._times:
            return None
        s = sorted(self._times)
        return s[min(len(s) - 1, int(0.99 * len(s)))]

    def timeout(self) -> tuple[float, str]:
        cfg = self.cfg
        base = cfg.hang_timeout_floor_s
        p99 = self.p99()
        if p99 is not None:
            base = max(base, cfg.hang_step_multiplier * p99)
        if self._phase == "startup":
            return max(base, cfg.hang_startup_timeout_s), "startup before the first step"
        if self._phase == "checkpoint":
            return max(base, cfg.hang_checkpoint_timeout_s), "checkpoint save/load in progress"
        return base, "training"

    def stalled_s(self, now: float) -> float | None:
        """Seconds of silence when it is over the current phase's timeout (the job is hung), else None;
        None too after the job's own `exiting` (silence then is the job leaving). Pure: fires nothing."""
        if self._last_progress is None:
            return None
        silent = now - self._last_progress
        return silent if silent > self.timeout()[0] else None

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if isinstance(rec, StepRecord):
            st = rec.step_time_s
            if st is not None and st > 0:  # NaN is not > 0
                mx = rec.step_time_max_s
                # The wall time between two records: a job that logs every 10 steps is silent for 10 steps.
                last = self._last_step if self._last_step is not None else self._resume_step
                span = rec.step - last if last is not None and rec.step > last else 1
                self._times.append((mx if mx and mx == mx else st) * span)
            self._last_step = rec.step
            self._phase = "training"
        elif rec.event in ("checkpoint_saving", "checkpoint_loading"):
            self._phase = "checkpoint"
        elif rec.event in ("checkpoint_saved", "checkpoint_invalid"):
            self._phase = "training" if self._last_step is not None else "startup"
        elif rec.event == "checkpoint_loaded":
            self._phase = "startup"  # first step after a load still builds/warms up
        elif rec.event == "started":
            self.reset(now)
            # The step it resumes from: a job that logs every N steps is silent for N steps before its first record
            # (counted as one step, the timeout would fall to the floor until the second record).
            self._resume_step = rec.step if isinstance(rec.step, int) and rec.step >= 0 else None
        elif rec.event == "exiting":
            self._last_progress = None  # the job is leaving on its own: silence from here is not a hang
            return []
        self._last_progress = now
        self._fired = False
        return []

    def check(self, now: float) -> Finding | None:
        """A hang finding once per stall when the silence exceeds the phase's timeout."""
        if self._last_progress is None or self._fired:
            return None
        silent = now - self._last_progress
        if silent <= self.cfg.hang_timeout_floor_s:  # fast path: no timeout is shorter than the floor
            return None
        limit, phase = self.timeout()
        if silent <= limit:
            return None
        self._fired = True
        ev = {"silent_s": round(silent, 1), "timeout_s": round(limit, 1), "phase": phase,
              "last_step": self._last_step,
              "p99_step_time_s": self.p99()}
        where = f"after step {self._last_step}" if self._last_step is not None else "since start"
        msg = f"no progress for {fmt(silent)} s {where} ({phase}), over the {fmt(limit)} s timeout."
        return Finding(self.symptom, self._last_step, "critical", ev, msg, now)
