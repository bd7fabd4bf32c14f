"""`[telemetry]` options of the telemetry the daemon derives itself (stdout, trainer_state, tensorboard).

A mixin of the job spec's `TelemetrySpec` (flat keys under `[telemetry]`); validated where the spec is
loaded, so that a pattern that cannot work is refused before anything runs.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

FILE_SOURCES = ("trainer_state", "tensorboard")



class PatternError(ValueError):
    """A `[telemetry] pattern` that cannot be used; the message says what to write."""


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The user's step-line regex: it must compile and name the groups `step` and `loss`."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise PatternError(f"telemetry.pattern {pattern!r} is not a regular expression: {exc}") from None
    missing = [g for g in ("step", "loss") if g not in rx.groupindex]
    if missing:
        raise PatternError(f"telemetry.pattern {pattern!r} needs the named group(s) "
                           + ", ".join(f"(?P<{g}>...)" for g in missing)
                           + r", e.g. 'it=(?P<step>\d+) .*? L=(?P<loss>\S+)'")
    return rx


class TelemetrySourceOptions(BaseModel):
    """Where the daemon gets a job's telemetry, and the options of the sources it derives itself."""

    source: Literal["job", "stdout", "trainer_state", "tensorboard"] = Field(
        "job", description="Where the daemon gets telemetry: the job's own telemetry file, records parsed from the "
        "job's log, or read from what its framework writes under telemetry.files (docs/CLIENT.md).")
    pattern: str | None = Field(None, max_length=2000, description="source=stdout: a regex with named groups "
                                "step and loss (optional lr, grad_norm) for step lines the built-in reader does not know.")
    files: str | None = Field(None, description="source=trainer_state|tensorboard: the directory the framework "
                              "writes (HF output_dir / logging_dir), relative to the spec file unless absolute.")
    silent_after_s: float = Field(900.0, ge=5, le=7 * 86400, description="A running attempt with no step record "
                                  "for this long is reported (status, journal, webhook) with the setting that fixes it.")

    @model_validator(mode="after")
    def _usable(self) -> Any:
        if self.pattern is not None:
            compile_pattern(self.pattern)  # PatternError (a ValueError) names what is missing
        if self.files is not None and "\x00" in self.files:
            raise ValueError("telemetry.files: a path may not contain a NUL byte")
        source = self.source
        if source in FILE_SOURCES and not self.files:
            raise ValueError(f"telemetry.source={source!r} needs telemetry.files: the directory the framework "
                             f"writes (e.g. files = \"out\" for HF's output_dir, \"out/runs\" for TensorBoard)")
        return self
