"""fp16 overflow storm, from the skipped-step rate and from the loss-scale trajectory.

Every overflow halves DeepSpeed's dynamic loss scale, so a scale that halves step after step is a storm even
when the job's `skipped` counter says nothing (Megatron-DeepSpeed logs can print 0 skipped iterations while
the scale falls). Skips and halvings in the first steps after a start are the scale calibrating itself
(healthy) and are not counted; so is an occasional overflow (one halving every few hundred steps). All
windows are in training steps: a record logged every 10 steps stands for 10 steps.
"""

from __future__ import annotations

import math
from collections import deque

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, fmt
from ulyssesd.remediation.records import Record, StepRecord


class OverflowStormDetector(EpisodeDetector):
    symptom = "overflow_storm"

    def __init__(self, cfg: DetectorsConfig, min_loss_scale: float | None = None):
        self.min_loss_scale = min_loss_scale
        super().__init__(cfg)

    def reset(self) -> None:
        super().reset()
        # (training steps the record stands for, overflowed steps in it, loss-scale halvings in it)
        self._win: deque[tuple[int, int, int]] = deque()
        self._steps = 0
        self._skips = 0
        self._halvings = 0
        self._prev_scale: float | None = None

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        scale, skipped = rec.loss_scale, rec.skipped
        if skipped is None and (scale is None or not scale > 0):
            return []
        span = self._clock.advance(rec.step)
        halvings = 0
        if scale is not None and scale > 0 and scale == scale:
            prev = self._prev_scale
            if prev is not None and scale < prev:
                ratio = prev / scale  # inf when a huge scale falls to a denormal one: count it as many halvings
                halvings = max(1, round(math.log2(ratio))) if math.isfinite(ratio) else 1024
            self._prev_scale = scale
        floor = self.min_loss_scale
        # Halving to within a few x of the minimum is never calibration (that settles far above it).
        near_floor = (floor is not None and halvings > 0 and scale is not None
                      and scale <= self.cfg.overflow_floor_factor * floor)
        if self._clock.since_start(rec.step) < self.cfg.overflow_startup_steps and not near_floor:
            return []  # the loss scale calibrating after a start
        # Each halving is at least one overflowed step; a skipped record is at least one (we do not know how
        # many of the steps it stands for overflowed, so a record at log interval 10 counts one, not ten).
        skips = min(span, max(1 if skipped else 0, halvings)) if span else (1 if skipped or halvings else 0)
        win = self._win
        win.append((span, skips, halvings))
        self._steps += span
        self._skips += skips
        self._halvings += halvings
        window = self.cfg.overflow_window
        while win and self._steps - win[0][0] >= window:
            s, k, h = win.popleft()
            self._steps -= s
            self._skips -= k
            self._halvings -= h
        if not self._skips:
            if self._ep.active:
                self._ep.normal(rec.step)
            return []
        rate = self._skips / max(1, self._steps)
        by_rate = self._steps >= window and rate > self.cfg.overflow_max_rate
        by_halvings = self._halvings >= self.cfg.overflow_max_halvings
        if not (by_rate or by_halvings or near_floor):
            if self._ep.active:
                self._ep.normal(rec.step)
            return []
        if not self._ep.anomalous(rec.step):
            return []
        ev = {"skipped": self._skips, "window": self._steps, "rate": round(rate, 3), "halvings": self._halvings,
              "loss_scale": scale, "min_loss_scale": floor, "since_step": self._ep.started_step}
        why = []
        if by_rate:
            why.append(f"{self._skips} of the last {self._steps} steps overflowed "
                       f"({rate:.0%} > {self.cfg.overflow_max_rate:.0%})")
        if by_halvings:
            why.append(f"the loss scale halved {self._halvings} times in the last {self._steps} steps")
        if near_floor:
            why.append(f"the loss scale fell to {fmt(scale or 0.0)}, within {fmt(self.cfg.overflow_floor_factor)}x "
                       f"of its minimum {fmt(floor or 0.0)}")
        msg = f"step {rec.step}: fp16 overflow storm: {'; '.join(why)} (loss scale {scale})."
        return [Finding(self.symptom, rec.step, "critical" if near_floor else "warning", ev, msg, now)]
