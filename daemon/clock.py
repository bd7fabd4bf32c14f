"""The daemon's one clock seam: every wall-clock read, monotonic read and sleep in daemon/ goes through here.

`Clock` is the interface (the OS seam `host/process.OSInterface` is one: it has the same three methods, so a
supervisor's `os` is its clock and a fake OS is a fake clock). `SystemClock` is the real one and `SYSTEM` its
instance; a module outside the supervisor's loop (the control socket, `ulyssesctl`, the store's row stamps)
takes a `clock: Clock = SYSTEM` parameter or reads `SYSTEM`, so a simulation can hand it another clock.
`tests/test_architecture.py` fails on a direct `time.time()`, `time.monotonic()`, `time.sleep()` or
`datetime.now()` anywhere else in daemon/.
"""

from __future__ import annotations

import time as _time
from datetime import datetime, timezone
from typing import Protocol


class Clock(Protocol):
    """What reading time and waiting need: the wall clock, a monotonic clock for intervals, a sleep."""

    def time(self) -> float: ...  # seconds since the epoch (stamps, deadlines a person reads)
    def monotonic(self) -> float: ...  # seconds on a clock that never steps (intervals, timeouts)
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The host's clocks: the C functions themselves (a per-line budget check in a log parser calls them often)."""

    time = staticmethod(_time.time)
    monotonic = staticmethod(_time.monotonic)
    sleep = staticmethod(_time.sleep)


SYSTEM: Clock = SystemClock()


def utc_now(clock: Clock = SYSTEM) -> datetime:
    """The clock's wall time as an aware UTC datetime (store rows, `ulyssesctl` ages)."""
    return datetime.fromtimestamp(clock.time(), tz=timezone.utc)


class SteadyWall:
    """Wall-clock seconds that never step: the wall time when it was made plus the monotonic time since. The
    daemon's intervals (a hang's silence, the restart budget's hour, a backoff) are measured on it, so an NTP or
    operator step of the wall clock is neither a hang nor a spent budget (simulator seed 118); its values stay in
    the wall clock's epoch, so they compare with the job's record stamps and the store's rows (off by at most the
    steps since the daemon started)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = self.clock = clock
        self._offset = clock.time() - clock.monotonic()

    def now(self) -> float:
        return self._clock.monotonic() + self._offset

    def time(self) -> float:
        """The same reading as now() (the name Clock-like callers use)."""
        return self.now()
