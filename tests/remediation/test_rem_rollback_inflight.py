"""A NaN read while an asynchronous save of an earlier step is still being written (found on the H100: a 17 GB
tag of step 100 takes longer to write than the 20 steps to the NaN at step 120). The snapshot holds step 100's
weights whatever the write's end time, and the job makes it durable before it exits: it is the rollback target,
not step 0; a save taken after the NaN stays tainted."""

from __future__ import annotations

from rem_helpers import healthy

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.records import EventRecord

NAN_AT = 120


def _nan_from(step, r):
    if step >= NAN_AT:
        r.loss = float("nan")


def _run(events_at: dict[int, list[EventRecord]], n: int = 130):
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(), None)
    items = []
    for r in healthy(n, seed=3, mutate=_nan_from):
        items.extend(eng.observe(r, r.time))
        for ev in events_at.get(r.step, []):
            items.extend(eng.observe(ev, r.time))
    return eng, [i for i in items if isinstance(i, Decision)]


def _ev(name: str, step: int) -> EventRecord:
    return EventRecord(name, step=step, fields={"tag": f"step-{step:08d}"})


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
