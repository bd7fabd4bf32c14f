"""Loss spike: the loss is a real outlier of its own recent window (median + k·robust sigma, and a minimum
relative jump), so a noisy but healthy curve does not trip it.

When the job reports where its samples came from (`loss_by_source`), each source is judged in its own band
(loss_band.py) and a spike is what a user would call an instability: the loss of several sources above
their bands at once (the optimizer or the schedule), or one source's smoothed loss above its band for
`loss_source_persist` of its observations in a row (that source's data). A copy task whose loss sits at 5
while prose sits at 0.6 is two levels, not a spike."""

from __future__ import annotations

import math
from collections import deque
from itertools import repeat
from operator import sub
from typing import cast

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, fmt
from ulyssesd.remediation.detectors.loss_band import BandVerdict, SourceBand
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
        self.bands: dict[str, SourceBand] = {}   # per data source, once a record names one
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
        # The per-source bands outlive a restart (the run's own distribution does); what is in flight does not.
        for band in self.bands.values():
            band.restart()
        self._src_runs: dict[str, int] = {}        # consecutive anomalous observations per source
        self._src_first: dict[str, int] = {}       # the step where each source's current anomalous run began
        self._src_onset: int | None = None
        self._any_ready = False   # some source's band judges (once true, until the bands are dropped)
        self._last_span = 1

    # Records without `loss_by_source` in a run that reports sources are judged as this source.
    UNLABELLED = "(unlabelled)"

    def _band(self, name: str) -> SourceBand:
        band = self.bands.get(name)
        if band is None:
            if len(self.bands) >= 256:   # bounded: a job naming every sample is not naming sources
                name = self.UNLABELLED
                band = self.bands.get(name)
                if band is not None:
                    return band
            c = self.cfg
            band = self.bands[name] = SourceBand(
                name, window=c.window, level_records=c.loss_source_level_records, smooth=c.loss_source_smooth, k=c.loss_spike_mad,
                min_rel=c.loss_spike_min_rel, severe_rel=c.loss_spike_severe_rel,
                min_history=c.loss_source_min_history)
        return band

    def _observe_sources(self, rec: StepRecord, by_source: dict[str, float], now: float) -> list[Finding]:
        span = self._last_span = self._clock.advance(rec.step)
        warm = self._clock.since_start(rec.step) >= self.cfg.warmup_steps
        verdicts: list[BandVerdict] = []
        for name, loss in by_source.items():
            if loss - loss != 0.0:
                continue   # non-finite: the NaN detector's
            v = self._band(name).observe(loss, rec.step)
            verdicts.append(v)
            run = self._src_runs[name] = self._src_runs.get(name, 0) + 1 if v.anomalous and warm else 0
            if run == 1:
                self._src_first[name] = rec.step
        # Sources seen lately (each within its own recent observations) and those above their bands now.
        horizon = 4 * self.cfg.loss_source_smooth * max(1, len(self.bands))
        live = [b for b in self.bands.values() if b.last_verdict is not None and b.last_verdict.ready
                and b.last_step is not None and rec.step - b.last_step <= horizon]
        if not live:
            return []   # no band judges yet: the whole loss is judged meanwhile (observe)
        high = [b for b in live if b.last_verdict is not None and b.last_verdict.anomalous
                and self._src_runs.get(b.name, 0) > 0]
        persist = [b for b in high if self._src_runs.get(b.name, 0) >= self.cfg.loss_source_persist]
        across = len(high) >= 2 and 2 * len(high) >= len(live)
        if not warm or not (across or persist):
            self._src_onset = None
            if self._ep.active:
                self._ep.normal(rec.step)
            return []
        if self._src_onset is None:
            # The onset: where the first implicated source's run above its band began.
            self._src_onset = min([self._src_first.get(b.name, rec.step) for b in high] + [rec.step - span + 1])
        severe = any(b.last_verdict is not None and b.last_verdict.severe for b in high)
        onset = not self._ep.active
        fire = self._ep.anomalous(rec.step)
        if onset:
            self._ep_severe = False
            self._ep.started_step = min(self._src_onset, rec.step)
        escalated = severe and not self._ep_severe
        self._ep_severe = self._ep_severe or severe
        if not (fire or escalated):
            return []
        implicated = sorted(b.name for b in high)
        detail = {b.name: {"loss": b.last_verdict.value, "level": b.last_verdict.level,
                           "threshold": b.last_verdict.threshold, "sigma_rel": b.last_verdict.scale}
                  for b in high if b.last_verdict is not None}
        worst = max(high, key=lambda b: (b.last_verdict.value - b.last_verdict.level)
                    / max(b.last_verdict.scale, 1e-12) if b.last_verdict else 0.0)
        wv = worst.last_verdict
        assert wv is not None
        where = (f"{len(high)} of {len(live)} data sources ({', '.join(implicated)}) above their own bands at once"
                 if across else f"data source {worst.name!r} above its own band for "
                                f"{self._src_runs.get(worst.name, 0)} of its steps in a row")
        ev = {"loss": rec.loss, "median": wv.level, "sigma_rel": wv.scale, "threshold": wv.threshold,
              "window": len(self.bands), "since_step": self._ep.started_step, "severe": severe,
              "sources": detail, "implicated": implicated,
              "implicates": "the optimizer or the schedule (all sources at once)" if across and len(high) == len(live)
              else f"the data of source(s) {', '.join(implicated)}" if not across else "several sources"}
        msg = (f"step {rec.step}: {where}; {worst.name} loss {fmt(wv.value)} vs its level {fmt(wv.level)} "
               f"(threshold {fmt(wv.threshold)}){', severe' if severe else ''}.")
        return [Finding(self.symptom, rec.step, "critical" if severe else "warning", ev, msg, now)]

    def source_summary(self) -> list[dict[str, float | int | str | None]]:
        """Each source's band (level, sigma, threshold, first smoothed value): for status and tune."""
        return [b.summary() for b in self.bands.values()]

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
        by_source = rec.loss_by_source
        if by_source is not None or self.bands:
            found = self._observe_sources(rec, by_source or {self.UNLABELLED: rec.loss}, now)
            if self._bands_ready:
                return found
            # No source has history enough for its band yet (the first tens of steps): the whole loss is
            # judged as before meanwhile (its clock is the bands' own).
            return self._observe_total(rec, now, advance=False)
        return self._observe_total(rec, now)

    @property
    def _bands_ready(self) -> bool:
        if not self._any_ready:
            self._any_ready = any(b.last_verdict is not None and b.last_verdict.ready for b in self.bands.values())
        return self._any_ready

    def _observe_total(self, rec: StepRecord, now: float, advance: bool = True) -> list[Finding]:
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
                if advance:
                    self._clock.advance(rec.step)
                return []
            loss = self._smooth_sum / len(sm)
        span = self._clock.advance(rec.step) if advance else self._last_span
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
