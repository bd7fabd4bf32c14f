"""Offline replay: run the engine over a recorded telemetry stream and list what it would have found and
decided, step by step. The clock is each record's `time` when present, else step × median step time.

A record without `time` cannot show a hang: the gap before it is invented by that synthetic clock (a log
printed every 50 iterations is not 50 s of silence). The clock-driven hang check runs only before timed
records; the summary says loudly how many were not timed (CountingRecords)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.records import Record, StepRecord


@dataclass(slots=True)
class ReplayItem:
    step: int | None
    time: float
    item: Finding | Decision

    @property
    def kind(self) -> str:
        return "finding" if isinstance(self.item, Finding) else "decision"


def replay(records: Iterable[Record], detectors_cfg: DetectorsConfig | None = None,
           policy_cfg: RemediationConfig | None = None, job_values: Mapping[str, Any] | None = None,
           *, engine: RemediationEngine | None = None) -> Iterator[ReplayItem]:
    """Yield every finding and decision the engine produces over `records`, in stream order."""
    eng = engine or RemediationEngine(detectors_cfg, policy_cfg, job_values)
    # Synthetic clock for records without `time`: step × running median step time (1 s until known).
    times: list[float] = []
    med = 1.0
    synth_next = 0.0
    last_now = 0.0
    attempt: int | None = None
    tick, observe = eng.tick, eng.observe
    for rec in records:
        t = rec.time
        timed = t is not None and t == t
        if t is not None and timed:
            now = t
        else:
            if isinstance(rec, StepRecord) and rec.step_time_s and rec.step_time_s == rec.step_time_s:
                times.append(rec.step_time_s)
                if len(times) in (1, 2, 5, 10, 50, 100, 1000):  # the median settles fast: refresh rarely
                    med = sorted(times)[len(times) // 2]
                if len(times) > 1000:
                    times = times[-1000:]
            now = rec.step * med if rec.step is not None else last_now
            now = max(now, synth_next)
        synth_next = now
        last_now = now
        # The gap before a new attempt's first record is the crash and the relaunch, not a hang.
        new_attempt = rec.attempt is not None and attempt is not None and rec.attempt != attempt
        if rec.attempt is not None:
            attempt = rec.attempt
        if timed and not new_attempt:
            out = tick(now)
            if out:  # rare: most ticks and records produce nothing
                for item in out:
                    yield ReplayItem(item.step, now, item)
        out = observe(rec, now)
        if out:
            for item in out:
                yield ReplayItem(item.step, now, item)


def untimed_note(untimed: int, steps: int, no_step_time: int) -> str:
    """What was not judged on records without timestamps (unknown is loud)."""
    what = ("hang/step-time not judged for them" if no_step_time == untimed
            else "hang not judged for them (step time judged from their step_time_s)")
    return (f"NO TIMESTAMPS on {untimed} of {steps} step record(s): {what}; add a `time` field to each record "
            f"(docs/CONTRACTS.md)")


class CountingRecords:
    """Wraps a record stream and counts what went through (what `ulyssesctl replay` says it parsed)."""

    def __init__(self, records: Iterable[Record]):
        self._records = records
        self.steps = 0
        self.events = 0
        self.untimed = 0          # step records without `time`: no hang judgment for them
        self.untimed_no_step_time = 0   # ...and without `step_time_s`: no step-time judgment either

    def __iter__(self) -> Iterator[Record]:
        for rec in self._records:
            if isinstance(rec, StepRecord):
                self.steps += 1
                if rec.time is None or rec.time != rec.time:
                    self.untimed += 1
                    if not rec.step_time_s:
                        self.untimed_no_step_time += 1
            else:
                self.events += 1
            yield rec

    def untimed_note(self) -> str:
        """The loud line for step records without `time` ('' when every record had one)."""
        return untimed_note(self.untimed, self.steps, self.untimed_no_step_time) if self.untimed else ""

    def summary(self, source: str, log_stats: Any = None) -> str:
        """One line: how many records were parsed; loud when no step record was (detectors saw nothing)."""
        text = f"parsed {self.steps} step record(s) and {self.events} event(s) from {source}"
        if log_stats is not None:
            extra = []
            if log_stats.bad_lines:
                extra.append(f"{log_stats.bad_lines} step line(s) out of the run's progress dropped "
                             f"({'; '.join(log_stats.bad_samples[:2])})")
            if log_stats.discontinuities:
                extra.append(f"{log_stats.discontinuities} step counter reset(s)/jump(s)")
            if extra:
                text += ": " + ", ".join(extra)
        if self.untimed:
            text += "; " + self.untimed_note()
        if self.steps == 0:
            text = ("NO STEP RECORDS: " + text + ", so nothing was checked (no loss, NaN, spike, slow-step or "
                    "hang detection). ")
            if log_stats is not None:
                sample = log_stats.unparsed_sample
                text += ("Give the spec a [telemetry] pattern with (?P<step>...) and (?P<loss>...) groups "
                         "(docs/CLIENT.md, stdout telemetry) and pass it with --spec"
                         + (f"; a line that looked like progress: {sample!r}" if sample else ""))
        return text
