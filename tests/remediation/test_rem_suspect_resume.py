"""A checkpoint whose own step printed a finite loss can still hold NaN weights (the update of that step
poisoned them; the first NaN printed is the next step's). Resuming it gives a NaN within a step or two, every
time: the engine then holds the resumed checkpoint suspect and rolls back to the save before it, never to the
same one again ("a restart that changes nothing"). Found by an outside-in run: four identical rollbacks to
ckpt_00040, each NaN at step 41, run FAILED with the clean ckpt_00030 never tried.

Also: a rollback's data skip is claimed only where it reaches the job (a command job gets none)."""

from __future__ import annotations

from rem_helpers import healthy

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.job import K_SKIP, JobReach
from ulyssesd.remediation.records import EventRecord

TAG = "ckpt_{:05d}.pt"


def _feed(eng, first: int, last: int, nan_at: int, t0: float, saves=()) -> list[Decision]:
    def nan_from(step, r):
        if step >= nan_at:
            r.loss = float("nan")

    out = []
    for r in healthy(last - first + 1, seed=7, start=first, t0=t0, mutate=nan_from):
        out.extend(eng.observe(r, r.time))
        if r.step in saves:
            out.extend(eng.observe(EventRecord("checkpoint_saved", step=r.step, fields={"tag": TAG.format(r.step)}),
                                   r.time))
    return [d for d in out if isinstance(d, Decision)]


def _first_rollback(reach: JobReach | None = None) -> tuple[RemediationEngine, Decision]:
    kw = {"reach": reach} if reach is not None else {}
    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(), None, attempt=1, **kw)
    decs = _feed(eng, 1, 45, nan_at=41, t0=1000.0, saves=range(10, 41, 10))
    d = next(d for d in decs if d.symptom == "nan_loss")
    assert d.apply == "rollback_skip" and d.rollback_to_step == 40 and d.rollback_tag == TAG.format(40), d
    return eng, d


def _after_resume(eng: RemediationEngine, nan_at: int) -> Decision:
    eng.on_restart(5000.0, attempt=2, resumed=(TAG.format(40), 40))
    eng.observe(EventRecord("started", step=None, attempt=2), 5000.0)   # the job's own `started`: same attempt
    decs = _feed(eng, 41, nan_at + 4, nan_at=nan_at, t0=5001.0)
    return next(d for d in decs if d.symptom == "nan_loss")


def test_a_nan_right_after_resuming_a_save_rolls_back_past_it():
    eng, _ = _first_rollback()
    d = _after_resume(eng, nan_at=41)
    assert d.apply == "rollback_skip" and d.rollback_to_step == 30 and d.rollback_tag == TAG.format(30), d
    assert f"{TAG.format(40)} is suspect" in d.reason and "suspect_resume_steps" in d.reason, d.reason
    assert TAG.format(40) in eng.tainted


def test_a_nan_well_after_the_resume_keeps_the_resumed_save_as_target():
    # The counter-case: NaN 10 steps after resuming (beyond suspect_resume_steps=3): the resumed save trained
    # fine for 10 steps, so it is not suspect; the newest clean save before the onset (40) stays the target.
    eng, _ = _first_rollback()
    d = _after_resume(eng, nan_at=51)
    assert d.rollback_to_step == 40 and "suspect" not in d.reason, d.reason
    assert TAG.format(40) not in eng.tainted


def test_without_a_known_resume_point_nothing_is_held_suspect():
    eng, _ = _first_rollback()
    eng.on_restart(5000.0, attempt=2)   # a replay, or a launch that resumed nothing the daemon could name
    d = next(d for d in _feed(eng, 41, 45, nan_at=41, t0=5001.0) if d.symptom == "nan_loss")
    assert d.rollback_to_step == 40, d


def test_a_rollback_claims_its_data_skip_only_where_it_reaches_the_job():
    _, builtin = _first_rollback()
    assert K_SKIP in builtin.config_patch and "skip the batches" in builtin.reason
    cmd = JobReach(config_keys=frozenset({"launcher.env."}),
                   why_limited="a command job without [job] ds_config: only launcher env reaches it")
    _, d = _first_rollback(cmd)
    assert K_SKIP not in d.config_patch and d.skip_ranges == [], (d.config_patch, d.skip_ranges)
    assert "skip the batches" not in d.reason and f"{K_SKIP} does not reach the job" in d.reason, d.reason
    assert d.rollback_to_step == 40   # the rollback itself still applies
