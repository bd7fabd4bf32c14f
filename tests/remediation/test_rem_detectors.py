"""Table-driven detector tests: for each detector a positive case (flagged at the right step, evidence named)
and noisy healthy cases it must not flag."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from rem_helpers import healthy, run_detector

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors import (
    SYMPTOMS,
    LossOscillationDetector,
    LossSpikeDetector,
    MemorySpikeDetector,
    NanLossDetector,
    OverflowStormDetector,
    SlowStepDetector,
    StragglerDetector,
    ThroughputDropDetector,
    build_detectors,
)
from ulyssesd.remediation.records import EventRecord

CFG = DetectorsConfig()


@dataclass
class Case:
    name: str
    make: Any                       # cfg -> detector
    mutate: Any                     # (step, rec) -> None
    first_step: int | tuple[int, int] | None   # step (or [lo, hi] range) of the first finding; None = quiet
    n: int = 500
    cfg: dict = field(default_factory=dict)
    evidence: dict = field(default_factory=dict)   # key -> expected value in the first finding
    loss_noise: float = 0.02


def _nan_at(step):
    def m(s, r):
        if s == step:
            r.loss = math.nan
    return m


def _gn_inf_unskipped(step):
    def m(s, r):
        if s == step:
            r.grad_norm = math.inf
    return m


def _fp16_startup_overflows(s, r):
    # The dynamic loss scale calibrating: the first 12 steps overflow, grad norm inf, steps skipped.
    if s <= 12:
        r.skipped, r.grad_norm, r.loss_scale = True, math.inf, 2.0 ** (16 - s)
    else:
        r.loss_scale = 16.0


def _loss_times(step, k, length=1):
    def m(s, r):
        if step <= s < step + length:
            r.loss *= k
    return m


def _oscillate(start, length, amp):
    def m(s, r):
        if start <= s < start + length:
            r.loss *= 1 + amp * (1 if s % 2 else -1)
    return m


def _mem(step, k, length=1, rank=5):
    def m(s, r):
        if step <= s < step + length:
            r.mem_max_allocated_gib *= k
            r.mem_max_rank = rank
    return m


def _mem_set(step, gib, rank=2):
    def m(s, r):
        if s == step:
            r.mem_max_allocated_gib, r.mem_max_rank = gib, rank
    return m


def _tiny_mem(s, r):
    r.mem_max_allocated_gib = 0.01 * (3 if s == 300 else 1)  # a CPU run: 3x of nothing is not a spike


def _skips(start, length, every):
    def m(s, r):
        r.skipped = start <= s < start + length and s % every == 0
    return m


def _rare_skips(s, r):
    r.skipped = s % 97 == 0


def _slow(start, length, k):
    def m(s, r):
        if start <= s < start + length:
            r.step_time_s *= k
            r.step_time_max_s *= k
            r.tokens_per_s /= k
    return m


def _single_slow_steps(s, r):
    if s % 37 == 0:  # isolated GC / dataloader hiccups, even 3x, are normal
        r.step_time_s *= 3
        r.step_time_max_s *= 3
        r.tokens_per_s /= 3


def _straggle(start, length, k, rank=3):
    def m(s, r):
        if start <= s < start + length:
            r.step_time_max_s = r.step_time_s * k
            r.slowest_rank = rank
            r.tokens_per_s = r.tokens / r.step_time_max_s
    return m


def _spread_hiccups(s, r):
    if s % 23 == 0:  # a different rank lags briefly now and then
        r.step_time_max_s = r.step_time_s * 1.5
        r.slowest_rank = s % 8


def _tps(start, length, k):
    def m(s, r):
        if start <= s < start + length:
            r.tokens_per_s *= k
    return m


def _tps_dips(s, r):
    if s % 11 < 3:  # short dips of 30 % that never last
        r.tokens_per_s *= 0.7


CASES = [
    # nan_loss: immediate, no warm-up; overflowed-and-skipped fp16 steps are not NaN.
    Case("nan loss", lambda c: NanLossDetector(c), _nan_at(150), 150, evidence={"loss": "nan"}),
    Case("nan during warm-up still flagged", lambda c: NanLossDetector(c), _nan_at(3), 3),
    Case("inf grad norm on an applied step", lambda c: NanLossDetector(c), _gn_inf_unskipped(222), 222),
    Case("fp16 start overflows are not nan", lambda c: NanLossDetector(c, min_loss_scale=1.0),
         _fp16_startup_overflows, None),
    # loss_spike: robust median + k sigma with a minimum relative jump.
    Case("loss x3 spike", lambda c: LossSpikeDetector(c), _loss_times(300, 3.0), 300,
         evidence={"window": 100}),
    Case("loss x1.5 spike", lambda c: LossSpikeDetector(c), _loss_times(400, 1.5), 400),
    Case("spike inside warm-up ignored", lambda c: LossSpikeDetector(c), _loss_times(10, 3.0), None),
    Case("noisy loss (5%) is not a spike", lambda c: LossSpikeDetector(c), None, None, n=3000, loss_noise=0.05),
    Case("small bumps (+8%) are not spikes", lambda c: LossSpikeDetector(c), _loss_times(700, 1.08, 10), None,
         n=1500),
    # loss_oscillation: big alternating swings vs the run's own baseline swing.
    Case("loss oscillates +-15%", lambda c: LossOscillationDetector(c), _oscillate(300, 80, 0.15), (305, 320)),
    Case("noisy loss is not oscillation", lambda c: LossOscillationDetector(c), None, None, n=3000,
         loss_noise=0.05),
    Case("one spike is not oscillation", lambda c: LossOscillationDetector(c), _loss_times(300, 3.0), None),
    # memory_spike: vs baseline and vs device capacity, names the rank.
    Case("memory doubles on rank 5", lambda c: MemorySpikeDetector(c), _mem(250, 2.0), 250,
         evidence={"rank": 5}),
    Case("memory near device capacity", lambda c: MemorySpikeDetector(c), _mem_set(30, 77.0), 30,
         cfg={"device_memory_gib": 80.0}, evidence={"rank": 2, "capacity_gib": 80.0}),
    Case("memory +10% is not a spike", lambda c: MemorySpikeDetector(c), _mem(250, 1.10, 50), None),
    Case("tiny CPU memory wiggles", lambda c: MemorySpikeDetector(c), _tiny_mem, None),
    # overflow_storm: skipped-step rate, startup skips are healthy.
    Case("skips within the startup steps", lambda c: OverflowStormDetector(c), _skips(1, 60, 1), None, n=400),
    # Every other step skipped from 200: the 21st skip in the window (step 240) passes the 20 % rate.
    Case("50% skipped steps after startup", lambda c: OverflowStormDetector(c), _skips(200, 250, 2), 240,
         evidence={"skipped": 21, "window": 100}),
    Case("fp16 startup overflows are healthy", lambda c: OverflowStormDetector(c), _fp16_startup_overflows, None),
    Case("rare overflows are healthy", lambda c: OverflowStormDetector(c), _rare_skips, None, n=3000),
    # slow_step: consecutive steps over ratio x rolling median.
    Case("steps 3x slower", lambda c: SlowStepDetector(c), _slow(250, 30, 3.0), 252,
         evidence={"consecutive": 3}),
    Case("isolated slow steps are normal", lambda c: SlowStepDetector(c), _single_slow_steps, None, n=2000),
    Case("1.5x slower is under the 2x ratio", lambda c: SlowStepDetector(c), _slow(250, 100, 1.5), None),
    # straggler: one rank persistently slowest with a large spread.
    Case("rank 3 straggles 1.6x", lambda c: StragglerDetector(c), _straggle(250, 60, 1.6), 259,
         evidence={"slowest_rank": 3}),
    Case("brief lags of random ranks", lambda c: StragglerDetector(c), _spread_hiccups, None, n=2000),
    Case("same rank slightly slow (1.1x) is fine", lambda c: StragglerDetector(c), _straggle(250, 200, 1.1), None),
    # throughput_drop: sustained drop vs baseline.
    Case("tokens/s -40% sustained", lambda c: ThroughputDropDetector(c), _tps(250, 100, 0.6), 269,
         evidence={"consecutive": 20}),
    Case("short dips are not a drop", lambda c: ThroughputDropDetector(c), _tps_dips, None, n=2000),
    Case("-15% is under the 25% threshold", lambda c: ThroughputDropDetector(c), _tps(250, 200, 0.85), None),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_detector_table(case: Case):
    cfg = DetectorsConfig(**case.cfg)
    det = case.make(cfg)
    found = run_detector(det, healthy(case.n, seed=7, loss_noise=case.loss_noise, mutate=case.mutate))
    if case.first_step is None:
        assert found == [], f"{case.name}: unexpected {[(f.step, f.message) for f in found]}"
        return
    assert found, f"{case.name}: nothing flagged"
    first = found[0]
    assert first.symptom == det.symptom and first.symptom in SYMPTOMS
    if isinstance(case.first_step, tuple):
        assert case.first_step[0] <= first.step <= case.first_step[1], (first.step, first.message)
    else:
        assert first.step == case.first_step, (first.step, first.message)
    for k, v in case.evidence.items():
        assert first.evidence[k] == v, (k, first.evidence)
    assert first.message.startswith(f"step {first.step}:") and first.message.endswith(".")


@pytest.mark.parametrize("seed", range(6))
def test_all_detectors_quiet_on_noisy_healthy_runs(seed):
    rng = random.Random(seed)
    noise = rng.uniform(0.01, 0.05)
    dets = build_detectors(DetectorsConfig(device_memory_gib=80.0))
    recs = healthy(4000, seed=seed, loss_noise=noise, time_noise=rng.uniform(0.01, 0.08))
    found = [f for d in dets for f in run_detector(d, recs)]
    assert found == [], [(f.symptom, f.step, f.message) for f in found]


def test_episode_refires_while_persisting_and_ends_after_clear_steps():
    det = SlowStepDetector(CFG)
    found = run_detector(det, healthy(500, seed=1, mutate=_slow(200, 120, 3.0)))
    steps = [f.step for f in found]
    assert steps == [202, 252, 302]  # onset, then every refire_steps (50) while it persists
    assert not det.active


def test_warmup_after_reset():
    det = LossSpikeDetector(CFG)
    run_detector(det, healthy(300, seed=2))
    det.reset()
    # Right after a restart the baseline is empty: a high loss during warm-up is not measured against it.
    assert run_detector(det, healthy(15, seed=3, start=301, mutate=_loss_times(305, 3.0))) == []


def test_slow_step_ignores_the_step_after_a_checkpoint():
    det = SlowStepDetector(DetectorsConfig(slow_step_min_consecutive=1))
    recs = healthy(300, seed=4)
    recs[200].step_time_max_s *= 5
    stream = recs[:200] + [EventRecord("checkpoint_saved", step=200)] + recs[200:]
    assert run_detector(det, stream) == []
    det.reset()
    assert [f.step for f in run_detector(det, recs)] == [201]  # without the event it is flagged


@pytest.mark.parametrize(("event", "passed_over"), [
    ("checkpoint_loaded", True),  # "checkpoint_" is a prefix: every checkpoint event
    ("control_applied", True),  # an exact name
    ("eval", False),  # the drift detector's, not the slow-step detector's
    ("control_applied_late", False),  # exact names are not prefixes
])
def test_slow_step_passes_over_the_step_after_exactly_its_skip_events(event, passed_over):
    det = SlowStepDetector(DetectorsConfig(slow_step_min_consecutive=1))
    recs = healthy(300, seed=4)
    recs[200].step_time_max_s *= 5
    found = run_detector(det, recs[:200] + [EventRecord(event, step=200)] + recs[200:])
    assert [f.step for f in found] == ([] if passed_over else [201])
