"""Restarts the daemon did not make: each in-job restart of one attempt, counted once from whichever evidence
comes first (pure: lines and records in, restarts out).

The evidence, strongest first:
- the inner launcher's own line: torchrun and ft_launcher say "[default] Worker group FAILED. 2/2 attempts
  left; will restart worker group" (ft_launcher's min-healthy policy: "2/2 restart attempts left; restarting
  worker group..."), which gives the restart's ordinal (max - left + 1);
- the job's `started` event with `restart_count` (the built-in job copies torchrun's TORCHELASTIC_RESTART_COUNT);
- the step going back within one attempt (the restarted workers resumed from an older checkpoint): one more
  restart, unless a restart was already counted since the previous step record.
Ordinals make the sources agree: a restart seen by two of them is recorded once; a gap (restart 2 seen, 1
not) records both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ulyssesd.remediation.records import EventRecord, Record, StepRecord

# torch/distributed/elastic/agent/server/api.py and nvidia_resiliency_ext/fault_tolerance/launcher.py
_WILL_RESTART = re.compile(r"(?:Worker group (?P<state>[A-Z]+)\. )?(?P<left>\d+)/(?P<max>\d+) (?:restart )?attempts "
                           r"left;\s*(?:will restart worker group|restarting worker group)")


@dataclass(frozen=True)
class InnerRestart:
    """One restart made inside an attempt by the inner launcher (or the job itself)."""

    attempt: int
    ordinal: int  # 1 = the attempt's first in-job restart
    source: str  # "launcher log" | "telemetry restart_count" | "step went back" | "implied by a later restart"
    evidence: str  # the line or record that showed it


def parse_restart_line(line: str) -> tuple[int, int, int] | None:
    """(ordinal, attempts left before it, max restarts) of a launcher's "will restart" line, else None."""
    m = _WILL_RESTART.search(line)
    if m is None:
        return None
    left, mx = int(m.group("left")), int(m.group("max"))
    if not 0 < left <= mx:
        return None
    return mx - left + 1, left, mx


@dataclass
class RestartLedger:
    """The in-job restarts of one attempt, each once."""

    attempt: int
    max_restarts: int
    recorded: int = 0  # highest ordinal recorded
    since_step: bool = False  # a restart was recorded after the newest step record
    last_step: int | None = None
    seen_max: int | None = field(default=None)  # the launcher's own max, when a line said it

    @property
    def left(self) -> int:
        """Restarts the inner launcher still has in this attempt."""
        return max(0, (self.seen_max or self.max_restarts) - self.recorded)

    def _upto(self, ordinal: int, source: str, evidence: str) -> list[InnerRestart]:
        out = []
        for k in range(self.recorded + 1, ordinal + 1):
            out.append(InnerRestart(self.attempt, k, source if k == ordinal else "implied by a later restart",
                                    evidence[:500]))
        if out:
            self.recorded = ordinal
            self.since_step = True
        return out

    def line(self, text: str) -> list[InnerRestart]:
        parsed = parse_restart_line(text)
        if parsed is None:
            return []
        ordinal, _left, mx = parsed
        self.seen_max = mx
        return self._upto(ordinal, "launcher log", text.strip())

    def record(self, rec: Record) -> list[InnerRestart]:
        if isinstance(rec, EventRecord):
            if rec.event == "started":
                n = rec.fields.get("restart_count")
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    return self._upto(n, "telemetry restart_count", f"started event restart_count={n}")
            return []
        assert isinstance(rec, StepRecord)
        prev, self.last_step = self.last_step, rec.step
        out: list[InnerRestart] = []
        if prev is not None and rec.step < prev and not self.since_step:
            out = self._upto(self.recorded + 1, "step went back", f"step {prev} then step {rec.step}")
        self.since_step = False
        return out
