"""Loss spike: the loss is a real outlier of its own recent window (median + k·robust sigma, and a minimum
relative jump), so a noisy but healthy curve does not trip it."""

from __future__ import annotations

import math
from collections import deque
from itertools import repeat
from operator import sub
from typing import cast

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, fmt
from ulyssesd.remediation.records import Record, StepRecord

_MAD_TO_SIGMA = 1.4826
# The baseline spans at most this many windows of training steps (see __init__).
SPAN_FACTOR = 10
# Below this many baseline records the sigma (MAD) rule is not trusted; a relative rule applies instead.
SIGMA_MIN_RECORDS = 10
# The step span never trims the baseline below this many records: a log with rows hundreds of steps apart would
# otherwise keep only the last two, whose spread says nothing about the per-row noise (a noisy healthy log then
# looks like a spike on every swing).
SPAN_MIN_RECORDS = 5


class LossSpikeDetector(EpisodeDetector):
    symptom = "loss_spike"

    def __init__(self, cfg: DetectorsConfig):
        # The baseline: the last `window` records, but none older than SPAN_FACTOR × window training steps
        # (and at least loss_spike_min_records): a curve logged every 100 steps keeps ~10 recent records,
        # not 10,000 steps of a decaying loss whose spread would hide any spike.
        self._win: deque[float] = deque(maxlen=cfg.window)
        self._win_steps: deque[int] = deque(maxlen=cfg.window)
        self._min = min(cfg.loss_spike_min_records, cfg.window)
        self._keep = max(self._min, SPAN_MIN_RECORDS)   # window >= 5, so the deque holds them
        super().__init__(cfg)

    def reset(self) -> None:
        self._win.clear()
        self._win_steps.clear()
        super().reset()
        self._ready = False
        self._ep_severe = False   # the current episode already reported a severe value
        n = self.cfg.loss_smooth_records
        self._smooth: deque[float] | None = deque(maxlen=n) if n > 1 else None
        self._smooth_sum = 0.0
        self._lag: deque[tuple[int, float]] = deque()   # smoothed values waiting to join the baseline
        self._run_start: int | None = None   # first step of the current run of values above the threshold
        self._median = math.nan
        self._sigma = math.nan
        self._threshold = math.inf
        # The MAD is O(window) in Python and the threshold moves slowly: refresh it every window/4 steps
        # (and whenever a value crosses it, to confirm against fresh statistics).
        self._every = max(1, self.cfg.window // 4)
        self._age = self._every

    def _check_ready(self, step: int) -> bool:
        self._ready = self._clock.since_start(step) >= self.cfg.warmup_steps and len(self._win) >= self._min
        return self._ready

    def _refresh(self) -> None:
        vals = sorted(self._win)
        n = len(vals)
        med = vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])
        dev = sorted(map(abs, map(sub, vals, repeat(med, n))))  # |x - med| without a Python-level loop
        mad = dev[len(dev) // 2]
        # A perfectly flat window would make any wiggle a spike: floor sigma at 0.1 % of the level.
        sigma = max(_MAD_TO_SIGMA * mad, 1e-3 * abs(med), 1e-12)
        self._median, self._sigma = med, sigma
        rel = self.cfg.loss_spike_min_rel
        if n >= SIGMA_MIN_RECORDS:
            self._threshold = max(med + self.cfg.loss_spike_mad * sigma, med + rel * abs(med))
        else:
            # A few records (a short or sparse log): a MAD of 2-9 values says little about the noise. Use twice
            # the relative floor, and never less than the window's own spread above its maximum.
            self._threshold = max(med + 2 * rel * abs(med), vals[-1] + (vals[-1] - vals[0]))
        self._age = 0

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        loss = rec.loss
        if loss - loss != 0.0:  # nan or ±inf (math.isfinite without the call)
            return []
        if self._smooth is not None:
            # A noisy preset compares the mean of the last N losses (its own noise averages out; a fault that
            # lasts moves the mean) instead of each raw loss.
            sm = self._smooth
            if len(sm) == sm.maxlen:
                self._smooth_sum -= sm[0]
            sm.append(loss)
            self._smooth_sum += loss
            if len(sm) < cast(int, sm.maxlen):
                self._clock.advance(rec.step)
                return []
            loss = self._smooth_sum / len(sm)
        span = self._clock.advance(rec.step)
        # Once ready, ready until reset (steps and the window only grow): skip the test then.
        ready = self._ready or self._check_ready(rec.step)
        if ready:
            self._age += span   # in training steps: a sparse log refreshes on every record
            if self._age >= self._every or loss > self._threshold:
                self._refresh()
        if ready and loss > self._threshold:
            # Spikes stay out of the baseline so a multi-step spike keeps being measured against healthy data.
            # Severe: far above the band (a catastrophic jump); the engine's grace is shorter for these.
            severe = loss >= self._median + self.cfg.loss_spike_severe_rel * abs(self._median)
            if not self._ep.active:
                # A noisy preset may ask a spike to persist before it is one (iid noise rarely repeats).
                if self._run_start is None:
                    self._run_start = rec.step - span + 1
                if rec.step - self._run_start + 1 < self.cfg.loss_spike_persist_steps:
                    return []
            onset = not self._ep.active
            fire = self._ep.anomalous(rec.step)
            if onset:
                self._ep_severe = False
                if self._run_start is not None and self.cfg.loss_spike_persist_steps > 1:
                    self._ep.started_step = self._run_start
            # An episode that turns severe is reported at once (not at the next refire): the engine acts sooner.
            escalated = severe and not self._ep_severe
            self._ep_severe = self._ep_severe or severe
            if self._smooth is not None:
                self._lag.clear()   # the values just before the spike may already carry it
            if not (fire or escalated):
                return []
            ev = {"loss": loss, "median": self._median, "sigma": self._sigma, "threshold": self._threshold,
                  "window": len(self._win), "since_step": self._ep.started_step, "severe": severe}
            if self._smooth is not None:
                ev["raw_loss"], ev["smoothed_over"] = rec.loss, len(self._smooth)
            # A flat window (sigma 0) or a zero median must not turn the report into a ZeroDivisionError.
            sigmas = (loss - self._median) / self._sigma if self._sigma else math.inf
            above = loss / self._median - 1 if self._median else math.inf
            msg = (f"step {rec.step}: {'mean ' if self._smooth is not None else ''}loss {fmt(loss)} is {sigmas:.1f} sigma above "
                   f"the {len(self._win)}-record median {fmt(self._median)} (threshold {fmt(self._threshold)})"
                   f"{f', {above:.0%} above it: severe' if severe else ''}.")
            return [Finding(self.symptom, rec.step, "critical" if severe else "warning", ev, msg, now)]
        self._run_start = None
        if self._ep.active:
            self._ep.normal(rec.step)
        win, steps = self._win, self._win_steps
        if self._smooth is not None:
            # A smoothed value joins the baseline one smoothing window late: the rising edge of a lasting
            # fault must not raise its own threshold before it crosses it.
            self._lag.append((rec.step, loss))
            if len(self._lag) <= cast(int, self._smooth.maxlen):
                return []
            step_in, loss = self._lag.popleft()
        else:
            step_in = rec.step
        win.append(loss)
        steps.append(step_in)
        span_limit = SPAN_FACTOR * self.cfg.window
        while len(win) > self._keep and rec.step - steps[0] >= span_limit:
            win.popleft()
            steps.popleft()
        return []
