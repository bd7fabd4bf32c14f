"""A NaN read while an asynchronous save of an earlier step is still being written (found on the H100: a 17 GB
tag of step 100 takes longer to write than the 20 steps to the NaN at step 120). The snapshot holds step 100's
weights whatever the write's end time, and the job makes it durable before it exits: it is the rollback target,
not step 0; a save taken after the NaN stays tainted."""

from __future__ import annotations

from rem_helpers import run_nan_with_checkpoint_events

NAN_AT = 120


def _run(events_at: dict, n: int = 130):
    return run_nan_with_checkpoint_events(NAN_AT, events_at, n, seed=3, tag_fmt="step-{:08d}")


def _ev(name: str, step: int) -> tuple[str, int]:
    return name, step


def test_a_save_still_in_flight_at_the_nan_is_the_rollback_target():
    # Snapshot of step 100 taken at step 100; its write ends only at step 125, after the NaN at 120.
    eng, decs = _run({100: [_ev("checkpoint_saving", 100)], 125: [_ev("checkpoint_saved", 100)]})
    d = next(d for d in decs if d.symptom == "nan_loss")
    assert d.apply == "rollback_skip" and d.rollback_to_step == 100, d
    assert "step-00000100" not in eng.tainted  # saved after the NaN was read, but holds step 100's weights


def test_without_any_save_before_the_nan_the_run_is_not_silently_restarted_from_scratch_with_a_tag_in_flight():
    # The counter-case: the only save is of the NaN step itself (taken after the onset): never a target.
    eng, decs = _run({NAN_AT: [_ev("checkpoint_saving", NAN_AT)], 122: [_ev("checkpoint_saved", NAN_AT)]})
    d = next(d for d in decs if d.symptom == "nan_loss")
    assert d.rollback_to_step != NAN_AT
    assert "step-00000120" in eng.tainted
