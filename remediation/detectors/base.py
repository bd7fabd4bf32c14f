"""Shared pieces of the detectors: the Finding, a rolling median, and anomaly episodes."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ulyssesd.remediation.records import EventRecord, Record

if TYPE_CHECKING:
    from ulyssesd.remediation.config import DetectorsConfig

# Exactly the `vocabulary.Symptom` names that detectors emit (the vocabulary also has crash-side ones).
SYMPTOMS = ("memory_spike", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm", "slow_step",
            "straggler", "throughput_drop", "hang")

# The `vocabulary.Severity` values a detector emits (no finding is `info`).
FindingSeverity = Literal["warning", "critical"]


@dataclass(slots=True)
class Finding:
    symptom: str
    step: int | None
    severity: FindingSeverity
    evidence: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    time: float | None = None


class Detector(Protocol):
    symptom: str

    @property
    def active(self) -> bool: ...  # read-only: detectors derive it from their episode

    def observe(self, record: Record, now: float) -> list[Finding]: ...

    def reset(self) -> None: ...


class EpisodeDetector:
    """Plumbing every episode-based detector shares: its config, the anomaly `Episode`, `active`, `reset`.

    Subclasses build their own windows before calling `super().__init__(cfg)` (which resets) and extend
    `reset()` with their own state."""

    symptom: str
    # Consecutive normal steps that end an episode; None = `cfg.clear_steps`.
    episode_clear_steps: int | None = None
    # Events after which the next step record is not judged (a checkpoint save or a hot change stalls the
    # step that follows); an entry ending in "_" is a prefix ("checkpoint_": every checkpoint event).
    skip_after_events: tuple[str, ...] = ()

    def __init__(self, cfg: DetectorsConfig):
        self.cfg = cfg
        clear = self.episode_clear_steps if self.episode_clear_steps is not None else cfg.clear_steps
        self._ep = Episode(cfg.refire_steps, clear)
        self._clock = StepSpan()
        self.reset()

    @property
    def active(self) -> bool:
        return self._ep.active

    def reset(self) -> None:
        self._ep.reset()
        self._clock.reset()
        self._run = 0   # consecutive anomalous training steps (not records) of the current run
        self._skip_next = False   # the next step record follows a `skip_after_events` event

    def _note_event(self, rec: EventRecord) -> None:
        """An event record: mark the next step record to be passed over when it is one of `skip_after_events`."""
        ev = rec.event
        if any(ev.startswith(e) if e.endswith("_") else ev == e for e in self.skip_after_events):
            self._skip_next = True

    def _skipped(self) -> bool:
        """True, once, for the step record right after a `skip_after_events` event."""
        if self._skip_next:
            self._skip_next = False
            return True
        return False

    def _normal_step(self, step: int) -> None:
        """A normal record: the run of anomalous steps starts over, and an open episode may end."""
        self._run = 0
        if self._ep.active:   # fast path: almost every record is normal with no episode open
            self._ep.normal(step)

    def _anomalous_steps(self, step: int, span: int, persist_steps: int) -> bool:
        """An anomalous record standing for `span` training steps: True when the run has lasted
        `persist_steps` steps and the episode emits a finding now (onset or refire)."""
        self._run += span
        return self._run >= persist_steps and self._ep.anomalous(step)


class RollingMedian:
    """Median of the last `size` values, as the attribute `med` (None until `min_count` values).

    Adding is O(1); the sorted snapshot is rebuilt every `refresh` additions (default size/4) once the window
    is full: a baseline over ~100 steps does not need to move on every step, and replay of millions of
    records must stay fast."""

    __slots__ = ("size", "refresh", "min_count", "_fifo", "_sorted", "_stale", "_trigger", "med")

    def __init__(self, size: int, refresh: int | None = None, min_count: int = 10):
        self.size = size
        self.refresh = refresh or max(1, size // 4)
        self.min_count = min(min_count, size)
        self._fifo: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []
        self._stale = 0
        # Additions that trigger the next rebuild: 1 while the window is filling, `refresh` once it is full.
        self._trigger = 1 if 1 < size else self.refresh
        self.med: float | None = None

    def add(self, x: float) -> None:
        self._fifo.append(x)
        self._stale += 1
        if self._stale >= self._trigger:
            self._sync()

    def __len__(self) -> int:
        return len(self._fifo)

    def _sync(self) -> None:
        s = self._sorted = sorted(self._fifo)
        n = len(s)
        mid = n // 2
        self.med = (s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])) if n >= self.min_count else None
        self._stale = 0
        # The next addition rebuilds if the window will still not be full after it (as `add` did before).
        self._trigger = 1 if n + 1 < self.size else self.refresh

    def median(self) -> float:
        return math.nan if self.med is None else self.med

    def in_order(self) -> list[float]:
        """The window's values, oldest first."""
        return list(self._fifo)

    def values(self) -> list[float]:
        """Sorted values (fresh)."""
        if self._stale:
            self._sync()
        return self._sorted

    def quantile(self, q: float) -> float:
        s = self.values()
        return s[min(len(s) - 1, int(q * len(s)))]

    def clear(self) -> None:
        self._fifo.clear()
        self._sorted = []
        self._stale = 0
        self._trigger = 1 if 1 < self.size else self.refresh
        self.med = None


