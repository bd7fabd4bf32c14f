"""The optional pre-emptive clip on a grad-norm early warning (issue 39 item 3, `[remediation]
early_warning_clip`, off by default): ZClip's rule from the run's own grad norms, bounded (clip_floor, never
raised, a budget), verified like a rung; off by default and silent on a healthy run."""

from __future__ import annotations

import math
import random

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.playbook import K_CLIP
from ulyssesd.remediation.records import StepRecord


def _run(steps: int, seed: int = 0, blowup_from: int | None = None, loss_from: int | None = None, first: int = 1):
    rng = random.Random(seed)
    for s in range(first, steps + 1):
        g = 0.3 * math.exp(rng.gauss(0, 0.1))   # late in training: well under the clip of 1.0
        loss = (2.0 + 6.0 * (s + 10) ** -0.4) * math.exp(rng.gauss(0, 0.03))
        if blowup_from is not None and s >= blowup_from:
            g *= 1.3 ** (s - blowup_from + 1)
        if loss_from is not None and s >= loss_from:
            loss *= 1.1 ** (s - loss_from + 1)
        yield StepRecord(step=s, loss=loss, time=s * 0.5, attempt=1, grad_norm=g, step_time_s=0.5)


def _engine(**policy):
    return RemediationEngine(DetectorsConfig(), RemediationConfig(**policy), {K_CLIP: 1.0})


def _drive(eng, recs):
    warnings = []
    for r in recs:
        eng.observe(r, 0.0)
        warnings.extend(eng.new_warnings)
        eng.new_warnings = []
    return warnings


def test_off_by_default_and_silent_on_a_healthy_run():
    eng = _engine()
    ws = _drive(eng, _run(600, blowup_from=500))
    assert ws and all("action" not in w for w in ws) and eng.values[K_CLIP] == 1.0
    on = _engine(early_warning_clip=True)
    assert _drive(on, _run(3000, seed=1)) == [] and on.values[K_CLIP] == 1.0


def test_a_warning_lowers_the_clip_to_the_runs_own_threshold_and_verifies_it():
    eng = _engine(early_warning_clip=True, verify_steps=50)
    ws = _drive(eng, _run(505, blowup_from=500))
    w = next(w for w in ws if "action" in w)
    act = w["action"]
    typical = w["typical_grad_norm"]
    # ZClip: the run's typical grad norm x exp(2.5 sigma of its log): above the typical, below the old 1.0.
    assert typical < act["to"] < 1.0 and act["to"] == round(typical * math.exp(2.5 * w["log_sd"]), 4)
    assert act["patch"] == {K_CLIP: act["to"]} and eng.values[K_CLIP] == act["to"]
    # The grad norm calms down (the clip held): 50 clean steps make it effective.
    _drive(eng, _run(560, seed=2, first=506))
    assert eng.preempt.outcomes and eng.preempt.outcomes[0]["outcome"] == "effective"


def test_a_loss_finding_in_its_window_makes_it_ineffective_and_bounds_hold():
    eng = _engine(early_warning_clip=True, verify_steps=200)
    _drive(eng, _run(560, blowup_from=500, loss_from=505))
    assert eng.preempt.outcomes and eng.preempt.outcomes[0]["outcome"] == "ineffective"
    # The floor: a run whose grad norms are tiny never gets a clip below clip_floor.
    tiny = _engine(early_warning_clip=True, clip_floor=0.5)
    act = tiny.preempt.propose({"step": 9, "typical_grad_norm": 0.01, "log_sd": 0.1}, 1.0)
    assert act is not None and act["to"] == 0.5
    # Never raised: a clip already under the threshold is left, with why.
    low = _engine(early_warning_clip=True)
    assert "already" in low.preempt.propose({"step": 9, "typical_grad_norm": 0.8, "log_sd": 0.1}, 0.3)["skipped"]
    # The budget: early_warning_clip_max per run.
    one = _engine(early_warning_clip=True, early_warning_clip_max=1)
    assert "patch" in one.preempt.propose({"step": 9, "typical_grad_norm": 0.8, "log_sd": 0.1}, 5.0)
    one.preempt.pending = None
    assert "early_warning_clip_max" in one.preempt.propose({"step": 99, "typical_grad_norm": 0.8, "log_sd": 0.1},
                                                           5.0)["skipped"]
