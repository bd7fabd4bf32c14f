"""Loss oscillation: the step-to-step loss swing (median |Δloss| over a short window, robust to a single
spike) is several times the run's own baseline swing, and the loss keeps reversing direction.

A record with `loss_by_source` is first de-mixed: the value followed is the mean over its sources of
log(loss / that source's own running level) divided by that source's own running noise scale, so steps that
alternate between an easy and a hard source (a healthy mixed run at micro-batch 1) swing by their within-source
noise only, and in units of each source's own noise: a steady source (log noise 0.02) and one whose small loss
is itself bimodal (log jumps of 2-3 when it has fallen to 0.01-0.05) weigh the same, and the baseline swing
learned while losses were larger still holds when they have fallen. The scale is an EMA of |deviation| whose
updates are clipped to `_SCALE_CLIP` x the scale, so an oscillation does not absorb itself quickly; a source
with fewer than `loss_source_min_history` observations has no scale yet and contributes nothing. A loss that
alternates up and down beyond its own source's noise is still an oscillation (the unlabelled path de-mixes by
the loss's own modes the same way)."""

from __future__ import annotations

import math
from collections import deque

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, fmt
from ulyssesd.remediation.detectors.loss_spike import LossSpikeDetector
from ulyssesd.remediation.records import Record, StepRecord

# A deviation updates its source's noise scale by at most this many times the scale (one jump or an
# oscillation raises it slowly: at the window's EMA rate, x(1 + 2 alpha) per observation at most).
_SCALE_CLIP = 3.0


class LossOscillationDetector(EpisodeDetector):
    symptom = "loss_oscillation"

    def __init__(self, cfg: DetectorsConfig, modes_of: LossSpikeDetector | None = None):
        # The loss-spike detector's modes of an unlabelled multi-modal loss (de-mixed like sources).
        self.modes_of = modes_of
        super().__init__(cfg)

    def reset(self) -> None:
        n = self.cfg.loss_osc_window
        super().reset()
        self._prev: float | None = None
        self._deltas: deque[float] = deque(maxlen=n)
        self._signs: deque[int] = deque(maxlen=n)
        self._flips = 0
        # Baseline swing: one sample per short window, the last `window / short` samples (≥ 5).
        self._baseline: deque[float] = deque(maxlen=max(5, self.cfg.window // n * 4))
        self._since_sample = 0
        self._base: float | None = None
        self._levels: dict[str, float] = {}   # per source: running mean of log loss (EMA)
        self._scales: dict[str, float] = {}   # per source: running mean |log loss - level| (EMA, clipped updates)
        self._seen: dict[str, int] = {}       # per source: deviations observed

    def _demix(self, by_source: dict[str, float]) -> float | None:
        """Mean over the record's sources of (log(loss) - that source's running level) / its running noise
        scale; None until a source has a level and a scale (`loss_source_min_history` observations)."""
        alpha = 2.0 / (self.cfg.window + 1)
        parts = []
        for name, val in by_source.items():
            if not (val > 0 and math.isfinite(val)):
                continue
            x = math.log(val)
            lvl = self._levels.get(name)
            if lvl is None:
                self._levels[name] = x
                continue
            dev = x - lvl
            self._levels[name] = lvl + alpha * dev
            seen = self._seen.get(name, 0) + 1
            self._seen[name] = seen
            scale = self._scales.get(name)
            a = abs(dev)
            if scale is None:   # the first deviations: a plain mean, then the EMA
                self._scales[name] = a
                continue
            if seen > self.cfg.loss_source_min_history and scale > 0:
                parts.append(dev / scale)
            rate = max(alpha, 1.0 / seen)
            self._scales[name] = scale + rate * (min(a, _SCALE_CLIP * scale) if scale > 0 else a) - rate * scale
        return sum(parts) / len(parts) if parts else None

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        loss = rec.loss
        if loss - loss != 0.0:  # nan or ±inf (math.isfinite without the call)
            return []
        by_source = rec.loss_by_source
        if not by_source and self.modes_of is not None and self.modes_of.modes and loss > 0:
            by_source = {self.modes_of.mode_of(loss): loss}   # an unlabelled multi-modal loss: its own modes
        if by_source:
            demixed = self._demix(by_source)
            if demixed is None:
                return []
            loss = demixed
        self._clock.advance(rec.step)
        prev = self._prev
        self._prev = loss
        if prev is None:
            return []
        d = loss - prev
        sign = (d > 0) - (d < 0)
        signs = self._signs
        if signs:
            if len(signs) == signs.maxlen:
                # Keep the count of direction reversals inside the window up to date in O(1).
                first, second = signs[0], signs[1]
                if first and second and first != second:
                    self._flips -= 1
            last = signs[-1]
            if sign and last and sign != last:
                self._flips += 1
        signs.append(sign)
        deltas = self._deltas
        deltas.append(abs(d))
        n = self.cfg.loss_osc_window
        if len(deltas) < n:
            return []
        flip_frac = self._flips / (n - 1)
        self._since_sample += 1
        sample = self._since_sample >= n
        # Same value as `ready and flip_frac >= min`, the cheap test first.
        flipping = (flip_frac >= self.cfg.loss_osc_min_direction_changes
                    and self._clock.since_start(rec.step) > self.cfg.warmup_steps + n and len(self._baseline) >= 3)
        if not (flipping or sample):  # the O(n) swing is only needed when it can matter
            if self._ep.active:
                self._ep.normal(rec.step)
            return []
        swing = sorted(self._deltas)[n // 2]
        base = self._base if self._base is not None else math.nan
        anomalous = flipping and swing > self.cfg.loss_osc_ratio * max(base, 1e-12)
        if not anomalous:
            if self._ep.active:
                self._ep.normal(rec.step)
            if sample:
                self._since_sample = 0
                self._baseline.append(swing)
                self._base = sorted(self._baseline)[len(self._baseline) // 2]
            return []
        if not self._ep.anomalous(rec.step):
            return []
        ev = {"swing": swing, "baseline_swing": base, "direction_changes": round(flip_frac, 3), "window": n,
              "since_step": self._ep.started_step}
        msg = (f"step {rec.step}: median step-to-step loss swing {fmt(swing)} over {n} steps is "
               f"{swing / base:.1f}x the run's baseline {fmt(base)}, with {flip_frac:.0%} direction changes.")
        return [Finding(self.symptom, rec.step, "warning", ev, msg, now)]
