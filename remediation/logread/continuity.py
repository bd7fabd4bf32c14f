"""Step numbers checked against the run's own progress (pure: no I/O, no clock).

A step parsed from a log line is *plausible* when it moves forward from the last accepted step by no more
than the run's own stride allows (`max_stride_factor` x the median of recent increments, and at most
`max_growth` x the step reached), and stays within `max_growth` x the declared total when one is known.
An implausible step is held, not trusted and not fatal:

- a single odd line (`iteration 10000000000000000000000000/ 900`, a stray number) is followed by plausible
  steps again: it is dropped and counted as a bad line (`bad_lines`, with samples);
- a new, consistent sequence (`confirm` implausible steps in a row, each advancing from the previous one
  plausibly) is a discontinuity: a counter that went backwards (a new epoch, an in-job rollback) or that
  jumped (a resumed count, lines lost in between) is accepted as an event, and the held records are released
  in order; nothing after it is dropped.

A step equal to the last one is a repeat (several ranks printing the same step, a redraw) and is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class ContinuityConfig:
    """How far a step may move before it needs confirmation."""

    max_stride_factor: float = 100.0  # a forward move > this x the recent median increment is implausible ...
    max_growth: float = 10.0  # ... when it also lands beyond this x the step reached (or x the declared total)
    confirm: int = 3  # implausible steps in a consistent sequence that make a discontinuity real
    window: int = 32  # recent increments kept for the median


@dataclass
class Verdict:
    """What to do with one step: `emit` the records now released (the held ones first), `event` a
    discontinuity to record (from, to, kind), `dropped` how many held records were discarded as bad."""

    emit: list[Any] = field(default_factory=list)
    event: tuple[int, int, str] | None = None
    repeated: bool = False
    held: bool = False
    dropped: list[Any] = field(default_factory=list)


class StepContinuity:
    """Feed (step, payload) in log order; `offer` says which payloads become records."""

    def __init__(self, last_step: int | None = None, total: int | None = None,
                 cfg: ContinuityConfig | None = None):
        self.cfg = cfg or ContinuityConfig()
        self.last_step = last_step
        self.total = total  # the declared total (N/M, [job] total_steps) when known
        self._strides: deque[int] = deque(maxlen=self.cfg.window)
        self._held: list[tuple[int, Any]] = []

    def stride(self) -> int:
        if not self._strides:
            return 1
        s = sorted(self._strides)
        return max(1, s[len(s) // 2])

    def plausible_from(self, prev: int | None, step: int) -> bool:
        if step > INT64_MAX or step < 0:
            return False
        if self.total and step > self.cfg.max_growth * self.total + self.cfg.max_stride_factor:
            return False
        if prev is None:
            return True
        if step <= prev:
            return False
        gap = step - prev
        return not (gap > self.cfg.max_stride_factor * self.stride()
                    and step > self.cfg.max_growth * (prev + self.stride()))

    def offer(self, step: int, payload: Any) -> Verdict:
        v = Verdict()
        if self.last_step is not None and step == self.last_step:
            v.repeated = True
            return v
        if self.plausible_from(self.last_step, step):
            v.dropped = [p for _, p in self._held]  # the odd lines in between were bad lines
            self._held.clear()
            self._accept(step)
            v.emit.append(payload)
            return v
        if step > INT64_MAX or step < 0 or (self.total and not self.plausible_from(None, step)):
            v.dropped = [payload]  # never a step: beyond what the record can hold or the declared total
            return v
        # Implausible: does it continue the held sequence?
        if self._held and not self.plausible_from(self._held[-1][0], step):
            if step == self._held[-1][0]:
                v.repeated = True
                return v
            v.dropped = [p for _, p in self._held]  # the held ones were not a sequence: start anew from this one
            self._held.clear()
        self._held.append((step, payload))
        v.held = True
        if len(self._held) >= self.cfg.confirm:
            first = self._held[0][0]
            kind = "reset" if self.last_step is not None and first < self.last_step else "jump"
            v.event = (self.last_step if self.last_step is not None else -1, first, kind)
            self._strides.clear()
            prev = None
            for s, p in self._held:
                if prev is not None:
                    self._strides.append(s - prev)
                prev = s
                v.emit.append(p)
            self.last_step = self._held[-1][0]
            self._held.clear()
            v.held = False
        return v

    def _accept(self, step: int) -> None:
        if self.last_step is not None and step > self.last_step:
            self._strides.append(step - self.last_step)
        self.last_step = step
