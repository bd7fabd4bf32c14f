"""NaN/Inf loss, a non-finite grad norm on a step that was not skipped, the fp16 loss scale at its floor, or a
loss of exactly 0 straight after a normal one (a cross-entropy is never exactly 0: all labels masked, or NaN
gradients zeroed; public threads: LlamaFactory#8137, ms-swift#1062, axolotl#2754)."""

from __future__ import annotations

import math

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import EpisodeDetector, Finding
from ulyssesd.remediation.records import Record, StepRecord


class NanLossDetector(EpisodeDetector):
    symptom = "nan_loss"
    episode_clear_steps = 1  # any finite step ends a NaN episode

    def __init__(self, cfg: DetectorsConfig, min_loss_scale: float | None = None):
        self.min_loss_scale = min_loss_scale
        super().__init__(cfg)

    def reset(self) -> None:
        super().reset()
        self._last_nonzero: float | None = None   # the last finite, non-zero loss

    def observe(self, rec: Record, now: float) -> list[Finding]:
        if not isinstance(rec, StepRecord):
            return []
        loss, gn = rec.loss, rec.grad_norm
        what = None
        if not math.isfinite(loss):
            what = f"loss is {loss}"
        elif loss == 0.0 and (self._ep.active or (self._last_nonzero is not None
                                                 and self._last_nonzero >= self.cfg.loss_zero_min_prev)):
            # _last_nonzero is None when only non-finite losses came before (the episode is active).
            prev = "a non-finite loss" if self._last_nonzero is None else f"{self._last_nonzero:.4g}"
            what = (f"loss is exactly 0 right after {prev} (a broken loss: masked labels or "
                    f"zeroed NaN gradients, not convergence)")
        elif gn is not None and not math.isfinite(gn) and not rec.skipped:
            # fp16 overflow steps report inf grad norm but are skipped: that is not a NaN.
            what = f"grad_norm is {gn} on a step that was not skipped"
        elif (rec.skipped and rec.loss_scale is not None and self.min_loss_scale is not None
              and rec.loss_scale <= self.min_loss_scale):
            what = f"fp16 loss scale reached its minimum {rec.loss_scale:g} and the step still overflowed"
        if loss != 0.0 and loss == loss and abs(loss) != math.inf:
            self._last_nonzero = loss
        if what is None:
            if self._ep.active:
                self._ep.normal(rec.step)
            return []
        if not self._ep.anomalous(rec.step):
            return []
        ev = {"loss": str(loss) if not math.isfinite(loss) else loss, "grad_norm": gn if gn is None or math.isfinite(gn) else str(gn),
              "loss_scale": rec.loss_scale, "skipped": rec.skipped, "since_step": self._ep.started_step}
        return [Finding(self.symptom, rec.step, "critical", ev, f"step {rec.step}: {what}.", now)]