class MedianWindowDetector(EpisodeDetector):
    """An episode detector judging each value against the rolling median (`_win`, `cfg.window` values) of the
    normal ones it has seen; subclasses add a value to `_win` only when it was normal."""

    def __init__(self, cfg: DetectorsConfig):
        self._win = RollingMedian(cfg.window)
        super().__init__(cfg)

    def reset(self) -> None:
        self._win.clear()
        super().reset()


class StepSpan:
    """How many training steps a record stands for: the gap to the previous record's step. Windows are in
    training steps, so one record logged every 10 steps counts as 10 (the same config means the same thing
    at log interval 1, 10 or 100). The first record after a reset counts 1, a repeated step 0, a step that
    goes back (a resume from an older checkpoint without a `started` event) 1."""

    __slots__ = ("first", "prev")

    def __init__(self) -> None:
        self.first: int | None = None
        self.prev: int | None = None

    def reset(self) -> None:
        self.first = self.prev = None

    def advance(self, step: int) -> int:
        prev = self.prev
        self.prev = step
        if prev is None:
            self.first = step
            return 1
        d = step - prev
        return d if d >= 0 else 1

    def since_start(self, step: int) -> int:
        """Training steps from the first record after the last reset to `step` (0 on that first record)."""
        return step - self.first if self.first is not None else 0


class Episode:
    """Turns a per-step anomalous/normal signal into findings: one at onset, one every `refire` training
    steps while it persists; it ends once `clear` training steps passed since its last anomalous step with
    only normal records. `active` tells the engine whether it persists. All in steps, not records."""

    __slots__ = ("refire", "clear", "active", "_fired_step", "_last_bad", "started_step", "length")

    def __init__(self, refire: int, clear: int):
        self.refire, self.clear = refire, clear
        self.reset()

    def reset(self) -> None:
        self.active = False
        self._fired_step = 0
        self._last_bad = 0
        self.started_step: int | None = None
        self.length = 0   # anomalous records in the episode

    def anomalous(self, step: int) -> bool:
        """Record an anomalous step; True when a finding should be emitted now."""
        self._last_bad = step
        if not self.active:
            self.active, self._fired_step, self.started_step, self.length = True, step, step, 1
            return True
        self.length += 1
        if step - self._fired_step >= self.refire:
            self._fired_step = step
            return True
        return False

    def normal(self, step: int) -> None:
        if self.active and (step - self._last_bad >= self.clear or step < self._last_bad):
            self.active = False
            self.length = 0


def fmt(x: float) -> str:
    return f"{x:.4g}"
