"""Throughput drift: a sustained slowdown (one slow GPU in a large run, a throttled node) found by a one-sided
CUSUM on the step time against a long robust baseline, at an effect size learned from the run itself.

Effect size δ: a real GPU run's step time moves by several percent from one window to the next for no reason
a user would act on (clock and data-dependent phases: ±5 % between 50-step windows, 15 % excursions of 10-30
steps on the H100). So δ is learned from the run: the smallest effect size (never below drift_min_effect, never
above _EFFECT_CEILING: a fit makes the detector neither trigger-happy nor blind) at which this CUSUM, replayed
over the baseline's own step times in order, stays below h / drift_effect_margin; the largest δ the run has
needed so far is kept. From δ: the allowance k = max(drift_allowance, 0.75 δ), the clip c = max(drift_clip, δ),
and h = max(drift_threshold, drift_detect_steps × (δ - k), the noise term below). A slowdown of 2δ or more is then
found after about drift_detect_steps steps (every step counts at most c - k; measured at the defaults: 20-30 %
after 49-65 steps), one of δ later (10 %: 92-136 steps at 2 % step-time noise, 214-267 or later at 5 %), one
below 0.75 δ never (a shared box whose speed follows its neighbours by a few percent for hundreds of
steps is not a drift). With drift_min_effect = 0.02 (a quiet run whose user asks for few-percent drifts) this is
the classic setting: k 1.5 %, clip 10 %, h 0.6, a 3 % drift after ~40 steps, 5 % after ~17.

x = clip(t / baseline - 1, ±c) per training step (a record at log interval n stands for n steps);
S = max(0, S + n·(x - k)). Clipping keeps one checkpoint/eval/GC step from counting more than c; the record
after a checkpoint or control event is not counted at all. h also grows with the baseline's own per-step noise,
so a run whose step time varies a lot with data-dependent lengths needs a longer drift before it raises (the
false-alarm rate stays the same). On an alarm the baseline is rebuilt from the new level: a lasting slowdown is
reported once, not every refire, and the episode stays active while the new baseline is built (the engine's
grace sees it).

When per-rank times exist and one rank is the slowest on most records of the drift while its lead over rank 0
grew, the finding names that rank and is a `straggler`; otherwise it is a `throughput_drop`. Both ladders
collect evidence and alert; neither rolls back.
"""

from __future__ import annotations

from collections import Counter

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding, RollingMedian, fmt
from ulyssesd.remediation.records import EventRecord, Record

_MAD_TO_SIGMA = 1.4826
_EFFECT_CEILING = 0.5   # the learned effect size never exceeds this (a 50 % slowdown is always a drift)
# k as a share of the effect size: a slowdown below 3/4 of it never accumulates, however long (a shared box
# whose speed follows its neighbours by a few percent for hundreds of steps is not a drift to report).
_ALLOWANCE_OF_EFFECT = 0.75


