"""A save written after a rollback was decided, at or after the incident's onset, is tainted by its step (issue 38's
r3 on the H100): the job's SIGTERM exit save `step-00000121` one step after a NaN at 120 had a finite loss of its
own, the NaN episode had ended, and the step-based taint of cb4efa3 (a weight symptom active, or a non-finite
last loss) let it through: it became the newest clean save. The decision carries its onset for the daemon
(rollback_pending.json, daemon/core/launch.py)."""

from __future__ import annotations

from rem_helpers import healthy

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.records import EventRecord

NAN_AT = 120


def _saved(eng, step, t, items, kind="checkpoint_saved"):
    items.extend(eng.observe(EventRecord(kind, step=step, fields={"tag": f"step-{step:08d}"}), t))


def _attempt(eng, first: int, last: int, items: list, saves=(), nan_at=None, attempt=1, seed=3) -> float:
    """Steps first..last of one attempt (a NaN at `nan_at` only), the saves after their step's record."""
    t = 0.0
    for r in healthy(last - first + 1, seed=seed, start=first, t0=1000.0 + 100 * attempt):
        r.attempt = attempt
        if r.step == nan_at:
            r.loss, r.grad_norm = float("nan"), float("inf")
        items.extend(eng.observe(r, r.time))
        t = r.time
        if r.step in saves:
            _saved(eng, r.step, t, items)
    return t


def test_the_exit_save_one_step_after_the_nan_is_tainted_and_never_a_target():
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(), None)
    items: list = []
    eng.on_restart(0.0, attempt=1)
    t = _attempt(eng, 1, 100, items, saves=(50, 100))
    # Attempt 2 resumed from step 100 (a rollback before): the NaN at 120 again; SIGTERM lands during step 121.
    eng.on_restart(t, attempt=2, resumed=("step-00000100", 100))
    _attempt(eng, 101, 121, items, nan_at=NAN_AT, attempt=2, saves=(121,))
    d = next(i for i in items if isinstance(i, Decision) and i.symptom == "nan_loss")
    assert d.apply == "rollback_skip" and d.rollback_to_step == 100 and d.rollback_onset == NAN_AT
    assert "step-00000121" in eng.tainted            # the bad case: finite loss at 121, saved after the decision
    assert "step-00000100" not in eng.tainted
    # The next plan (the same NaN on the next attempt) still goes to step 100, never to the exit save.
    plan = eng._rollback_plan(NAN_AT, precise=True, exact=True)
    assert plan is not None and plan.tag == "step-00000100" and plan.onset == NAN_AT


def test_the_next_attempts_saves_past_the_old_onset_are_its_own_and_clean():
    # The healthy counter-case: once the rollback relaunched from step 100, step 120+ is a new trajectory.
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(), None)
    items: list = []
    eng.on_restart(0.0, attempt=1)
    t = _attempt(eng, 1, 125, items, saves=(100,), nan_at=NAN_AT)
    assert any(isinstance(i, Decision) and i.rollback_onset == NAN_AT for i in items)
    eng.on_restart(t, attempt=2, resumed=("step-00000100", 100))
    _attempt(eng, 101, 200, items, attempt=2, saves=(150, 200), seed=4)
    assert {"step-00000150", "step-00000200"}.isdisjoint(eng.tainted), eng.tainted


def test_a_decision_that_was_never_carried_out_expires():
    # Observe mode (nothing restarts): a save in the decision's own attempt long after its await window is not
    # tainted by the decision (the weight-symptom rule still judges it).
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(mode="observe", verify_steps=20), None)
    items: list = []
    eng.on_restart(0.0, attempt=1)
    _attempt(eng, 1, 300, items, saves=(100, 125, 300), nan_at=NAN_AT)
    d = next(i for i in items if isinstance(i, Decision) and i.symptom == "nan_loss")
    assert d.would_apply == "rollback_skip" and d.rollback_onset == NAN_AT
    assert "step-00000125" in eng.tainted and "step-00000300" not in eng.tainted
