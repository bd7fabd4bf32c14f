"""Replay stays exactly what it was before the throughput work (issue 5): the findings and decisions of a
20,000-step synthetic run with every kind of injected fault, a hang gap and a restart, replayed from JSON
lines (timed) and from records without `time` (synthetic clock, observe mode, fp16, device capacity), must
equal the fixture recorded with the pre-optimization code, field by field (evidence floats included).

Regenerate only on an intended behaviour change:
    .venv/bin/python tests/remediation/test_rem_replay_golden.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ulyssesd.daemon.operator.ctl_offline import item_to_dict
from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.records import parse_line, parse_record
from ulyssesd.remediation.replay import replay
from ulyssesd.remediation.synthetic import Injection, TraceSpec, trace

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "replay" / "golden_20k.json"
STEPS = 20_000
RESTART_AFTER = 10_000   # attempt 2 starts here, after a crash gap
HANG_AFTER = 7_000       # 900 s of silence after this step (a hang in attempt 1)


def golden_trace() -> list[dict[str, Any]]:
    spec = TraceSpec(steps=STEPS, seed=5, injections=[
        Injection("spike", 3000, 1, 3.0), Injection("spike", 4000, 4, 2.5), Injection("nan", 6000),
        Injection("slow_rank", 9000, 200, 1.6), Injection("memory", 12000, 5, 1.8),
        Injection("oscillation", 14000, 120, 3.0), Injection("overflow", 16000, 400),
        Injection("nan", 18500, 3)])
    out: list[dict[str, Any]] = []
    shift = 0.0
    for d in trace(spec):
        d = dict(d)
        step = d.get("step") or 0
        if d["kind"] == "step" and step == HANG_AFTER + 1 and shift == 0.0:
            shift = 900.0
        if step > RESTART_AFTER or (d["kind"] == "step" and step == RESTART_AFTER + 1):
            d["attempt"] = 2
        if "time" in d:
            d["time"] = round(d["time"] + shift + (300.0 if step > RESTART_AFTER else 0.0), 3)
        if d["kind"] == "step" and step == RESTART_AFTER + 1:
            out.append({"v": 1, "kind": "event", "event": "started", "time": round(d["time"] - 5.0, 3),
                        "attempt": 2, "step": RESTART_AFTER})
        if d["kind"] == "step" and step % 997 == 0:
            d["loss_scale"] = 1.0  # at the fp16 floor of variant B's job values (a skipped step there is a NaN)
        if d["kind"] == "step" and 15_000 <= step < 15_040:  # every rank slow: slow_step (explains throughput)
            d["step_time_s"], d["step_time_max_s"] = d["step_time_s"] * 3, d["step_time_max_s"] * 3
            d["tokens_per_s"] = round(d["tokens_per_s"] / 3, 1)
        if d["kind"] == "step" and 19_000 <= step < 19_100:  # fewer tokens per step: a pure throughput drop
            d["tokens_per_s"] = round(d["tokens_per_s"] * 0.6, 1)
        out.append(d)
    return out


def variant_a() -> list[dict[str, Any]]:
    """Timed JSON lines through parse_line, default thresholds, act mode."""
    recs = [parse_line(json.dumps(d, separators=(",", ":")).encode()) for d in golden_trace()]
    return [item_to_dict(it) for it in replay(recs)]


def variant_b() -> list[dict[str, Any]]:
    """No `time` (synthetic clock), observe mode, fp16 job with a loss-scale floor, device capacity set."""
    recs = []
    for d in golden_trace():
        d.pop("time", None)
        recs.append(parse_record(d))
    det = DetectorsConfig(device_memory_gib=70.0, window=60, refire_steps=20)
    pol = RemediationConfig(mode="observe", grace_steps=10)
    job = {"precision.dtype": "fp16", "precision.loss_scale.min_loss_scale": 1.0, "train.lr": 1e-4}
    return [item_to_dict(it) for it in replay(recs, det, pol, job)]


def _roundtrip(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return json.loads(json.dumps(items))


def test_replay_matches_the_recorded_golden_output_exactly():
    want = json.loads(FIXTURE.read_text())
    got_a, got_b = _roundtrip(variant_a()), _roundtrip(variant_b())
    # Positive control: the trace does exercise findings and decisions of many kinds in both variants.
    assert len({(i["type"], i.get("symptom")) for i in got_a}) >= 8
    assert any(i["type"] == "decision" for i in got_b)
    assert len(got_a) == len(want["a"]) and len(got_b) == len(want["b"])
    for n, (g, w) in enumerate(zip(got_a, want["a"], strict=True)):
        assert g == w, f"variant a, item {n}"
    for n, (g, w) in enumerate(zip(got_b, want["b"], strict=True)):
        assert g == w, f"variant b, item {n}"


def test_golden_comparison_detects_a_changed_threshold():
    # Negative control: a slightly different baseline window changes the output, so the comparison can fail.
    want = json.loads(FIXTURE.read_text())["a"]
    recs = [parse_record(d) for d in golden_trace()]
    got = _roundtrip([item_to_dict(it) for it in replay(recs, DetectorsConfig(window=90))])
    assert got != want


if __name__ == "__main__" and "--write" in sys.argv:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({"a": variant_a(), "b": variant_b()}, indent=0) + "\n")
    print(f"wrote {FIXTURE}")