class ThroughputDriftDetector(EpisodeDetector):
    symptom = "throughput_drop"
    skip_after_events = ("checkpoint_", "control_applied", "eval")
    symptoms = ("throughput_drop", "straggler")   # what its findings may be called (engine: `active` for both)

    def __init__(self, cfg: DetectorsConfig):
        self._base = RollingMedian(cfg.drift_baseline_window, min_count=cfg.drift_min_baseline)
        self._spread_base = RollingMedian(cfg.drift_baseline_window, min_count=cfg.drift_min_baseline)
        super().__init__(cfg)

    def reset(self) -> None:
        self._base.clear()
        self._spread_base.clear()
        super().reset()
        self._s = 0.0
        self._run_start: int | None = None
        self._ranks: Counter[int] = Counter()
        self._spreads: list[float] = []
        # Step times of the current excursion (S > 0): they join the baseline when it ends without an alarm,
        # so the baseline is not biased towards the fast steps, and never when it ends in one (a real drift).
        self._held: list[tuple[float, float | None]] = []
        self._rebase_from: int | None = None   # alarm step: the baseline is being rebuilt since then
        self._effect = self.cfg.drift_min_effect   # raised from the baseline's own history by _refit
        self._k, self._c = self._allowance_clip(self._effect)
        self._h = self.cfg.drift_threshold
        self._since_h = 50   # recompute h on the first CUSUM step
        self._clipped = 0

    @property
    def effect_size(self) -> float:
        """The smallest sustained relative slowdown it reports now (the floor, or what the run taught it)."""
        return self._effect

    def _allowance_clip(self, effect: float) -> tuple[float, float]:
        return max(self.cfg.drift_allowance, _ALLOWANCE_OF_EFFECT * effect), max(self.cfg.drift_clip, effect)

    def _cusum_h(self, effect: float) -> tuple[float, float, float]:
        """Allowance k, clip c and the effect's own alarm h (before the noise term) of an effect size."""
        k, c = self._allowance_clip(effect)
        return k, c, max(self.cfg.drift_threshold, self.cfg.drift_detect_steps * (effect - k))

    def _quiet(self, rel: list[float], span: int, effect: float) -> bool:
        """True when the CUSUM at this effect size, run over the baseline's own history, stays below
        h / drift_effect_margin."""
        k, c, h = self._cusum_h(effect)
        limit = h / self.cfg.drift_effect_margin
        s = 0.0
        for x in rel:
            s += span * ((c if x > c else -c if x < -c else x) - k)
            if s < 0.0:
                s = 0.0
            elif s >= limit:
                return False
        return True

    def _run_effect(self, span: int) -> float:
        """The run's own effect size: the smallest one (>= drift_min_effect, <= _EFFECT_CEILING) at which the
        CUSUM replayed over the baseline's step times in order (its window-to-window phases, short excursions)
        stays below h / drift_effect_margin. Close to monotone in the effect (k, c and h grow with it): a bisection."""
        med = self._base.med
        lo = self.cfg.drift_min_effect
        if not med:
            return lo
        rel = [t / med - 1.0 for t in self._base.in_order()]
        if self._quiet(rel, span, lo):
            return lo
        hi = _EFFECT_CEILING
        if not self._quiet(rel, span, hi):
            return hi
        while hi - lo > 0.0025:
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if self._quiet(rel, span, mid) else (mid, hi)
        return hi

    def _refit(self, span: int) -> None:
        """Effect size, allowance, clip and h from the baseline; h is raised for a noisy baseline:
        ~ drift_noise_factor · variance per step / allowance."""
        cfg = self.cfg
        # The largest effect the run has needed so far: its phases seen once stay learned after they leave
        # the baseline window.
        self._effect = max(self._effect, self._run_effect(span))
        k, c, h = self._cusum_h(self._effect)
        self._k, self._c = k, c
        vals = self._base.values()
        med = self._base.med
        if not vals or not med:
            self._h = h
            return
        mad = sorted(abs(v - med) for v in vals)[len(vals) // 2]
        rel_sigma = min(c, _MAD_TO_SIGMA * mad / med)
        var_per_step = rel_sigma * rel_sigma * max(1, span)
        # The baseline median itself is uncertain (~1.25 sigma / sqrt(n)): a baseline that is 1 % too low eats
        # 1 % of the allowance, so the allowance left is what sets the false-alarm rate.
        k_left = max(k / 3, k - 2 * 1.2533 * rel_sigma / max(1, len(vals)) ** 0.5)
        self._h = max(h, cfg.drift_noise_factor * var_per_step / k_left)

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not self.cfg.drift_enabled:
            return []
        if isinstance(rec, EventRecord):
            self._note_event(rec)
            return []
        t = rec.step_time_max_s if rec.step_time_max_s is not None else rec.step_time_s
        if t is None or not t > 0:
            return []
        span = self._clock.advance(rec.step)
        if self._skipped():
            return []
        cfg = self.cfg
        spread = (rec.step_time_max_s / rec.step_time_s
                  if rec.step_time_max_s and rec.step_time_s and rec.step_time_max_s == rec.step_time_max_s else None)
        base = self._base.med
        warm = self._clock.since_start(rec.step) >= cfg.step_time_warmup()
        if self._rebase_from is not None:
            # After an alarm: learn the new level; the episode ends once the new baseline stands.
            self._base.add(t)
            if spread is not None:
                self._spread_base.add(spread)
            if self._base.med is not None and rec.step - self._rebase_from >= cfg.drift_min_baseline:
                self._rebase_from = None
                self._ep.normal(rec.step)
            return []
        if base is None or not warm:
            self._base.add(t)
            if spread is not None:
                self._spread_base.add(spread)
            return []
        self._since_h += 1
        if self._since_h >= 50:   # the noise estimate moves slowly: an O(window) refit every 50 records is enough
            self._refit(span)
            self._since_h = 0
        x = t / base - 1.0
        c = self._c
        if x >= c:
            x = c
            self._clipped += span   # consecutive steps at the clip
        else:
            self._clipped = 0
            x = -c if x < -c else x
        s = self._s + span * (x - self._k)
        if s <= 0.0:
            self._s, self._run_start = 0.0, None
            self._ranks.clear()
            self._spreads.clear()
            self._held.append((t, spread))
            for held_t, held_spread in self._held:
                self._base.add(held_t)
                if held_spread is not None:
                    self._spread_base.add(held_spread)
            self._held.clear()
            return []
        self._s = s
        if len(self._held) < 10_000:
            self._held.append((t, spread))
        if self._run_start is None:
            self._run_start = rec.step - span + 1
        if rec.slowest_rank is not None:
            self._ranks[rec.slowest_rank] += 1
        if spread is not None and len(self._spreads) < 10_000:
            self._spreads.append(spread)
        if s < self._h:
            return []
        if 0 < self._clipped <= cfg.throughput_persist_steps:
            # The latest steps all at the clip: a jump, not a drift. The slow-step/straggler/throughput
            # detectors own those; let them persist first (the engine drops this finding while one is active).
            return []
        steps = rec.step - self._run_start + 1
        # Alarm: the step time drifted up. Who is slow?
        n_rec = sum(self._ranks.values())
        rank, share = (self._ranks.most_common(1)[0] if self._ranks else (None, 0))
        spread_now = sorted(self._spreads)[len(self._spreads) // 2] if self._spreads else None
        spread_base = self._spread_base.med
        lead_grew = (spread_now is not None and spread_base is not None
                     and spread_now - spread_base >= cfg.drift_allowance)
        attributed = rank is not None and n_rec > 0 and share / n_rec >= cfg.drift_rank_share and lead_grew
        excess = self._s / max(1, steps) + self._k   # mean relative slowdown over the drift
        symptom = "straggler" if attributed else "throughput_drop"
        ev = {"detector": "cusum", "step_time_s": t, "baseline_step_time_s": base, "slowdown": round(excess, 4),
              "cusum": round(self._s, 4), "threshold": round(self._h, 4), "drift_steps": steps,
              "effect_size": round(self._effect, 4), "min_effect": self.cfg.drift_min_effect,
              "allowance": round(self._k, 4), "clip": round(self._c, 4),
              "since_step": self._run_start, "slowest_rank": rank if attributed else None,
              "rank_share": round(share / n_rec, 3) if n_rec else None, "rank_spread": spread_now,
              "baseline_rank_spread": spread_base}
        who = (f"; rank {rank} was the slowest on {share}/{n_rec} records and its lead over rank 0 grew "
               f"from {spread_base:.3f}x to {spread_now:.3f}x" if attributed and spread_now and spread_base else
               "; no single rank explains it")
        msg = (f"step {rec.step}: step time drifted ~{excess:.1%} above its {len(self._base)}-record baseline "
               f"{fmt(base)} s over the last {steps} steps (CUSUM {self._s:.3f} > {self._h:.3f}; effect size "
               f"{self._effect:.1%}, learned from the run's own step times, floor {self.cfg.drift_min_effect:.0%}){who}.")
        self._ep.anomalous(rec.step)
        self._ep.started_step = self._run_start
        # Rebuild the baseline from the new level: one finding per drift, not one per refire.
        self._s, self._run_start = 0.0, None
        self._ranks.clear()
        self._spreads.clear()
        self._held.clear()
        self._base.clear()
        self._spread_base.clear()
        self._rebase_from = rec.step
        self._since_h = 50   # a new baseline: a new noise estimate on the next CUSUM step
        return [Finding(symptom, rec.step, "warning", ev, msg, now)]
