"""Early warning: the grad norm leaving its own distribution and staying there, before the loss shows it.

ZClip-style (arXiv 2504.02507): an EMA of the mean and variance of log(grad norm) gives each step a z-score
against the run's own recent grad norms; a step is out when z exceeds `z`. One out-of-distribution step is
noise (a hard batch); `hits` out of the last `of` steps is a trend the optimizer is taking: a warning, with its
evidence, as an alert first (the daemon says it and alerts; no ladder rung). Out-of-distribution values do
not update the EMA (a blow-up must not become its own baseline).

Per source: at micro-batch 1 the grad norm is multi-modal like the loss (a copy batch's grad norm is several
times a motif batch's), so the statistics are kept per set of sources in the step (`loss_by_source` keys).
Pure: the engine feeds step records; `observe` returns a warning dict or None.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from ulyssesd.remediation.records import StepRecord


@dataclass
class _Stats:
    mean: float = 0.0
    var: float = 0.0
    n: int = 0


class GradNormWatch:
    def __init__(self, alpha: float = 0.03, z: float = 4.0, hits: int = 3, of: int = 5, min_count: int = 30,
                 cooldown: int = 200):
        self.alpha, self.z, self.hits, self.min_count, self.cooldown = alpha, z, hits, min_count, cooldown
        self._stats: dict[tuple[str, ...], _Stats] = {}
        self._flags: deque[tuple[int, float]] = deque(maxlen=of)   # (step, z) of the last `of` judged steps
        self._last_warning: int | None = None
        self.warnings: list[dict[str, Any]] = []

    def reset(self) -> None:
        """A restart: the history stays (the run's distribution), the recent flags do not."""
        self._flags.clear()

    def observe(self, rec: StepRecord) -> dict[str, Any] | None:
        g = rec.grad_norm
        if g is None or not (g > 0 and math.isfinite(g)) or rec.skipped:
            return None   # non-finite grad norms are the NaN detector's; a skipped fp16 step has none
        key = tuple(sorted(rec.loss_by_source)) if rec.loss_by_source else ()
        st = self._stats.setdefault(key, _Stats())
        x = math.log(g)
        z = 0.0
        if st.n >= self.min_count:
            z = (x - st.mean) / max(math.sqrt(st.var), 0.05)   # floor: a flat grad norm is not infinitely sure
            self._flags.append((rec.step, z))
        out = st.n >= self.min_count and z > self.z
        if not out:
            if st.n == 0:
                st.mean = x
            d = x - st.mean
            st.mean += self.alpha * d
            st.var = (1 - self.alpha) * (st.var + self.alpha * d * d)
            st.n += 1
        hot = [(s, zz) for s, zz in self._flags if zz > self.z]
        if len(hot) < self.hits:
            return None
        if self._last_warning is not None and rec.step - self._last_warning < self.cooldown:
            return None
        self._last_warning = rec.step
        w = {"step": rec.step, "since_step": hot[0][0], "z": round(max(zz for _, zz in hot), 2),
             "grad_norm": g, "typical_grad_norm": math.exp(st.mean), "log_sd": math.sqrt(st.var),
             "source": list(key) or None,
             "message": (f"step {rec.step}: grad norm {g:.4g} is {math.exp(x - st.mean):.1f}x its running level "
                         f"{math.exp(st.mean):.4g}{' for ' + ', '.join(key) if key else ''}; "
                         f"{len(hot)} of the last {len(self._flags)} steps out of the run's grad-norm distribution "
                         f"(z > {self.z:g}): a blow-up may be coming")}
        self.warnings.append(w)
        self.warnings = self.warnings[-32:]
        return w
