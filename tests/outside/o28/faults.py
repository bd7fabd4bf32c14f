"""Fault switches shared by the three scripts (environment variables; nothing from ulyssesd is imported).

O28_CRASH_AT=N  raise RuntimeError at step N
O28_NAN_AT=N    poison the weights with NaN at step N (the loss is NaN from then on, saves keep going)
O28_HANG_AT=N   stop printing and sleep forever at step N
O28_KILL_AT=N   SIGKILL itself at step N (an operator kill -9 from inside, for determinism)
They fire only on attempt O28_FAULT_ATTEMPT (default 1) of a supervised run ($ULYSSESD_ATTEMPT; "1" outside).
"""

from __future__ import annotations

import os
import signal
import time


def _at(name: str) -> int:
    if os.environ.get("ULYSSESD_ATTEMPT", "1") != os.environ.get("O28_FAULT_ATTEMPT", "1"):
        return 0
    return int(os.environ.get(name, "0") or 0)


CRASH_AT = _at("O28_CRASH_AT")
NAN_AT = _at("O28_NAN_AT")
HANG_AT = _at("O28_HANG_AT")
KILL_AT = _at("O28_KILL_AT")


def maybe_fault(step: int, poison=None) -> None:
    """Call once per finished step. `poison` is a callable that NaN-ifies the weights."""
    if step == CRASH_AT:
        raise RuntimeError(f"o28 injected crash at step {step}")
    if step == NAN_AT and poison is not None:
        poison()
    if step == HANG_AT:
        while True:
            time.sleep(60)
    if step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
