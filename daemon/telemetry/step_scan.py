"""The step records of a telemetry file, streamed fast for whole-file views (`ulyssesctl report`).

A long run's file holds 10^7 step lines and the report reads it twice. The full record parser
(`records.parse_line`) builds a 20-field StepRecord and checks every field; a report needs nine. A plain step
line is therefore decoded by msgspec straight into a nine-field struct (the other fields are skipped unread);
any line that struct does not take exactly (events, "nan" spelled as a string, a missing field, a bad value
in a field it reads, msgspec absent) goes to `parse_line`, which decides as before. A line whose unread
fields are malformed is the one difference: the full parser would drop it; here its steps still count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ulyssesd.remediation.records import INT64_MAX, INT64_MIN, RecordError, StepRecord, parse_line

#: Bytes read from the file per call (lines are split in memory, not by a per-line readline).
READ_BYTES = 1 << 20

_decode: Any = None
try:  # optional, as in records.py: without it every line takes parse_line
    import msgspec
except ImportError:  # pragma: no cover - msgspec is a dependency of the package
    msgspec = None  # type: ignore[assignment]

if msgspec is not None:
    from typing import Annotated, Literal

    _I64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
    _F = _I64 | float | None

    class ReportStep(msgspec.Struct, gc=False):
        """What a report reads of a step line (the same names as StepRecord's fields)."""

        kind: Literal["step"]
        step: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
        loss: float
        time: _F = None
        attempt: _I64 | None = None
        step_time_s: _F = None
        step_time_max_s: _F = None
        tokens_per_s: _F = None
        mem_allocated_gib: _F = None
        mem_max_allocated_gib: _F = None

    _decode = msgspec.json.Decoder(ReportStep).decode


def timed_steps(path: Path) -> Iterator[Any]:
    """Step records with a time, in file order (objects with StepRecord's field names); lines that do not
    parse (a torn last line, garbage) and events are skipped."""
    decode = _decode
    with path.open("rb") as fh:
        carry = b""
        while chunk := fh.read(READ_BYTES):
            lines = (carry + chunk).split(b"\n")
            carry = lines.pop()
            for line in lines:
                rec = _one(line, decode)
                if rec is not None:
                    yield rec
        if carry:
            rec = _one(carry, decode)
            if rec is not None:
                yield rec


def _one(line: bytes, decode: Any) -> Any:
    if decode is not None:
        try:
            rec = decode(line)
        except (msgspec.DecodeError, RecursionError):
            pass
        else:
            return rec if rec.time is not None and rec.time - rec.time == 0 else None
    if not line.strip():
        return None
    try:
        full = parse_line(line)
    except RecordError:
        return None
    return full if isinstance(full, StepRecord) and full.time is not None else None
