"""Early warning from the signals other than the grad norm (docs/CONTRACTS.md, optional step fields):

- `logit_max` (the largest |output logit| of the step): logit growth precedes the loss blow-up of a
  diverging LM (the softmax saturates; PaLM's z-loss and QK-norm work exist for it);
- `update_ratio` ({layer group: ||delta W|| / ||W||} of the step): an update out of proportion to its
  weights in one group (an LR too high for it, Adam's second moment gone stale) comes before the loss moves;
- `loss_scale` (fp16): the dynamic scale halving again and again to a quarter of its typical level after
  start-up is the overflow storm's run-up; the storm detector acts at `overflow_max_halvings`, this warns first.

Each number signal is judged against the run's own history of that signal, as the grad norm is
(early_warning.py): an EMA of the mean and variance of its log; a step is out at z > `z` (only upward: a
shrinking update or logit is no blow-up), out-of-distribution values do not update the EMA and values above
2 sigma update it as 2-sigma ones (a steady growth would otherwise drag the baseline along), and `hits` of
the last `of` judged values out is a warning, once per `cooldown` steps per signal. Pure: `observe` returns
the warnings of a record.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from ulyssesd.remediation.records import StepRecord

SCALE_DROP = 4.0   # a loss scale this many times below its typical level, falling, is a run-up
WINSOR_Z = 2.0   # values above this z update the EMA as if they were at it


class LogEma:
    """EMA mean and variance of log(x), and the z-score of a new value against them (ZClip's statistic)."""

    __slots__ = ("alpha", "mean", "var", "n", "flags")

    def __init__(self, alpha: float, of: int):
        self.alpha, self.mean, self.var, self.n = alpha, 0.0, 0.0, 0
        self.flags: deque[tuple[int, float]] = deque(maxlen=of)

    def judge(self, step: int, x: float, z_max: float, min_count: int) -> float:
        """The z of log `x` (0 until `min_count` values); updates the EMA unless the value is out."""
        lx = math.log(x)
        z = 0.0
        if self.n >= min_count:
            z = (lx - self.mean) / max(math.sqrt(self.var), 0.05)
            self.flags.append((step, z))
        if self.n < min_count or z <= z_max:
            if self.n == 0:
                self.mean = lx
            if z > WINSOR_Z:   # a high value moves the baseline at most as a 2-sigma one: a trend cannot hide in it
                lx = self.mean + WINSOR_Z * max(math.sqrt(self.var), 0.05)
            d = lx - self.mean
            self.mean += self.alpha * d
            self.var = (1 - self.alpha) * (self.var + self.alpha * d * d)
            self.n += 1
        return z


class SignalWatch:
    def __init__(self, z: float = 4.0, hits: int = 3, of: int = 5, min_count: int = 30, cooldown: int = 200,
                 alpha: float = 0.03, scale_halvings: int = 2, scale_window: int = 50, startup_steps: int = 100):
        self.z, self.hits, self.of, self.min_count, self.cooldown, self.alpha = z, hits, of, min_count, cooldown, alpha
        self.scale_halvings, self.scale_window, self.startup_steps = scale_halvings, scale_window, startup_steps
        self._ema: dict[str, LogEma] = {}
        self._last: dict[str, int] = {}          # signal -> step of its last warning
        self._scale: float | None = None         # the last loss scale seen
        self._levels: deque[float] = deque(maxlen=1000)   # the scale's recent values after start-up
        self._halvings: deque[int] = deque()     # steps of recent halvings
        self._first_step: int | None = None

    def reset(self) -> None:
        """A restart: the signals' history stays (the run's distribution), the recent flags do not."""
        for e in self._ema.values():
            e.flags.clear()
        self._scale, self._first_step = None, None
        self._halvings.clear()

    def observe(self, rec: StepRecord) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if rec.skipped:
            return out   # a skipped fp16 step has no update; its loss scale is read below
        if rec.logit_max is not None:
            self._number(rec.step, "logit_max", abs(rec.logit_max), "largest |output logit|", out)
        if rec.update_ratio:
            for group, r in rec.update_ratio.items():
                self._number(rec.step, f"update_ratio:{group}", r, f"update/weight ratio of {group}", out)
        return out

    def observe_scale(self, rec: StepRecord) -> dict[str, Any] | None:
        """The fp16 loss scale's trajectory (skipped steps included: they are where it halves): a warning when
        it has halved `scale_halvings` times within `scale_window` steps to a quarter or less of its typical
        level since start-up (the median of its recent values; a healthy scaler halves once from its high
        and grows back)."""
        s = rec.loss_scale
        if s is None or not (s > 0 and math.isfinite(s)):
            return None
        if self._first_step is None:
            self._first_step = rec.step
        prev, self._scale = self._scale, s
        settled = rec.step - self._first_step >= self.startup_steps   # start-up calibration halves freely
        if settled:
            self._levels.append(s)
        if prev is None or s >= prev or not settled:
            return None
        self._halvings.append(rec.step)
        while self._halvings and rec.step - self._halvings[0] > self.scale_window:
            self._halvings.popleft()
        if len(self._halvings) < self.scale_halvings or len(self._levels) < self.scale_window:
            return None
        typical = sorted(self._levels)[len(self._levels) // 2]
        if s * SCALE_DROP > typical:
            return None
        return self._warn(rec.step, "loss_scale", self._halvings[0], {
            "loss_scale": s, "typical": typical, "halvings": len(self._halvings), "within_steps": self.scale_window},
            f"step {rec.step}: fp16 loss scale fell to {s:g}, {typical / s:g}x below its typical {typical:g} "
            f"since start-up, {len(self._halvings)} halvings within {self.scale_window} steps: an overflow storm "
            f"may be coming")

    def _number(self, step: int, name: str, x: float, what: str, out: list[dict[str, Any]]) -> None:
        if not (x > 0 and math.isfinite(x)):
            return   # non-finite values are the NaN detector's
        ema = self._ema.get(name)
        if ema is None:
            if len(self._ema) >= 512:   # bounded: a job naming thousands of groups is not watched further
                return
            ema = self._ema[name] = LogEma(self.alpha, self.of)
        ema.judge(step, x, self.z, self.min_count)
        hot = [(s, z) for s, z in ema.flags if z > self.z]
        if len(hot) < self.hits:
            return
        typical = math.exp(ema.mean)
        w = self._warn(step, name, hot[0][0], {"value": x, "typical": typical, "z": round(max(z for _, z in hot), 2)},
                       f"step {step}: {what} {x:.4g} is {x / typical:.1f}x its running level {typical:.4g}; "
                       f"{len(hot)} of the last {len(ema.flags)} steps out of the run's own distribution "
                       f"(z > {self.z:g}): a blow-up may be coming")
        if w is not None:
            out.append(w)

    def _warn(self, step: int, signal: str, since: int, evidence: dict[str, Any], message: str) -> dict[str, Any] | None:
        last = self._last.get(signal)
        if last is not None and step - last < self.cooldown:
            return None
        self._last[signal] = step
        return {"step": step, "since_step": since, "signal": signal, **evidence, "message": message}
