"""Fuzz: what the daemon does with each parsed record — the remediation engine's observe/tick — never raises
on records that pass the parser's bounds: zero, denormal, huge, negative and non-finite values, flat or zero
windows, huge steps, events with odd fields. (The supervisor also guards each record, but a detector that
raised would silently lose that record's findings.)"""

from __future__ import annotations

from fuzz_helpers import MIN_CASES, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.records import INT64_MAX, INT64_MIN, RecordError, parse_record

NUM = st.one_of(st.sampled_from([0, 0.0, -0.0, 1e-300, 5e-324, 1e300, -1e300, "nan", "inf", "-inf", -1, 2**62,
                                 1.0, 0.5, 3.0]),
                st.floats(allow_nan=False, allow_infinity=False), st.integers(INT64_MIN, INT64_MAX), st.none())
INT = st.one_of(st.none(), st.integers(INT64_MIN, INT64_MAX), st.sampled_from([0, 1, -1, 2]))
STEP = st.fixed_dictionaries(
    {"kind": st.just("step"), "step": st.integers(0, 50) | st.integers(0, INT64_MAX), "loss": NUM.filter(
        lambda x: x is not None)},
    optional={"time": st.floats(allow_nan=False, allow_infinity=False) | st.none(), "attempt": INT,
              "grad_norm": NUM, "lr": NUM, "loss_scale": NUM, "skipped": st.booleans() | st.none(),
              "step_time_s": NUM, "step_time_max_s": NUM, "slowest_rank": INT, "tokens": INT,
              "tokens_per_s": NUM, "mem_allocated_gib": NUM, "mem_max_allocated_gib": NUM, "mem_max_rank": INT,
              "mem_reserved_gib": NUM, "samples": st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=2,
                                                           max_size=2) | st.none(), "config_version": INT})
EVENT = st.fixed_dictionaries(
    {"kind": st.just("event"), "event": st.sampled_from(["started", "checkpoint_saved", "checkpoint_saving",
                                                         "exiting", "control_applied", "checkpoint_invalid",
                                                         "fault_injected", "x"])},
    optional={"step": st.integers(0, 50) | st.integers(0, INT64_MAX), "attempt": INT,
              "tag": st.sampled_from(["step-00000010", "", "x", None, 3]),
              "reason": st.sampled_from(["completed", "sigterm", None, 1]),
              "time": st.floats(allow_nan=False, allow_infinity=False)})


def test_engine_observe_and_tick_never_raise_on_bounded_records():
    cases = [0]

    @fuzz_settings(cases_per_example=2.8)
    @given(warm=st.sampled_from([0, 3, 12, 40]), flat=st.booleans(),
           stream=st.lists(st.one_of(STEP, STEP, EVENT), min_size=1, max_size=14), start=st.floats(0, 2e9),
           dt=st.sampled_from([0.0, 0.001, 1.0, 1e6]))
    def run(warm, flat, stream, start, dt):
        engine = RemediationEngine()
        now = start
        # A healthy (or perfectly flat) prefix first, so windows fill and detectors are armed when the hostile
        # records arrive; those are the counted cases.
        for s in range(warm):
            loss = 2.0 if flat else 2.0 - 0.001 * s + 0.01 * ((s * 7919) % 13 - 6) / 6
            now += 1.0
            engine.observe(parse_record({"kind": "step", "step": s, "loss": loss, "step_time_s": 1.0,
                                         "loss_scale": 65536.0, "grad_norm": 1.0, "skipped": False}), now)
        for d in stream:
            if "step" in d and d["kind"] == "step" and d["step"] <= 50:
                d["step"] += warm  # mostly after the prefix, as in a real stream
            try:
                rec = parse_record(d)
            except RecordError:
                continue
            now += dt
            engine.tick(now)
            engine.observe(rec, now)
            cases[0] += 1

    run()
    assert cases[0] >= MIN_CASES


def _feed(records, engine=None):
    engine = engine or RemediationEngine()
    out = []
    for i, d in enumerate(records):
        out += engine.observe(parse_record(d), 1000.0 + i) or []
    return out


def test_regressions_the_fuzzer_found_in_the_detectors():
    # NaN as the very first loss, then exactly 0: the zero-loss message formatted None (TypeError).
    found = _feed([{"kind": "step", "step": 1, "loss": "nan"}, {"kind": "step", "step": 2, "loss": 0.0}])
    assert any(f.symptom == "nan_loss" for f in found)
    # The loss scale falling from 1e300 to a denormal: log2(inf) made round() raise OverflowError.
    _feed([{"kind": "step", "step": s, "loss": 2.0, "loss_scale": sc, "skipped": True}
           for s, sc in enumerate([1e300, 5e-324, 1e300, 5e-324])])
    # A perfectly flat window, then a spike: sigma 0 made the spike message divide by zero.
    flat = [{"kind": "step", "step": s, "loss": 2.0} for s in range(60)]
    found = _feed([*flat, *({"kind": "step", "step": 60 + s, "loss": 50.0} for s in range(10))])
    assert any(f.symptom == "loss_spike" for f in found)
