"""A non-finite loss dates its onset exactly (the first NaN step): the rollback goes to the newest clean save
before it, not `rollback_steps_back` (~100, PaLM's margin for a smoothed spike onset) before it. Found by an
outside-in run: NaN at step 160 with clean saves at 60..140 rolled back to step 40 and set aside 120 steps of
good work. A smoothed finding (a loss spike without per-source evidence) keeps the margin."""

from __future__ import annotations

from rem_helpers import run_nan_with_checkpoint_events

from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.learned.engine_parts import exact_onset


def _run(nan_at: int, events_at: dict, n: int):
    return run_nan_with_checkpoint_events(nan_at, events_at, n, seed=5, tag_fmt="step_{:06d}.pt")


def _ev(name: str, step: int) -> tuple[str, int]:
    return name, step


def test_nan_rolls_back_to_the_newest_clean_save_before_it():
    saves = {s: [_ev("checkpoint_saved", s)] for s in range(20, 160, 20)}   # 20 .. 140, all clean
    _, decs = _run(160, saves, 165)
    d = next(d for d in decs if d.symptom == "nan_loss")
    assert d.apply == "rollback_skip" and d.rollback_to_step == 140, d


def test_a_save_of_the_nan_step_itself_is_never_the_target():
    saves = {s: [_ev("checkpoint_saved", s)] for s in range(20, 180, 20)}   # ... 140, then 160 (the NaN step)
    _, decs = _run(160, saves, 165)
    d = next(d for d in decs if d.symptom == "nan_loss")
    assert d.rollback_to_step == 140, d


def test_saves_seen_only_being_written_are_targets_for_a_nan_soon_after():
    # The command job's file watch tells `checkpoint_saving` at first sight; its `checkpoint_saved` (a second
    # look) comes after the NaN decision. The newest one before the NaN is the target, not "no checkpoint".
    saving = {s: [_ev("checkpoint_saving", s)] for s in (20, 40, 60, 80)}
    _, decs = _run(100, saving, 102)
    d = next(d for d in decs if d.symptom == "nan_loss")
    assert d.apply == "rollback_skip" and d.rollback_to_step == 80, d


def test_exact_onset_is_by_symptom_or_evidence_not_for_smoothed_findings():
    assert exact_onset(Finding("nan_loss", 10, "critical", {}, "", 0.0))
    assert exact_onset(Finding("loss_spike", 10, "severe", {"onset": "exact"}, "", 0.0))
    assert not exact_onset(Finding("loss_spike", 10, "severe", {"since_step": 9}, "", 0.0))


def test_a_smoothed_onset_keeps_the_rollback_margin():
    # The counter-case: without an exact onset the known-good tag at least rollback_steps_back before the
    # onset is chosen (a detector's onset may trail the true one).
    eng, _ = _run(10_000, {s: [_ev("checkpoint_saved", s)] for s in range(20, 180, 20)}, 200)
    plan = eng._rollback_plan(160)
    assert plan is not None and plan.to_step <= 160 - eng.policy.rollback_steps_back, plan
    exact = eng._rollback_plan(160, precise=True, exact=True)
    assert exact is not None and exact.to_step == 140, exact
