"""A bounded read of a big telemetry file for whole-run views (`ulyssesctl report`): evenly spaced windows.

A run of 10^7 step lines is a 2.5 GB file; reading it whole took the report 80 s. Past `SampleConfig.max_bytes`
the file is read in `windows` evenly spaced windows of equal size instead (at most `max_bytes` in all), and
where the attempt changes between two windows the change is found exactly by bisection (single-line probes),
so every attempt's first and last step line is in the sample. Each sampled line carries the weight of the
bytes it stands for (file size / bytes read): sums over the sample (step time, the goodput) are estimates of the
whole file's, and say so; the boundary lines found by bisection carry weight 0 (they place the attempts, they
do not count twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulyssesd.daemon.telemetry.step_scan import _decode, _one, timed_steps

MIN_WINDOW = 4 << 10  # a window holds at least this many bytes (tens of lines)
PROBE_BYTES = 16 << 10  # one bisection probe reads this much to find the next whole step line
MAX_PROBES = 200_000  # bisection probes in all (10^3 attempt changes take ~30 each); past it, boundaries are
#                       known to the window spacing only


@dataclass(frozen=True)
class SampleConfig:
    """How much of a telemetry file a whole-run view reads."""

    max_bytes: int = 32 << 20  # a file up to this size is read whole; a larger one is sampled to this much
    windows: int = 2048  # evenly spaced windows a larger file is read in (each max_bytes / windows long)


@dataclass
class Sampled:
    """What a sampled read covered, for the page to say."""

    file_bytes: int
    read_bytes: int
    windows: int
    probes: int = 0  # bisection probes that placed the attempts' boundaries


@dataclass(slots=True)
class Line:
    """One step line of the sample: its record, what it stands for, and whether it follows the previous one."""

    offset: int
    rec: Any
    weight: float  # file bytes per sampled byte (1.0 when the file is read whole; 0 for a boundary probe)
    follows: bool  # the previous line of the sample is its predecessor in the file (no gap between them)


def step_lines(path: Path, cfg: SampleConfig = SampleConfig()) -> tuple[list[Line] | Iterator[Line], Sampled | None]:
    """The file's timed step lines in file order: every one (streamed; `Sampled` None) when it is at most
    `cfg.max_bytes`, else the windows' lines and the attempts' boundary lines (a list, with what was read)."""
    size = path.stat().st_size
    if size <= cfg.max_bytes:
        return (Line(0, rec, 1.0, True) for rec in timed_steps(path)), None
    n = max(2, min(cfg.windows, cfg.max_bytes // MIN_WINDOW))
    width = cfg.max_bytes // n
    starts = [round(i * (size - width) / (n - 1)) for i in range(n)]
    read = covered = 0  # bytes read; bytes of the whole lines in them (what the sampled lines stand for)
    lines: list[Line] = []
    ends: list[tuple[int, Any, int, Any]] = []  # per window: (first offset, first rec, last offset, last rec)
    with path.open("rb") as fh:
        for start in starts:
            got, whole = _window(fh, start, width)
            read += width
            covered += whole
            if got:
                lines.extend(Line(off, rec, 0.0, i > 0) for i, (off, rec) in enumerate(got))
                ends.append((got[0][0], got[0][1], got[-1][0], got[-1][1]))
        info = Sampled(size, read, n)
        weight = size / max(1, covered)
        for line in lines:
            line.weight = weight
        for (_, _, a_off, a_rec), (b_off, b_rec, _, _) in zip(ends, ends[1:], strict=False):
            if a_rec.attempt != b_rec.attempt:
                _bisect(fh, a_off, a_rec, b_off, b_rec, lines, info)
    lines.sort(key=lambda x: (x.offset, -x.weight))
    kept = [line for i, line in enumerate(lines) if i == 0 or line.offset != lines[i - 1].offset]
    for prev, line in zip(kept, kept[1:], strict=False):
        if line.weight == 0.0 or prev.weight == 0.0:
            line.follows = False  # a probe's neighbours are not its file neighbours
    return kept, info


def _window(fh: Any, start: int, width: int) -> tuple[list[tuple[int, Any]], int]:
    """The step lines among the whole lines inside [start, start + width) (a line cut by either edge is left
    out), and how many bytes those whole lines (steps or not) span."""
    fh.seek(start)
    chunk = fh.read(width)
    pos = 0
    if start > 0:
        nl = chunk.find(b"\n")
        if nl < 0:
            return [], 0
        pos = nl + 1
    first, out = pos, []
    while (nl := chunk.find(b"\n", pos)) >= 0:
        rec = _one(chunk[pos:nl], _decode)
        if rec is not None:
            out.append((start + pos, rec))
        pos = nl + 1
    return out, pos - first


def _probe(fh: Any, offset: int, limit: int) -> tuple[int, Any] | None:
    """The first whole step line starting after `offset` (past its line's end) and before `limit`."""
    pos = offset
    while pos < limit:
        fh.seek(pos)
        chunk = fh.read(PROBE_BYTES)
        if not chunk:
            return None
        nl = chunk.find(b"\n")
        while nl >= 0:
            start = pos + nl + 1
            if start >= limit:
                return None
            end = chunk.find(b"\n", nl + 1)
            if end < 0:
                break
            rec = _one(chunk[nl + 1:end], _decode)
            if rec is not None:
                return start, rec
            nl = end
        pos += max(1, nl + 1 if nl >= 0 else len(chunk))
    return None


def _bisect(fh: Any, a_off: int, a_rec: Any, b_off: int, b_rec: Any, out: list[Line], info: Sampled) -> None:
    """Place every attempt change between the step lines at a_off (attempt a_rec.attempt) and b_off: the last
    line before each change and the first after it go into `out` (weight 0). Bounded by MAX_PROBES in all."""
    if a_rec.attempt == b_rec.attempt or info.probes >= MAX_PROBES:
        return
    mid = _probe(fh, (a_off + b_off) // 2, b_off)
    if mid is None:  # no line starts in the upper half: the first line after a_off, if any, is in the lower
        mid = _probe(fh, a_off, b_off)
    info.probes += 1
    if mid is None:  # a_off and b_off are neighbouring step lines: the change is between them
        out.append(Line(a_off, a_rec, 0.0, False))
        out.append(Line(b_off, b_rec, 0.0, False))
        return
    _bisect(fh, a_off, a_rec, mid[0], mid[1], out, info)
    _bisect(fh, mid[0], mid[1], b_off, b_rec, out, info)


