"""A hung job is stopped on the hang timescale, whatever asked for the stop.

A stop that is not the hang detector's (a remediation's restart, an operator stop, a pause) gives the job
`stop_grace_s` (120 s by default) between SIGTERM and SIGKILL so that it can save. A hung job cannot save:
it ignores SIGTERM and the whole grace is lost (93 % of one run's wall time was "lost to restarts"). While a
termination waits out its grace, the hang detector's own reading decides: once the job's silence is over its
timeout (the same test as a hang incident), the remaining grace becomes `hang_grace_s`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.ports import HostSide, RunFiles

if TYPE_CHECKING:
    from ulyssesd.daemon.core.termination import Termination

log = get_logger("ulyssesd.supervisor")


class HungRun(RunFiles, HostSide, Protocol):
    """What shortening a hung job's grace uses of the run."""

    engine: Any  # the remediation engine (its hang detector's stall)


def shorten_grace_if_hung(sup: HungRun, t: Termination, now_mono: float) -> bool:
    """Cut the termination's grace to hang_grace_s from now when the job is hung; True when it did."""
    hang_grace = sup.dcfg.hang_grace_s
    if t.termed_at is None or t.killed_at is not None or t.hung_cut:
        return False
    if t.grace_s - (now_mono - t.termed_at) <= hang_grace:
        return False  # already on the hang timescale (a hang's own stop, or close to its end)
    hang = getattr(sup.engine, "hang", None)
    stalled = hang.stalled_s(sup.os.time()) if hang is not None else None
    if stalled is None:
        return False
    t.grace_s = (now_mono - t.termed_at) + hang_grace
    t.hung_cut = True
    log.warning("the job is hung while being stopped; SIGKILL on the hang timescale", reason=t.reason,
                silent_s=round(stalled, 1), hang_grace_s=hang_grace)
    sup.say(f"  the job made no progress for {stalled:.0f} s (hung): SIGKILL in {hang_grace:g} s, "
            f"not after the full stop grace")
    return True
