"""The loss band of one data source, learned from the run itself: its level, its spread and its trend.

A job that says where each step's samples came from (`loss_by_source` in telemetry: the synthetic families,
a blend's datasets, a client's `source=`) gives one band per source. Each band judges the median of its
source's last few losses (one outlier sample moves nothing) against the source's own level (the median of
its healthy history), with a threshold fitted to the run's own residuals: the residual (smoothed value -
level) of every healthy observation is kept, and a value is anomalous only when its residual exceeds the
residuals' own centre (never below 0: a loss that stops falling is a plateau, not a spike) by `k` robust
sigmas, and the level by a relative floor. A high loss on a hard source is that source's level, not a spike;
a source whose loss keeps falling keeps a negative residual.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

_MAD_TO_SIGMA = 1.4826


def _median(vals: list[float]) -> float:
    s = sorted(vals)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass(slots=True)
class BandVerdict:
    """One source's judgment of its latest observation."""

    source: str
    value: float        # the smoothed value judged (median of the source's last `smooth` losses)
    level: float        # the source's level (median of its healthy history)
    threshold: float    # the value above which it is anomalous
    scale: float        # robust sigma of the healthy relative residuals, log(value / level)
    anomalous: bool
    severe: bool
    ready: bool         # enough history to judge


class SourceBand:
    """One source's band. `observe(loss)` returns its verdict; healthy observations feed the history."""

    __slots__ = ("name", "k", "min_rel", "severe_rel", "min_history", "_hist", "_recent", "_resid", "_level",
                 "_scale", "_centre", "_age", "_every", "count", "last_step", "last_verdict", "first_value")

    def __init__(self, name: str, *, window: int, level_records: int, smooth: int, k: float, min_rel: float,
                 severe_rel: float, min_history: int):
        self.name = name
        self.k, self.min_rel, self.severe_rel, self.min_history = k, min_rel, severe_rel, min_history
        # The level: the median of the source's last `level_records` healthy raw values, one smoothing window
        # late (short, so a falling loss does not leave it behind; the residuals measure the rest).
        self._hist: deque[float] = deque(maxlen=level_records)
        self._recent: deque[float] = deque(maxlen=smooth)        # the last `smooth` raw values
        self._resid: deque[float] = deque(maxlen=max(2 * window, 50))   # healthy relative residuals
        self._level = math.nan
        self._scale = math.nan
        self._centre = 0.0
        # The medians are O(window) in Python: refreshed every `_every` observations (and on a crossing).
        self._every = max(1, level_records // 5)
        self._age = self._every
        self.count = 0                    # observations since reset
        self.last_step: int | None = None
        self.last_verdict: BandVerdict | None = None
        self.first_value: float | None = None   # the source's first smoothed value (its progress in status)

    def _refresh(self) -> None:
        hist = list(self._hist)
        self._level = _median(hist)
        res = list(self._resid)
        if len(res) >= 5:
            centre = _median(res)
            mad = _median([abs(r - centre) for r in res])
            self._centre = max(0.0, centre)
            self._scale = max(_MAD_TO_SIGMA * mad, 1e-3)
        self._age = 0

    def threshold(self) -> float:
        """Residuals are relative (log(value / level)): a loss's noise scales with its level (arithmetic at
        0.004 and copy at 4 have the same relative spread, not the same absolute one)."""
        lvl = self._level
        # Bounded exponent: absurd telemetry (1e300 losses) widens the scale past exp's range; the band is then
        # effectively open (inf), never an exception that skips the record.
        return max(lvl * math.exp(min(self._centre + self.k * self._scale, 700.0)), lvl + self.min_rel * abs(lvl))

    def severe_line(self) -> float:
        """Severe: `severe_rel` above the level and beyond the run's own noise (the learned log-space scale,
        as the threshold): a source whose values routinely differ 20x is not severe at 1.5x its level."""
        lvl = self._level
        noise = lvl * math.exp(min(self._centre + self.k * self._scale, 700.0)) if self._scale == self._scale else lvl
        return max(lvl + self.severe_rel * abs(lvl), noise)

    def observe(self, loss: float, step: int) -> BandVerdict:
        self.count += 1
        self.last_step = step
        recent = self._recent
        leaving = recent[0] if len(recent) == recent.maxlen else None
        recent.append(loss)
        value = _median(list(recent))
        if self.first_value is None and len(recent) == recent.maxlen:
            self.first_value = value
        ready = self.count > self.min_history and len(self._resid) >= self.min_history // 2
        self._age += 1
        if len(self._hist) >= 3 and (self._age >= self._every or math.isnan(self._level)):
            self._refresh()
        anomalous = severe = False
        thr = math.inf
        if ready:
            thr = self.threshold()
            if value > thr:
                self._refresh()   # confirm against fresh statistics
                thr = self.threshold()
            anomalous = value > thr
            severe = anomalous and value >= self.severe_line()
        if not anomalous:
            if self._level > 0 and 0 < value / self._level < math.inf and len(recent) == recent.maxlen:
                self._resid.append(math.log(value / self._level))
            # A raw value joins the level's history once it leaves the smoothing window, so a lasting rise
            # does not lift its own level before it is judged.
            if leaving is not None:
                self._hist.append(leaving)
            elif len(self._hist) < 3:
                self._hist.append(loss)   # the first few: something to start the level from
        v = BandVerdict(self.name, value, self._level, thr, self._scale, anomalous, severe, ready)
        self.last_verdict = v
        return v

    def restart(self) -> None:
        """A new attempt: the values in flight (maybe of the fault that caused it) are dropped; the level,
        the residuals and the history stay (they are the run's healthy distribution)."""
        self._recent.clear()
        self.last_verdict = None

    def summary(self) -> dict[str, float | int | str | None]:
        """For status and evidence: the level, its spread and where the source started."""
        return {"source": self.name, "level": None if math.isnan(self._level) else self._level,
                "sigma_rel": None if math.isnan(self._scale) else self._scale,
                "threshold": None if not self.last_verdict or math.isinf(self.last_verdict.threshold)
                else self.last_verdict.threshold,
                "first": self.first_value, "observations": self.count}


def split_modes(values: list[float], min_share: float = 0.15, min_gap: float = 0.3,
                sigmas: float = 4.0) -> list[float] | None:
    """Centres (log scale, ascending) of the modes of a multi-modal loss, or None when it is one mode.

    1-D k-means optimum (k = 3, then 2) over the sorted log losses (prefix sums: O(n^2) for k = 3); the split
    is accepted when every mode holds `min_share` of the values and neighbouring modes' medians are apart by
    at least `min_gap` (log: 35 %) and `sigmas` x the larger mode's robust spread. A falling or noisy
    unimodal loss never passes (its "modes" touch)."""
    xs = sorted(math.log(v) for v in values if v > 0 and math.isfinite(v))
    n = len(xs)
    if n < 30 or xs[-1] - xs[0] < min_gap:
        # Every mode's median lies within [xs[0], xs[-1]]: no two can be `min_gap` apart, whatever the split
        # (the same None the search below reaches, without its O(n^2): a steady loss's usual window).
        return None
    ps, pq = [0.0], [0.0]
    for x in xs:
        ps.append(ps[-1] + x)
        pq.append(pq[-1] + x * x)

    def sse(i: int, j: int) -> float:   # values xs[i:j]
        m = j - i
        s = ps[j] - ps[i]
        return pq[j] - pq[i] - s * s / m

    lo = max(1, int(min_share * n))
    best3: tuple[float, int, int] | None = None
    # The same sums as `sse` in the same order, inlined: this runs every quarter window on every record's
    # engine (a backlog of millions), and a call per (i, j) was most of the engine's time. First minimum wins.
    tail = [sse(j, n) for j in range(n)]
    for i in range(lo, n - 2 * lo + 1):
        left, psi, pqi = sse(0, i), ps[i], pq[i]
        row = [left + (pq[j] - pqi - (s := ps[j] - psi) * s / (j - i)) + tail[j] for j in range(i + lo, n - lo + 1)]
        c = min(row)
        if best3 is None or c < best3[0]:
            best3 = (c, i, i + lo + row.index(c))
    best2 = min(((sse(0, i) + sse(i, n), i) for i in range(lo, n - lo + 1)), default=None)
    candidates = []
    if best3 is not None:
        candidates.append([(0, best3[1]), (best3[1], best3[2]), (best3[2], n)])
    if best2 is not None:
        candidates.append([(0, best2[1]), (best2[1], n)])
    for parts in candidates:
        groups = [xs[a:b] for a, b in parts]
        meds = [_median(g) for g in groups]
        spread = [_MAD_TO_SIGMA * _median([abs(x - m) for x in g]) for g, m in zip(groups, meds, strict=True)]
        if all(meds[k + 1] - meds[k] >= max(min_gap, sigmas * max(spread[k], spread[k + 1]))
               for k in range(len(groups) - 1)):
            return meds
    return None


class HeldRise:
    """A loss that jumps to `factor` x the run's own earlier level (the median of its earlier records) and to
    `above_max` x every earlier value (a mixture's noisy high mode, once seen, is not a rise), and stays there for `records` records in a row. Never healthy, whatever the warm-up:
    the warm-up waits to learn a band, and a log that is short (an epoch per row) or starts mid-run never leaves
    it. Values above the line stay out of the earlier level until the rise breaks; then they join it (a swing the run
    made and recovered from raises the earlier max, so a mixture's high mode is learned, not re-flagged)."""

    __slots__ = ("factor", "above_max", "records", "_before", "_held")

    def __init__(self, keep: int, factor: float = 3.0, records: int = 3, above_max: float = 1.5):
        self.factor, self.records, self.above_max = factor, records, above_max
        self._before: deque[float] = deque(maxlen=keep)
        self._held: list[tuple[int, float]] = []

    def reset(self) -> None:
        self._before.clear()
        self._held.clear()

    def observe(self, step: int, loss: float) -> tuple[int, float, int] | None:
        """None for a value that is not above the line (it joins the earlier level); else (the step where the
        rise began, the earlier level, how many records it has held so far)."""
        if not 0 < loss < math.inf:
            return None
        if self._before and loss >= self.factor * _median(list(self._before)) and loss > self.above_max * max(self._before):
            self._held.append((step, loss))
            return self._held[0][0], _median(list(self._before)), len(self._held)
        # A rise that did not hold was the run's own swing: it joins the earlier values (their max) with this one.
        self._before.extend(v for _, v in self._held)
        self._held.clear()
        self._before.append(loss)
        return None
