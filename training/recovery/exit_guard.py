"""Whether the job may write its exit (SIGTERM) checkpoint: never after a step the daemon would judge non-finite.

A SIGTERM right after a NaN is the daemon stopping the job to roll it back; an exit save then holds the weights
after the NaN's update, and once written it is the newest tag on disk (found on the H100: `step-00000121`
written one step after a NaN at 120, then resumed). The job knows what it saw and needs nobody's word for it:
the first step since the attempt started whose loss is non-finite, or whose grad norm is non-finite on a step
that was applied (fp16 overflow steps are skipped and report an infinite norm: not weights gone bad). Once seen,
the attempt writes no exit save (its periodic saves go on; the daemon judges those). Stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def nonfinite_what(loss: float, grad_norm: float | None, skipped: bool) -> str | None:
    """What makes this step non-finite in the daemon's terms (remediation/detectors/nan_loss.py), or None."""
    if not math.isfinite(loss):
        return f"loss {loss}"
    if grad_norm is not None and not math.isfinite(grad_norm) and not skipped:
        return f"grad norm {grad_norm} on an applied step"
    return None


@dataclass
class ExitSaveGuard:
    """The attempt's first non-finite step (None: none seen): the exit save is refused from then on."""

    first_bad_step: int | None = None
    what: str = ""

    def observe(self, step: int, loss: float, grad_norm: float | None, skipped: bool = False) -> None:
        if self.first_bad_step is not None:
            return
        what = nonfinite_what(loss, grad_norm, skipped)
        if what is not None:
            self.first_bad_step, self.what = step, what

    def refusal(self) -> str | None:
        """Why the exit save must not be written (None: it may)."""
        if self.first_bad_step is None:
            return None
        return (f"{self.what} at step {self.first_bad_step} since the last clean save: an exit save would hold "
                f"the weights after it")
