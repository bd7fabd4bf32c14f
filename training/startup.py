"""The job's start-up clock: when each start-up phase of a rank ended, counted from the process's own start.

A restart's time to the next productive step (MTTR) is detection + launch + start-up + checkpoint load + first
step; the start-up part had no timestamps between the launch and the resume. `STARTUP` marks the end of each
phase with one `time.monotonic()` call and the `started` event carries them (`startup`, docs/TRAINING.md):

    {"process_started_at": <unix time the rank's process was created>,
     "imports": s, ["standby_warm": s, "standby_gate": s,] "process_group": s, "tag_agreed": s,
     "model_built": s, "deepspeed_initialized": s, "checkpoint_loaded": s}

every value but the first is seconds since the process started (cumulative, so a phase's own duration is the
difference with the one before). The process's start comes from the kernel (`/proc/self/stat` field 22,
clock ticks since boot, against CLOCK_BOOTTIME), so the interpreter's own start-up and the first imports,
before any of this code runs, are counted too; where that is not readable, from this module's import.
The first step's record (its `time`) then tells the first step.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: Order of the phases in the event (a warm standby's two marks only on a standby's attempt).
PHASES = ("imports", "standby_warm", "standby_gate", "process_group", "tag_agreed", "model_built",
          "deepspeed_initialized", "checkpoint_loaded")


def process_age_s(stat_path: str = "/proc/self/stat") -> float | None:
    """Seconds since this process was created (kernel's start time), or None where it cannot be read."""
    try:
        with open(stat_path, "rb") as fh:
            raw = fh.read(4096).decode("ascii", "replace")
        # Field 2 (comm) is in parentheses and may hold spaces: the fields after the last ')' are fixed.
        fields = raw[raw.rindex(")") + 2:].split()
        start_ticks = int(fields[19])  # field 22 of the whole line: starttime, in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0.0 <= age < 30 * 86400 else None  # a nonsense reading is no reading


class StartupClock:
    """Marks the end of start-up phases, in seconds since the process started (see the module docstring)."""

    def __init__(self, age_s: float | None = None) -> None:
        age = process_age_s() if age_s is None else age_s
        now = time.monotonic()
        self.from_kernel = age is not None  # False: counted from this module's import, not the process start
        self.origin = now - (age or 0.0)  # monotonic time of the process's start
        self.process_started_at = time.time() - (age or 0.0)
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, first_only: bool = False) -> None:
        """`phase` ended now (a later mark replaces it; with `first_only` an earlier one stands: a standby
        marked its imports before the gate)."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
        if not (first_only and phase in self.marks):
            self.marks[phase] = round(time.monotonic() - self.origin, 3)

    def fields(self) -> dict[str, Any]:
        """The `started` event's `startup` value: the process's start, then each phase reached, in order."""
        out: dict[str, Any] = {"process_started_at": round(self.process_started_at, 3)}
        if not self.from_kernel:
            out["process_start_from"] = "module import"
        out.update((p, self.marks[p]) for p in PHASES if p in self.marks)
        return out


#: The rank's one clock, created when the job's entry point first imports this module.
STARTUP = StartupClock()
