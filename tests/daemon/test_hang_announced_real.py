"""Hang detection with the calibrated defaults on a real job process (issue 33, item 5): saves and evaluations
longer than the training timeout, announced by the job, are not a hang; a real hang after them is, at the training
timeout. Only the floor is lowered (5 s instead of 20, to keep the test short); every other hang setting is the
default. Asserts what the store recorded, not how fast the box was."""

from __future__ import annotations

import pytest
from uls_daemon_helpers import HERE, fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState

pytestmark = pytest.mark.slow
DONE = (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


def test_long_announced_saves_and_evaluations_pass_and_a_hang_after_them_is_caught(tmp_path, make_sup):
    env = {"PYTHONPATH": str(HERE), "FAKEJOB_STEP_S": "0.05", "FAKEJOB_SAVE_S": "7",
           "FAKEJOB_EVAL_AT": "30,50", "FAKEJOB_EVAL_S": "7"}
    ev: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=60, interval=20, launcher={"env": env},
                             detectors={"hang_timeout_floor_s": 5.0},
                             faults=[{"kind": "hang", "at_step": 55}]), ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=300)
    assert sup.state == RunState.COMPLETED, ev
    hangs = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    # Saves at 20 and 40 (7 s each: the first of its kind gets the ceiling, the second 5 + 2 x 7 s) and
    # evaluations at 30 and 50 (the same) passed; the one hang is the real one, after step 54, in training.
    assert [h.step for h in hangs] == [54], [(h.step, h.summary) for h in hangs]
    assert "(training)" in hangs[0].summary and "over the 5 s timeout" in hangs[0].summary, hangs[0].summary
    att = sup.store.list_attempts(sup.run_id)
    assert len(att) == 2 and att[1].resumed_from == "step-00000040"
