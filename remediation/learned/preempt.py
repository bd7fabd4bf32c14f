"""The optional pre-emptive action on a grad-norm early warning (`[remediation] early_warning_clip`, off by
default): gradient clipping lowered, hot, to the run's own grad-norm threshold - ZClip's rule (arXiv
2504.02507: an EMA of the grad norm's mean and spread sets the clip; here of its log, mean + 2.5 sigma, so the
typical steps pass unclipped and the outliers the warning saw are cut to the typical range).

Bounded: never below `clip_floor`, never raised (a clip already at or under the threshold is left), at most
`early_warning_clip_max` per run, one at a time. Verified like a ladder rung: a loss/NaN/overflow finding within
`verify_steps` of it makes it `ineffective` (the loss ladder then goes on from the lowered clip); that many
steps without one make it `effective`. Pure: the engine proposes and verifies, the daemon applies and records.
"""

from __future__ import annotations

import math
from typing import Any

from ulyssesd.remediation.config import RemediationConfig

ZCLIP_Z = 2.5   # ZClip's default z threshold


class PreemptiveClip:
    def __init__(self, policy: RemediationConfig):
        self.policy = policy
        self.used = 0
        self.pending: dict[str, Any] | None = None   # the applied clip awaiting its verification
        self.outcomes: list[dict[str, Any]] = []     # verified, for the daemon to record (drained by it)

    def propose(self, warning: dict[str, Any], current: float | None) -> dict[str, Any] | None:
        """The clip change for a grad-norm `warning` ({"typical_grad_norm", "log_sd", "step", ...}), or None
        with nothing to do (budget spent, one pending, the clip already as tight, no statistics)."""
        p = self.policy
        if not p.early_warning_clip or self.pending is not None:
            return None
        typical, sd = warning.get("typical_grad_norm"), warning.get("log_sd")
        if not isinstance(typical, float) or not isinstance(sd, float) or not typical > 0:
            return None
        if self.used >= p.early_warning_clip_max:
            return {"skipped": f"early_warning_clip_max={p.early_warning_clip_max} pre-emptive clips already used"}
        target = round(max(p.clip_floor, typical * math.exp(ZCLIP_Z * sd)), 4)
        if current is not None and current > 0 and target >= current:
            return {"skipped": f"the clip {current:g} is already at or below the run's threshold {target:g}"}
        self.used += 1
        self.pending = {"step": warning["step"], "from": current, "to": target}
        return {"patch": {"train.gradient_clipping": target}, "from": current, "to": target,
                "rule": f"ZClip: the run's grad norm {typical:.4g} x exp({ZCLIP_Z} x {sd:.3f}) (EMA of its log), "
                        f"floor clip_floor={p.clip_floor:g}", "uses": f"{self.used} of {p.early_warning_clip_max}"}

    def observe(self, step: int, weight_anomaly: bool) -> None:
        """One step after the change: a loss/NaN/overflow finding is `ineffective`; `verify_steps` clean steps
        are `effective`."""
        pend = self.pending
        if pend is None:
            return
        if weight_anomaly:
            self.outcomes.append({**pend, "outcome": "ineffective", "at_step": step,
                                  "why": "a loss/NaN/overflow finding within its verification window"})
        elif step - pend["step"] >= self.policy.verify_steps:
            self.outcomes.append({**pend, "outcome": "effective", "at_step": step,
                                  "why": f"{self.policy.verify_steps} steps without a loss/NaN/overflow finding"})
        else:
            return
        self.pending = None
