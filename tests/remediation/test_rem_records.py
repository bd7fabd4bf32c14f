"""Telemetry record parsing: the docs/CONTRACTS.md contract, non-finite strings, extras, clear errors."""

from __future__ import annotations

import json
import math

import pytest

from ulyssesd.remediation.records import EventRecord, RecordError, StepRecord, parse_line, parse_record

DESIGN_STEP = ('{"v":1,"kind":"step","time":1764444444.1,"attempt":3,"step":1200,"loss":2.31,"grad_norm":0.84,'
               '"lr":1.2e-4,"loss_scale":null,"skipped":false,"step_time_s":2.92,"step_time_max_s":2.95,'
               '"slowest_rank":1,"tokens":32768,"tokens_per_s":11217,"mem_allocated_gib":41.2,'
               '"mem_max_allocated_gib":66.9,"mem_max_rank":0,"mem_reserved_gib":70.1}')
DESIGN_EVENT = ('{"v":1,"kind":"event","time":1764444450.0,"attempt":3,"step":1200,"event":"checkpoint_saved",'
                '"tag":"step-00001200","seconds":4.1}')


def test_design_step_example_parses_every_field():
    r = parse_line(DESIGN_STEP)
    assert isinstance(r, StepRecord)
    assert (r.step, r.loss, r.attempt, r.grad_norm, r.slowest_rank, r.tokens) == (1200, 2.31, 3, 0.84, 1, 32768)
    assert r.skipped is False and r.loss_scale is None and r.mem_max_allocated_gib == 66.9
    assert r.tokens_per_s == 11217 and r.mem_max_rank == 0 and r.time == 1764444444.1


def test_design_event_example_keeps_its_fields():
    r = parse_line(DESIGN_EVENT)
    assert isinstance(r, EventRecord)
    assert r.event == "checkpoint_saved" and r.step == 1200 and r.fields == {"tag": "step-00001200", "seconds": 4.1}


def test_only_kind_step_loss_are_required_and_extras_are_allowed():
    r = parse_line('{"kind":"step","step":7,"loss":1.5,"samples":[112,128],"config_version":2,"my_field":"x"}')
    assert isinstance(r, StepRecord)
    assert r.samples == (112, 128) and r.config_version == 2 and r.time is None and r.grad_norm is None


@pytest.mark.parametrize("text,expected", [("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)])
def test_non_finite_strings(text, expected):
    r = parse_line(json.dumps({"kind": "step", "step": 1, "loss": text, "grad_norm": text}))
    assert isinstance(r, StepRecord)
    for v in (r.loss, r.grad_norm):
        assert (math.isnan(v) and math.isnan(expected)) or v == expected


@pytest.mark.parametrize("line,needle", [
    ("this is not json", "not JSON"),
    ("", "empty line"),
    ("[1, 2]", "must be a JSON object"),
    ('{"step": 1, "loss": 2.0}', "'kind'"),
    ('{"kind": "step", "loss": 2.0}', "'step'"),
    ('{"kind": "step", "step": 1}', "'loss'"),
    ('{"kind": "step", "step": "1", "loss": 2.0}', "'step' must be an integer"),
    ('{"kind": "step", "step": 1, "loss": "high"}', "'loss' must be a number"),
    ('{"kind": "step", "step": 1, "loss": true}', "'loss' must be a number"),
    ('{"kind": "step", "step": 1, "loss": 1.0, "skipped": "no"}', "'skipped'"),
    ('{"kind": "step", "step": 1, "loss": 1.0, "samples": [1]}', "'samples'"),
    ('{"kind": "step", "step": -3, "loss": 1.0}', "'step' must be >= 0"),
    ('{"kind": "sample", "step": 1, "loss": 1.0}', "'kind' must be"),
    ('{"kind": "event", "step": 1}', "'event'"),
])
def test_garbage_is_rejected_with_a_message_naming_the_problem(line, needle):
    with pytest.raises(RecordError) as exc:
        parse_line(line)
    assert needle in str(exc.value)


def test_fast_and_validating_paths_agree():
    d = json.loads(DESIGN_STEP)
    fast = parse_record(dict(d))
    slow = parse_record({**d, "unknown_extra": 1})  # an extra key forces the validating path
    assert fast == slow


@pytest.mark.parametrize("field", ["time", "lr", "step_time_s"])
def test_a_float_fields_huge_int_gets_the_same_answer_on_every_parse_path(field):
    # The fast decoder once let a 400-digit integer through as an int, and the detectors' float() of it raised
    # OverflowError; found by the telemetry fuzz test. Now every path agrees with the validating one.
    huge = json.dumps({"kind": "step", "step": 1, "loss": 1.0, field: 10 ** 400})
    with pytest.raises(RecordError, match=f"field '{field}' is too large for a float"):
        parse_line(huge)
    with pytest.raises(RecordError, match=f"field '{field}' is too large for a float"):
        parse_record(json.loads(huge))
    big = json.dumps({"kind": "step", "step": 1, "loss": 1.0, field: 2 ** 64})
    assert getattr(parse_line(big), field) == getattr(parse_record(json.loads(big)), field) == 2.0 ** 64
    assert getattr(parse_line(big.replace(str(2 ** 64), "12")), field) == 12
