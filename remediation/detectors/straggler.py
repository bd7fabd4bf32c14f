"""Straggler: the slowest rank's step time is well above rank 0's and the same rank is the slowest for
many consecutive steps."""

from __future__ import annotations

from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, fmt
from ulyssesd.remediation.records import Record, StepRecord


class StragglerDetector(EpisodeDetector):
    symptom = "straggler"

    def reset(self) -> None:
        super().reset()
        self._rank: int | None = None
        self._spread_sum = 0.0
        self._records = 0

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        t, tmax, rank = rec.step_time_s, rec.step_time_max_s, rec.slowest_rank
        if not t or tmax is None or t != t or tmax != tmax:
            return []
        span = self._clock.advance(rec.step)
        spread = tmax / t
        if self._clock.since_start(rec.step) < self.cfg.warmup_steps or spread <= self.cfg.straggler_ratio:
            self._rank, self._spread_sum, self._records = None, 0.0, 0
            self._normal_step(rec.step)
            return []
        if rank != self._rank:
            self._rank, self._run, self._spread_sum, self._records = rank, 0, 0.0, 0
        self._records += 1
        self._spread_sum += spread
        # The run counts training steps with the same slowest rank, not records.
        if not self._anomalous_steps(rec.step, span, self.cfg.straggler_persist_steps):
            return []
        mean_spread = self._spread_sum / self._records
        ev = {"slowest_rank": rank, "consecutive": self._run, "mean_spread": round(mean_spread, 3),
              "step_time_s": t, "step_time_max_s": tmax, "since_step": self._ep.started_step}
        who = f"rank {rank}" if rank is not None else "one rank"
        msg = (f"step {rec.step}: {who} has been the slowest for {self._run} consecutive steps, "
               f"{mean_spread:.2f}x rank 0's step time on average (now {fmt(tmax)} s vs {fmt(t)} s).")
        return [Finding(self.symptom, rec.step, "warning", ev, msg, now)]
