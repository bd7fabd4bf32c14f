"""Windows are in training steps, not records: the same config decides the same thing at the same step
whether the job logs every step, every 10 or every 100 (a record then stands for the steps since the last)."""

from __future__ import annotations

import pytest
from rem_helpers import healthy

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.records import EventRecord, StepRecord

ONSET = 3000
INTERVALS = (1, 10, 100)


def logged(recs: list[StepRecord], interval: int) -> list[StepRecord]:
    """Keep one record every `interval` steps (the logged step's own values, as DeepSpeed's steps_per_print)."""
    return [r for r in recs if r.step % interval == 0]


def first_logged_at_or_after(step: int, interval: int) -> int:
    return -(-step // interval) * interval


def run(recs, policy=None, job=None, ckpt_every=None):
    eng = RemediationEngine(DetectorsConfig(), policy or RemediationConfig(), job)
    items = []
    for r in recs:
        if ckpt_every and r.step % ckpt_every == 0:
            eng.observe(EventRecord("checkpoint_saved", step=r.step, fields={"tag": f"step-{r.step:08d}"}), r.time)
        items.extend(eng.observe(r, r.time))
    return eng, items


def decisions(items):
    return [i for i in items if isinstance(i, Decision)]


def _mild_jump(step, r):
    if ONSET <= step < ONSET + 600:
        r.loss *= 1.3   # above the band, below the severe line: the full grace applies


@pytest.mark.parametrize("interval", INTERVALS)
def test_persistent_mild_jump_acts_one_grace_window_after_onset_at_every_log_interval(interval):
    recs = logged(healthy(5000, seed=7, mutate=_mild_jump), interval)
    _, items = run(recs)
    d = decisions(items)[0]
    assert (d.symptom, d.action_kind) == ("loss_spike", "lower_clip")
    assert d.step == first_logged_at_or_after(ONSET + 20, interval)
    # With a grace that is a multiple of every interval, literally the same decision at the same step.
    _, items = run(logged(healthy(5000, seed=7, mutate=_mild_jump), interval), RemediationConfig(grace_steps=100))
    d = decisions(items)[0]
    assert (d.action_kind, d.step) == ("lower_clip", ONSET + 100)


@pytest.mark.parametrize("interval", INTERVALS)
def test_nan_acts_at_once_at_every_log_interval(interval):
    def nan_from(step, r):
        if step >= ONSET:
            r.loss = float("nan")
    # Checkpoints every 500 steps: a rollback target exists (without one, 3,000 steps in, the run stops
    # rather than start over from step 0).
    _, items = run(logged(healthy(4000, seed=8, mutate=nan_from), interval), ckpt_every=500)
    d = decisions(items)[0]
    assert (d.symptom, d.step, d.apply) == ("nan_loss", ONSET, "rollback_skip")


@pytest.mark.parametrize("interval", INTERVALS)
def test_healthy_curve_is_quiet_at_every_log_interval(interval):
    _, items = run(logged(healthy(8000, seed=9, loss_noise=0.03), interval), ckpt_every=500)
    assert items == []


@pytest.mark.parametrize("interval", INTERVALS)
def test_straggler_persistence_is_counted_in_steps(interval):
    def slow_rank(step, r):
        if step >= ONSET:
            r.step_time_max_s, r.slowest_rank = r.step_time_s * 1.6, 3
    _, items = run(logged(healthy(4000, seed=10, mutate=slow_rank), interval))
    found = [i for i in items if isinstance(i, Finding) and i.symptom == "straggler"]
    # 10 steps of the same slowest rank: step ONSET+9 when every step is logged; at interval 10 or 100 the
    # first slow record already stands for 10 or 100 steps.
    assert found[0].step == (ONSET + 9 if interval == 1 else ONSET)


@pytest.mark.parametrize("interval", (1, 10))
def test_known_good_and_verification_windows_are_in_steps(interval):
    recs = logged(healthy(2000, seed=11), interval)
    eng, _ = run([r for r in recs if r.step <= 1000], ckpt_every=1000)
    eng.checkpoint_saved("step-00001000", 1000)
    for r in recs:
        if 1000 < r.step < 1100:
            eng.observe(r, r.time)
    assert eng.known_good_tag is None          # 99 clean steps after the tag
    for r in recs:
        if 1100 <= r.step <= 1100 + interval - 1:
            eng.observe(r, r.time)
    assert eng.known_good_tag == ("step-00001000", 1000)


def test_a_record_that_repeats_its_step_counts_no_steps():
    recs = healthy(400, seed=12)
    eng, _ = run(recs[:300])
    eng.on_finding(Finding("loss_spike", 300, "warning", {"since_step": 300}, "spike"), 0.0)
    for _ in range(50):   # the same step logged again and again (a re-sent line) is not time passing
        out = eng.observe(recs[299], recs[299].time)
        assert not decisions(out)
    assert "loss" in eng.pending
