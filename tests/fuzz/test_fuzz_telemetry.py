"""Fuzz: the telemetry parser (records.parse_line) and TelemetryReader over a real file. Whatever the bytes,
the parser returns a record inside the bounds or raises RecordError; the reader never raises, always moves
past what it consumed, and agrees with parse_line line by line."""

from __future__ import annotations

import math
import os

from fuzz_helpers import MIN_CASES, fuzz_settings, variants
from fuzz_strategies import telemetry_lines
from hypothesis import given
from hypothesis import strategies as st

from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader
from ulyssesd.remediation.records import (
    INT64_MAX,
    INT64_MIN,
    EventRecord,
    RecordError,
    StepRecord,
    parse_line,
)

_INT_FIELDS = ("attempt", "slowest_rank", "tokens", "mem_max_rank", "config_version")


def _check_bounds(rec) -> None:
    assert isinstance(rec, StepRecord | EventRecord)
    if rec.step is not None:
        assert type(rec.step) is int and 0 <= rec.step <= INT64_MAX
    assert rec.time is None or math.isfinite(rec.time)
    if isinstance(rec, StepRecord):
        assert isinstance(rec.loss, float)
        for name in _INT_FIELDS:
            val = getattr(rec, name)
            assert val is None or (type(val) is int and INT64_MIN <= val <= INT64_MAX), (name, val)
        if rec.samples is not None:
            assert all(INT64_MIN <= x <= INT64_MAX for x in rec.samples)


def _outcome(line: bytes | str):
    try:
        rec = parse_line(line)
    except RecordError as exc:
        assert str(exc)  # the message names the problem
        return None
    _check_bounds(rec)
    return rec


def test_parse_line_returns_a_bounded_record_or_record_error():
    cases = [0]

    @fuzz_settings(cases_per_example=7)
    @given(line=telemetry_lines())
    def run(line):
        for v in variants(line):
            _outcome(v)
            cases[0] += 1
        _outcome(line.decode("utf-8", "replace"))  # str input takes the same paths
        cases[0] += 1

    run()
    assert cases[0] >= MIN_CASES


_BATCH, _LINE = 512, 2000  # small bounds, so the over-long-line path (several batches) is hit by short cases


def test_reader_never_raises_moves_past_every_line_and_agrees_with_parse_line(fuzz_dir):
    path = fuzz_dir / "telemetry.jsonl"
    cases = [0]

    @fuzz_settings(cases_per_example=6.5)
    @given(drawn=st.lists(st.one_of(telemetry_lines(), st.just(b""), st.just(b"x" * 3000)), min_size=1, max_size=6),
           cuts=st.lists(st.integers(0, 2000), max_size=3), tail=st.binary(max_size=20))
    def run(drawn, cuts, tail):
        lines = [v for line in drawn for v in variants(line, n_cuts=1, n_flips=1)]
        data = b"".join(line + b"\n" for line in lines)
        path.write_bytes(b"")
        reader = TelemetryReader(path, max_logged_garbage=0, max_batch_bytes=_BATCH, max_line_bytes=_LINE)
        got, written, last = [], 0, 0
        for cut in [*sorted(c for c in cuts if c < len(data)), len(data)]:  # the job writes in pieces
            with open(path, "ab") as fh:
                fh.write(data[written:cut])
            written = max(written, cut)
            for _ in range(len(data) // _BATCH + 3):  # drain: stop when a read makes no progress
                before = reader.scanned_to
                batch = reader.read()
                got.extend(rec for rec, _off in batch)
                assert last <= reader.cursor.offset <= os.path.getsize(path)
                last = reader.cursor.offset
                if not batch and reader.scanned_to == before:
                    break
        assert reader.cursor.offset == len(data)  # past every complete line, good or bad
        # what the file holds, line by line (a flipped byte can itself be a newline and split a drawn line)
        outcomes = [(_outcome(line.decode("utf-8", "replace")) if len(line) <= _LINE else None)
                    for line in data.split(b"\n")[:-1] if line.strip()]
        assert got == [r for r in outcomes if r is not None]
        assert reader.garbage_lines == sum(r is None for r in outcomes)
        with open(path, "ab") as fh:  # a partial last line waits, whatever it holds
            fh.write(tail.replace(b"\n", b""))
        reader.read()
        assert reader.cursor.offset == len(data)
        cases[0] += len(lines)

    run()
    assert cases[0] >= MIN_CASES
