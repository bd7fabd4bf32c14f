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
from typing import Any, cast

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, fmt
from ulyssesd.remediation.detectors.loss_band import BandVerdict, HeldRise, SourceBand, split_modes
from ulyssesd.remediation.records import Record, StepRecord

_MAD_TO_SIGMA = 1.4826
# The standard error of a median of n normal values is about 1.25 sigma / sqrt(n) (pi/2 under the root).
_MEDIAN_SE = math.sqrt(math.pi / 2)
# The baseline spans at most this many windows of training steps (see __init__).
SPAN_FACTOR = 10
# Below this many baseline records the sigma (MAD) rule is not trusted; a relative rule applies instead.
SIGMA_MIN_RECORDS = 10
# The step span never trims the baseline below this many records: a log with rows hundreds of steps apart would
# otherwise keep only the last two, whose spread says nothing about the per-row noise (a noisy healthy log then
# looks like a spike on every swing).
SPAN_MIN_RECORDS = 5
# Before the per-source bands judge: a spike is every source of the step at this many times its largest loss.
EARLY_FACTOR = 3.0


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
        self._sourced = False                     # a record named its sources
        # Without sources: the loss's own modes (a mixture), once the run shows it is multi-modal.
        self.modes: list[tuple[str, float]] = []  # (band name, log centre), ascending
        self._probe: deque[float] = deque(maxlen=max(cfg.window, 60))
        self._probe_age = 0
        # The run's own noise in log space: log(loss / median) of every healthy value that joins the baseline
        # (against a trusted median), kept across restarts: a reset empties the window, not what the run
        # taught about its noise. A loss whose per-step values routinely differ 20x is not "severe" at 1.5x.
        self._noise: deque[float] = deque(maxlen=max(2 * cfg.window, 50))
        self._noise_centre = math.nan
        self._noise_sigma = math.nan   # robust sigma of `_noise` (nan: too few yet)
        self._rise = HeldRise(cfg.window)   # judges during the warm-up: a jump x3 that holds (loss_band.py)
        super().__init__(cfg)

    def reset(self) -> None:
        self._win.clear()
        self._win_steps.clear()
        self._rise.reset()
        super().reset()
        self._ready = False
        self._ep_severe = False   # the current episode already reported a severe value
        n = self.cfg.loss_smooth_records
        self._smooth: deque[float] | None = deque(maxlen=n) if n > 1 else None
        self._smooth_sum = 0.0
        self._lag: deque[tuple[int, float]] = deque()   # smoothed values waiting to join the baseline
        self._run_start: int | None = None   # first step of the current run of values above the threshold
        # The current excursion (from its first value above the threshold until its episode ends), in log
        # space against the median it started from: its level and its length say whether it is severe.
        self._exc_base = math.nan
        self._exc: deque[float] = deque(maxlen=self.cfg.window)
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
        self._early_max: dict[str, float] = {}   # per source: its largest loss before the bands judge
        self._early_run = 0

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
        span = self._clock.advance(rec.step)
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
        mixture = bool(self.modes) and not self._sourced
        if mixture:
            # Modes of an unlabelled loss: a value between two modes is the lower one's outlier by construction;
            # only values above the top mode are judged (a blow-up lifts every value above it).
            high = [b for b in high if b.name == self.modes[-1][0]]
        persist = [b for b in high if self._src_runs.get(b.name, 0) >= self.cfg.loss_source_persist]
        across = not mixture and len(high) >= 2 and 2 * len(high) >= len(live)
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
        one, many = ("data source", "data sources") if not mixture else ("mode of the loss", "modes of the loss")
        where = (f"{len(high)} of {len(live)} {many} ({', '.join(implicated)}) above their own bands at once"
                 if across else f"{one} {worst.name!r} above its own band for "
                                f"{self._src_runs.get(worst.name, 0)} of its observations in a row")
        ev: dict[str, Any] = {"loss": rec.loss, "median": wv.level, "sigma_rel": wv.scale, "threshold": wv.threshold,
              "window": len(self.bands), "since_step": self._ep.started_step, "severe": severe,
              "sources": detail, "implicated": implicated,
              "implicates": "the optimizer or the schedule (all sources at once)" if across and len(high) == len(live)
              else f"the data of source(s) {', '.join(implicated)}" if not across else "several sources"}
        if self.modes and not self._sourced:
            ev["implicates"] = "the loss above its own modes (no sources reported)"
            ev["modes"] = {name: math.exp(c) for name, c in self.modes}
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
            # the relative floor, and never less than the window's own spread above its maximum. One earlier
            # outlier (a recovered one-step blip) is not the spread: from 5 records a top value beyond 4x the
            # rest's spread above the rest is left out of it, so it cannot hide a later, larger spike.
            top = vals[-1]
            if n >= SPAN_MIN_RECORDS and top > vals[-2] + 4 * (vals[-2] - vals[0]):
                top = vals[-2]
            self._threshold = max(med + 2 * rel * abs(med), top + (top - vals[0]))
        noise = list(self._noise)
        if len(noise) >= SIGMA_MIN_RECORDS:
            centre = sorted(noise)[len(noise) // 2]
            self._noise_centre = max(0.0, centre)
            self._noise_sigma = max(_MAD_TO_SIGMA * sorted(abs(x - centre) for x in noise)[len(noise) // 2], 1e-3)
        elif n >= SPAN_MIN_RECORDS and vals[0] > 0:
            # Not learned yet (the run's first records): the window's own log-space noise stands in for it.
            # Below 10 records from its second differences in time order (a trend is no noise: a sparse log's
            # rows rising 6.4 -> 6.6 -> 7.3 are a divergence starting); from 10 its MAD. Fewer than 5 records
            # (a sparse log's first rows) say nothing of the noise: the relative line alone.
            self._noise_centre = 0.0
            if n < SIGMA_MIN_RECORDS:
                xs = [math.log(v) for v in self._win]
                d2 = sorted(abs(a - 2 * b + c) for a, b, c in zip(xs, xs[1:], xs[2:], strict=False))
                self._noise_sigma = max(_MAD_TO_SIGMA * d2[len(d2) // 2] / math.sqrt(6), 1e-3)
            else:
                logs = [math.log(v) for v in vals]
                self._noise_sigma = max(_MAD_TO_SIGMA * sorted(abs(x - logs[n // 2]) for x in logs)[n // 2], 1e-3)
        self._age = 0

    def severe_line(self) -> float:
        """The loss from which one value is severe at once: `loss_spike_severe_rel` above the median and beyond
        the run's own noise (its learned log-space scale, k sigmas, like a band's) once known. A sparse log of a
        few records never learns it: the relative line alone, as a diverging 5-row curve needs."""
        med = self._median
        line = med + self.cfg.loss_spike_severe_rel * abs(med)
        if med > 0 and self._noise_sigma == self._noise_sigma:
            line = max(line, med * math.exp(min(self._noise_centre + self.cfg.loss_spike_mad * self._noise_sigma,
                                                700.0)))
        return line

    def _excursion(self, loss: float) -> None:
        """A value of the current excursion (above the threshold or not): its log ratio to the median the
        excursion started from."""
        if self._exc_base != self._exc_base:
            self._exc_base = self._median
            self._exc.clear()
        ratio = loss / self._exc_base if self._exc_base > 0 else 0.0
        if 0 < ratio < math.inf:   # a denormal loss over a normal median underflows to 0
            self._exc.append(math.log(ratio))

    def _excursion_level(self) -> float | None:
        """The excursion's level as a factor over the median it started from, when it is severe by
        persistence: the median of its log ratios is `severe_rel` above that median and beyond the run's noise
        for an average of that many values (k sigmas / sqrt(n), x1.25 for a median). Ten values at 8x a loss
        whose single values swing 50x are a blow-up; one value is not, and iid noise holds no level (its
        median stays at the baseline). None when it is not (yet) severe."""
        n = len(self._exc)
        if n < 2 or self._noise_sigma != self._noise_sigma:
            return None
        vals = sorted(self._exc)
        level = vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])
        noise = self.cfg.loss_spike_mad * _MEDIAN_SE * self._noise_sigma / math.sqrt(n)
        if level >= math.log1p(self.cfg.loss_spike_severe_rel) and level - self._noise_centre >= noise:
            return math.exp(level)
        return None

    def _excursion_end(self) -> None:
        self._exc_base = math.nan
        self._exc.clear()

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        by_source = rec.loss_by_source
        if by_source is not None:
            self._sourced = True
        elif self.modes and not self._sourced:
            loss = rec.loss
            by_source = {self.mode_of(loss): loss} if loss - loss == 0.0 and loss > 0 else {}
        if by_source is not None or self._sourced:
            found = self._observe_sources(rec, by_source if by_source is not None else {self.UNLABELLED: rec.loss}, now)
            if self._bands_ready:
                return found
            return self._observe_early(rec, by_source if by_source is not None else {self.UNLABELLED: rec.loss}, now)
        found = self._observe_total(rec, now)
        # A hand-set smoothing (loss_smooth_records > 1) is the user's own answer to a multi-modal loss.
        if not found and self.cfg.loss_mixture and self._smooth is None:
            self._probe_modes(rec)
        return found

    def mode_of(self, loss: float) -> str:
        """The mode whose centre is nearest in log scale (a value above the top mode is the top mode's)."""
        x = math.log(loss)
        return min(self.modes, key=lambda m: abs(x - m[1]))[0]

    def _probe_modes(self, rec: StepRecord) -> None:
        """Collect healthy raw losses; every `window` records test whether they are multi-modal, and if they
        are, judge the loss from now on within its mode (a band per mode, seeded with the window)."""
        loss = rec.loss
        if loss - loss != 0.0 or loss <= 0 or self._ep.active:
            return
        self._probe.append(loss)
        self._probe_age += 1
        # Tested every quarter window once full (O(n^2) in Python: ~1 ms per test).
        if self._probe_age < max(1, self.cfg.window // 4) or len(self._probe) < cast(int, self._probe.maxlen):
            return
        self._probe_age = 0
        centres = split_modes(list(self._probe))
        if centres is None:
            return
        # A mixture draws its modes at random; a loss that alternates between two levels step after step is
        # an oscillation (a symptom), not a mixture: the switch rate says which.
        labels = [min(range(len(centres)), key=lambda k: abs(math.log(v) - centres[k])) for v in self._probe]
        shares = [labels.count(k) / len(labels) for k in range(len(centres))]
        switches = sum(a != b for a, b in zip(labels, labels[1:], strict=False)) / (len(labels) - 1)
        if switches > 1 - sum(w * w for w in shares) + 0.15:
            return
        # ...and it draws them throughout: a level that moved (a restart, a resumed run) is two blocks in time,
        # not two modes. Each mode must show in every quarter of the window.
        q = len(labels) // 4
        for part in (labels[i * q:(i + 1) * q] for i in range(4)):
            if any(part.count(k) < 0.3 * shares[k] * len(part) for k in range(len(centres))):
                return
        self.modes = [(f"mode-{k + 1}", c) for k, c in enumerate(centres)]
        for v in self._probe:   # seed each mode's band with its members, in time order
            self._band(self.mode_of(v)).observe(v, rec.step)

    def _observe_early(self, rec: StepRecord, by_source: dict[str, float], now: float) -> list[Finding]:
        """Before any source's band judges (the first tens of steps, when the sources' levels already
        differ): only a jump every source of the step makes, to `EARLY_FACTOR` x its own largest loss so far,
        for 2 records in a row, is a spike. The whole loss is not judged: its modes would be spikes."""
        jumped, detail = bool(by_source), {}
        for name, loss in by_source.items():
            band = self.bands.get(name)
            top = self._early_max.get(name)
            if band is None or top is None or band.count < 3 or not loss > EARLY_FACTOR * top:
                jumped = False
            else:
                detail[name] = {"loss": loss, "max_before": top}
            if not jumped and loss - loss == 0.0:
                self._early_max[name] = max(top if top is not None else loss, loss)
        warm = self._clock.since_start(rec.step) >= self.cfg.warmup_steps
        self._early_run = self._early_run + 1 if jumped and warm else 0
        if self._early_run < 2:
            if self._ep.active and not jumped:
                self._ep.normal(rec.step)
            return []
        onset = not self._ep.active
        if not self._ep.anomalous(rec.step):
            return []
        if onset:
            self._ep.started_step = rec.step - 1
        names = sorted(detail)
        ev = {"loss": rec.loss, "sources_early": detail, "since_step": self._ep.started_step, "severe": True,
              "implicated": names, "implicates": "the optimizer or the schedule (every source of the step)"}
        msg = (f"step {rec.step}: every source of the step ({', '.join(names)}) jumped above {EARLY_FACTOR:g}x its "
               f"own largest loss so far, two steps in a row (the sources' bands are not ready yet).")
        return [Finding(self.symptom, rec.step, "critical", ev, msg, now)]

    @property
    def _bands_ready(self) -> bool:
        if not self._any_ready:
            self._any_ready = any(b.last_verdict is not None and b.last_verdict.ready for b in self.bands.values())
        return self._any_ready

    def _held_rise(self, rec: StepRecord, loss: float, rise: tuple[int, float, int], now: float) -> list[Finding]:
        """A value of a rise above x3 the run's earlier level (HeldRise): a severe spike once it has held."""
        began, level, held = rise
        onset = not self._ep.active
        if not self._ep.anomalous(rec.step):
            return []
        if onset:
            self._ep.started_step = began
        ev = {"loss": loss, "median": level, "since_step": self._ep.started_step, "severe": True,
              "held_values": held, "rule": "held_rise"}
        msg = (f"step {rec.step}: loss {fmt(loss)} has held {held} records at >= {self._rise.factor:g}x the run's "
               f"earlier level {fmt(level)} (since step {began}): severe, judged before the warm-up ends.")
        return [Finding(self.symptom, rec.step, "critical", ev, msg, now)]

    def _observe_total(self, rec: StepRecord, now: float) -> list[Finding]:
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
        rise = None if ready or self._smooth is not None else self._rise.observe(rec.step, loss)
        if rise is not None and rise[2] >= self._rise.records:   # held: a finding, kept out of the baseline
            return self._held_rise(rec, loss, rise, now)
        if ready:
            self._age += span   # in training steps: a sparse log refreshes on every record
            if self._age >= self._every or loss > self._threshold:
                self._refresh()
        if ready and loss > self._threshold:
            # Spikes stay out of the baseline so a multi-step spike keeps being measured against healthy data.
            # Severe: far above the band (a catastrophic jump); the engine's grace is shorter for these.
            # Severe: one value far beyond the run's own noise, or an excursion that holds a level beyond it.
            self._excursion(loss)
            line = self.severe_line()
            held = None if loss >= line else self._excursion_level()
            severe = loss >= line or held is not None
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
            if held is not None:   # severe by persistence: its level, its length and the run's noise it beat
                ev.update(held_level=held, held_values=len(self._exc), noise_sigma_log=self._noise_sigma)
            if self._smooth is not None:
                ev["raw_loss"], ev["smoothed_over"] = rec.loss, len(self._smooth)
            # A flat window (sigma 0) or a zero median must not turn the report into a ZeroDivisionError.
            sigmas = (loss - self._median) / self._sigma if self._sigma else math.inf
            above = loss / self._median - 1 if self._median else math.inf
            why = ""
            if held is not None:
                why = (f"; its last {len(self._exc)} values held {held:.1f}x the median before them, beyond the "
                       f"run's own noise: severe")
            elif severe:
                why = f", {above:.0%} above it: severe"
            msg = (f"step {rec.step}: {'mean ' if self._smooth is not None else ''}loss {fmt(loss)} is {sigmas:.1f} sigma above "
                   f"the {len(self._win)}-record median {fmt(self._median)} (threshold {fmt(self._threshold)}){why}.")
            return [Finding(self.symptom, rec.step, "critical" if severe else "warning", ev, msg, now)]
        self._run_start = None
        if self._ep.active:
            self._excursion(loss)
            self._ep.normal(rec.step)
        if not self._ep.active and self._exc_base == self._exc_base:
            self._excursion_end()
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
        if self._ready and self._median > 0 and loss > 0 and len(win) >= min(SIGMA_MIN_RECORDS, self.cfg.window):
            # Only against a trusted median (warm, a full-enough window): the first records' median of two
            # says nothing about the noise, and a falling early loss would widen it.
            ratio = loss / self._median
            if 0 < ratio < math.inf:   # a denormal loss over a normal median underflows to 0
                self._noise.append(math.log(ratio))
        win.append(loss)
        steps.append(step_in)
        span_limit = SPAN_FACTOR * self.cfg.window
        while len(win) > self._keep and rec.step - steps[0] >= span_limit:
            win.popleft()
            steps.popleft()
        return []
