"""Early warning from the cheap signals besides the grad norm (issue 39 item 3): output-logit growth, the
update-to-weight ratio per layer group and the fp16 loss-scale trajectory. Each: the blow-up's run-up it must
warn of (before the detector's own finding) AND the healthy run it must not warn on; the telemetry contract
accepts the fields (optional, backward compatible) and names a bad one."""

from __future__ import annotations

import math
import random

from ulyssesd.client.contract import validate_record
from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.learned.early_signals import SignalWatch
from ulyssesd.remediation.records import EventRecord, StepRecord, parse_line


def _run(steps: int, seed: int, *, logit_from: int | None = None, ratio_from: int | None = None,
         loss_from: int | None = None) -> list[StepRecord]:
    """A healthy run (loss falling with noise, logits ~20 with 5 % noise, update ratios ~1e-3 per group with
    15 % noise); `logit_from`: logits grow 4 % a step; `ratio_from`: the attention group's update ratio x6;
    `loss_from`: the loss grows 6 % a step (the blow-up the loss detector then finds)."""
    rng = random.Random(seed)
    out = []
    for s in range(1, steps + 1):
        loss = (2.0 + 6.0 * (s + 10) ** -0.4) * math.exp(rng.gauss(0, 0.03))
        logit = 20.0 * math.exp(rng.gauss(0, 0.05))
        ratios = {g: 1e-3 * math.exp(rng.gauss(0, 0.15)) for g in ("embed", "attn", "mlp")}
        if logit_from is not None and s >= logit_from:
            logit *= 1.04 ** (s - logit_from + 1)
        if ratio_from is not None and s >= ratio_from:
            ratios["attn"] *= 6.0
        if loss_from is not None and s >= loss_from:
            loss *= 1.06 ** (s - loss_from + 1)
        out.append(StepRecord(step=s, loss=loss, time=s * 0.5, attempt=1, grad_norm=1.0 * math.exp(rng.gauss(0, 0.1)),
                              step_time_s=0.5, logit_max=logit, update_ratio=ratios))
    return out


def _warnings(recs, watch=None):
    w = watch or SignalWatch()
    return [x for r in recs for x in w.observe(r)]


def test_healthy_signals_never_warn():
    for seed in range(5):
        assert _warnings(_run(5000, seed)) == []


def test_logit_growth_warns_within_a_few_steps():
    for seed in range(3):
        got = _warnings(_run(1500, seed, logit_from=1000))
        assert got and got[0]["signal"] == "logit_max" and 1000 <= got[0]["step"] <= 1012, got[:1]
        assert got[0]["value"] > 1.2 * got[0]["typical"] and "largest |output logit|" in got[0]["message"]


def test_one_groups_update_ratio_warns_and_names_the_group():
    got = _warnings(_run(1500, 1, ratio_from=1200))
    assert {w["signal"] for w in got} == {"update_ratio:attn"} and 1200 <= got[0]["step"] <= 1204


def _fp16(steps: int, storm_from: int | None = None) -> list[StepRecord]:
    """fp16 loss scale as DeepSpeed's dynamic scaler moves it: start-up halvings 65536 -> 4096, then x2 every
    500 clean steps, an overflow halving it back once it is high (and rarely at random): healthy; `storm_from`:
    overflows every 3 steps, each halving (the run-up to an overflow storm)."""
    rng = random.Random(0)
    out, scale, clean = [], 65536.0, 0
    for s in range(1, steps + 1):
        skipped = False
        if s <= 20 and s % 4 == 0:
            skipped = True
        elif storm_from is not None and s >= storm_from and (s - storm_from) % 3 == 0:
            skipped = True
        elif (scale >= 16384 and rng.random() < 0.3) or rng.random() < 0.0005:
            skipped = True   # healthy: overflows come when the scale is high, and rarely otherwise
        if skipped:
            scale, clean = max(1.0, scale / 2), 0
        else:
            clean += 1
            if clean % 500 == 0:
                scale *= 2
        out.append(StepRecord(step=s, loss=2.0, attempt=1, loss_scale=scale, skipped=skipped, grad_norm=None))
    return out


def test_loss_scale_walking_down_warns_before_the_overflow_storm_finding_and_healthy_fp16_does_not():
    w = SignalWatch()
    assert [x for r in _fp16(20000) if (x := w.observe_scale(r))] == []
    # The run-up: the engine's early warning comes before the overflow storm detector's finding.
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(mode="observe"), {"precision.dtype": "fp16"})
    warned, found = None, None
    eng.observe(EventRecord("started", step=0, attempt=1), 0.0)
    for r in _fp16(3000, storm_from=2000):
        for o in eng.observe(r, 0.0):
            if getattr(o, "symptom", None) == "overflow_storm" and found is None:
                found = o.step
        if eng.new_warnings and warned is None:
            warned = eng.new_warnings[0]
    assert warned is not None and warned["signal"] == "loss_scale" and warned["step"] >= 2000
    assert found is not None and warned["step"] < found, (warned, found)


def test_engine_warns_on_logits_before_the_loss_finding():
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(mode="observe"), {})
    warned, found = None, None
    for r in _run(1300, 2, logit_from=1000, loss_from=1010):
        for o in eng.observe(r, 0.0):
            if getattr(o, "symptom", None) == "loss_spike" and found is None:
                found = o.step
        if eng.new_warnings and warned is None:
            warned = eng.new_warnings[0]
    assert warned is not None and warned["signal"] == "logit_max"
    assert found is not None and warned["step"] < found


def test_contract_accepts_the_fields_and_names_a_bad_one():
    line = ('{"v":1,"kind":"step","step":5,"loss":2.5,"logit_max":31.5,'
            '"update_ratio":{"attn":0.0012,"mlp":"nan"}}')
    rec = parse_line(line)
    assert rec.logit_max == 31.5 and rec.update_ratio is not None and rec.update_ratio["attn"] == 0.0012
    assert math.isnan(rec.update_ratio["mlp"])
    assert validate_record({"v": 1, "kind": "step", "step": 5, "loss": 2.5, "logit_max": 31.5,
                            "update_ratio": {"attn": 0.001}}) == []
    bad = validate_record({"v": 1, "kind": "step", "step": 5, "loss": 2.5, "update_ratio": [0.001]})
    assert bad and "update_ratio" in bad[0]
    # Older records without them parse as before.
    assert parse_line('{"v":1,"kind":"step","step":5,"loss":2.5}').update_ratio is None
