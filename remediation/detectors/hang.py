"""Hang: no progress (no record) for longer than a timeout calibrated from the run itself.

In training the timeout is max(floor, k × the median time between step records, m × the longest recent one),
a record's time being its step time × the steps it stands for (the first after a `started` event: since the
step it started from). Work the job announces (a checkpoint save or load, an evaluation, a data wait: a begin event and an end
event, `ANNOUNCED`) extends it by that kind's own longest measured duration in this run × a margin; the first of
a kind, not measured yet, gets the kind's fixed ceiling. Startup before the first step has its own timeout.
Never shorter than the floor. Driven by the clock through `check(now)`."""

from __future__ import annotations

from collections import deque

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import Finding, fmt
from ulyssesd.remediation.records import Record, StepRecord

# Announced work: begin event -> (kind, the kind's words in a finding).
ANNOUNCED_BEGIN: dict[str, str] = {
    "checkpoint_saving": "checkpoint save", "checkpoint_loading": "checkpoint load",
    "evaluating": "evaluation", "data_waiting": "data wait",
}
# End events -> the kind they close (a failed or skipped save ends the save as surely as a saved one).
ANNOUNCED_END: dict[str, str] = {
    "checkpoint_saved": "checkpoint save", "checkpoint_save_failed": "checkpoint save",
    "checkpoint_skipped": "checkpoint save",
    "checkpoint_loaded": "checkpoint load", "evaluated": "evaluation", "data_ready": "data wait",
}
CHECKPOINT_KINDS = ("checkpoint save", "checkpoint load")


class HangDetector:
    symptom = "hang"

    def __init__(self, cfg: DetectorsConfig, start_time: float | None = None):
        self.cfg = cfg
        # Plain ring of recent record intervals; the timeout is only computed once the floor is exceeded.
        self._times: deque[float] = deque(maxlen=cfg.window)
        # Longest measured duration of each announced kind in this run (kept across restarts: same run, same work).
        self.longest: dict[str, float] = {}
        self.reset(start_time)

    @property
    def active(self) -> bool:
        return self._fired

    def reset(self, now: float | None = None, start_step: int | None = None) -> None:
        """Called at each (re)start: startup phase until the first step record."""
        self._times.clear()
        self._last_progress = now
        self._last_step: int | None = None
        self._start_step = start_step   # the step the job said it starts from (its `started` event)
        self._phase = "startup"
        # (kind, begin time, step) of announced work in progress, and of work that steps went on behind (async save).
        self._announced: tuple[str, float, int | None] | None = None
        self._behind: tuple[str, float, int | None] | None = None
        self._fired = False

    def median(self) -> float | None:
        if not self._times:
            return None
        s = sorted(self._times)
        return s[len(s) // 2]

    def training_timeout(self) -> float:
        """max(floor, multiplier × median time between step records, margin × the longest recent one)."""
        med = self.median()
        base = self.cfg.hang_timeout_floor_s
        if med is None:
            return base
        return max(base, self.cfg.hang_step_multiplier * med, self.cfg.hang_longest_gap_margin * max(self._times))

    def timeout(self) -> tuple[float, str]:
        cfg = self.cfg
        base = self.training_timeout()
        if self._announced is not None:
            kind = self._announced[0]
            measured = self.longest.get(kind)
            if measured is not None:
                return base + cfg.hang_phase_margin * measured, \
                    f"{kind} in progress, the longest measured {fmt(measured)} s"
            first = cfg.hang_checkpoint_timeout_s if kind in CHECKPOINT_KINDS else cfg.hang_phase_timeout_s
            return max(base, first), f"{kind} in progress, none measured yet"
        if self._phase == "startup":
            return max(base, cfg.hang_startup_timeout_s), "startup before the first step"
        return base, "training"

    def stalled_s(self, now: float) -> float | None:
        """Seconds of silence when it is over the current phase's timeout (the job is hung), else None;
        None too after the job's own `exiting` (silence then is the job leaving). Pure: fires nothing."""
        if self._last_progress is None:
            return None
        silent = now - self._last_progress
        return silent if silent > self.timeout()[0] else None

    def _end_announced(self, kind: str, now: float, step: int | None) -> None:
        """The end of `kind`: its duration (begin -> end) is measured, whether steps went on behind it or not.
        The end closes the begin of its step when it names one, else the older work (an async write behind)."""
        open_ = [b for b in (self._behind, self._announced) if b is not None and b[0] == kind]
        began = next((b for b in open_ if step is not None and b[2] == step), open_[0] if open_ else None)
        if began is None:
            return
        if now >= began[1]:
            self.longest[kind] = max(self.longest.get(kind, 0.0), now - began[1])
        if began is self._behind:
            self._behind = None
        else:
            self._announced = None

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if isinstance(rec, StepRecord):
            st = rec.step_time_s
            if st is not None and st > 0:  # NaN is not > 0
                mx = rec.step_time_max_s
                # The wall time between two records: a job that logs every 10 steps is silent for 10 steps.
                last = self._last_step if self._last_step is not None else self._start_step
                span = rec.step - last if last is not None and rec.step > last else 1
                self._times.append((mx if mx and mx == mx else st) * span)
            self._last_step = rec.step
            self._phase = "training"
            # A step after a begin without its end (an async save's write goes on behind the steps): the
            # silence from here is training again; the work's duration is measured when its end comes.
            if self._announced is not None:
                self._behind, self._announced = self._announced, None
        elif rec.event in ANNOUNCED_BEGIN:
            self._announced = (ANNOUNCED_BEGIN[rec.event], now, rec.step)
        elif rec.event in ANNOUNCED_END:
            self._end_announced(ANNOUNCED_END[rec.event], now, rec.step)
            if rec.event == "checkpoint_loaded":
                self._phase = "startup"  # first step after a load still builds/warms up
        elif rec.event == "checkpoint_invalid":
            self._announced = self._behind = None  # a tag set aside ends the work on it; nothing measured
        elif rec.event in ("started", "inner_restart"):  # inner_restart: a launcher restarted the workers in-job
            self.reset(now, rec.step)
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
              "median_record_interval_s": self.median(),
              "longest_record_interval_s": max(self._times) if self._times else None}
        where = f"after step {self._last_step}" if self._last_step is not None else "since start"
        msg = f"no progress for {fmt(silent)} s {where} ({phase}), over the {fmt(limit)} s timeout."
        return Finding(self.symptom, self._last_step, "critical", ev, msg, now)
