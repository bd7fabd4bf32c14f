"""The msgspec fast path of parse_line (plain step lines decoded straight into a typed struct) gives exactly
what the dict path gives: the same record with the same field types, or the same RecordError, for random
mixes of valid, borderline (ints in float fields, floats in int fields, bools, "nan", short samples) and
invalid values."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ulyssesd.remediation import records
from ulyssesd.remediation.records import RecordError, StepRecord, parse_line

pytestmark = pytest.mark.skipif(records._step_decode is None, reason="msgspec is not installed")

FIELDS = ("time", "attempt", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s", "step_time_max_s",
          "slowest_rank", "tokens", "tokens_per_s", "mem_allocated_gib", "mem_max_allocated_gib", "mem_max_rank",
          "mem_reserved_gib", "samples", "config_version", "v")
values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 2**40), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["nan", "inf", "-inf", "x", "", 1.0, 2.5, -0.0, 0, 1]),
    st.lists(st.integers(0, 100), max_size=3), st.just([1, True]), st.just([1.0, 2]))


def _key(r):
    if isinstance(r, str):
        return r
    return (type(r).__name__, [(f.name, type(getattr(r, f.name)).__name__, repr(getattr(r, f.name)))
                               for f in dataclasses.fields(r)])


def _parse(line: bytes, fast: bool):
    saved = records._step_decode
    if not fast:
        records._step_decode = None
    try:
        return _key(parse_line(line))
    except RecordError as exc:
        return f"RecordError: {exc}"
    finally:
        records._step_decode = saved


@settings(max_examples=300, deadline=None)
@given(step=st.one_of(st.integers(-2, 10**6), st.none(), st.just(3.0), st.just(True)),
       loss=st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-3, 3), st.just("nan"),
                      st.none(), st.just(False)),
       kind=st.sampled_from(["step", "step", "step", "event", None, "Step"]),
       extra=st.dictionaries(st.sampled_from(FIELDS), values, max_size=len(FIELDS)),
       unknown=st.booleans())
def test_fast_path_equals_dict_path(step, loss, kind, extra, unknown):
    d = {"step": step, "loss": loss, **extra}
    if kind is not None:
        d["kind"] = kind
    if unknown:
        d["note"] = {"kind": "nested"}
    line = json.dumps(d).encode()
    assert _parse(line, fast=True) == _parse(line, fast=False)


def test_fast_path_is_taken_for_a_plain_step_line(monkeypatch):
    # Positive control: a plain line goes through the struct decoder (and only then the dict path is unused).
    calls = []
    decode = records._step_decode
    monkeypatch.setattr(records, "_step_decode", lambda b: calls.append(1) or decode(b))
    monkeypatch.setattr(records, "_fast_loads", lambda b: pytest.fail("dict path used for a plain step line"))
    r = parse_line(b'{"v":1,"kind":"step","step":5,"loss":2,"lr":1,"samples":[64,80],"skipped":false}\n')
    assert calls == [1] and isinstance(r, StepRecord)
    assert (r.loss, type(r.loss), r.lr, type(r.lr), r.samples) == (2.0, float, 1, int, (64, 80))


def test_lines_the_struct_rejects_fall_back_with_the_dict_paths_message():
    with pytest.raises(RecordError, match="'step' must be >= 0"):
        parse_line(b'{"kind":"step","step":-1,"loss":1.0}')
    with pytest.raises(RecordError, match="'kind'"):
        parse_line(b'{"step":1,"loss":1.0}')
    r = parse_line(b'{"kind":"step","step":1,"loss":"nan","grad_norm":"inf"}')
    assert r.loss != r.loss and r.grad_norm == float("inf")
