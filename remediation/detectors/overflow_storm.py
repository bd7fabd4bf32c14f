"""fp16 overflow storm: the skipped-step rate over a window is high. Skips in the first steps after a start
are the dynamic loss scale calibrating itself (healthy) and are not counted."""

from __future__ import annotations

from collections import deque
from typing import cast

from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding
from ulyssesd.remediation.records import Record, StepRecord


class OverflowStormDetector(EpisodeDetector):
    symptom = "overflow_storm"

    def reset(self) -> None:
        super().reset()
        self._flags: deque[bool] = deque(maxlen=self.cfg.overflow_window)
        self._skips = 0
        self._seen = 0

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord) or rec.skipped is None:
            return []
        self._seen += 1
        if self._seen <= self.cfg.overflow_startup_steps:
            return []
        flags = self._flags
        if len(flags) == flags.maxlen and flags[0]:
            self._skips -= 1
        skipped = rec.skipped
        flags.append(skipped)
        if skipped:
            self._skips += 1
        elif not self._skips:  # no skip in the window: rate 0 is never above overflow_max_rate (> 0)
            if self._ep.active:
                self._ep.normal()
            return []
        n = len(flags)
        rate = self._skips / n
        if n < cast(int, flags.maxlen) or rate <= self.cfg.overflow_max_rate:
            if self._ep.active:
                self._ep.normal()
            return []
        if not self._ep.anomalous(rec.step):
            return []
        ev = {"skipped": self._skips, "window": n, "rate": round(rate, 3), "loss_scale": rec.loss_scale,
              "since_step": self._ep.started_step}
        msg = (f"step {rec.step}: {self._skips} of the last {n} steps were skipped for fp16 overflow "
               f"({rate:.0%} > {self.cfg.overflow_max_rate:.0%}), loss scale {rec.loss_scale}.")
        return [Finding(self.symptom, rec.step, "warning", ev, msg, now)]
