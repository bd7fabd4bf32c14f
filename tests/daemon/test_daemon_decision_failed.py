"""A decision the daemon cannot apply is recorded, never a skipped record (issue 39).

Before: the LR rung with lr == min_lr built a config the job refused; the exception was logged as "handling a
telemetry record failed; skipped", the run stayed REMEDIATING, no action was recorded, and the next decision
claimed the symptom "recurred within the verification window of lower_lr". Here a decision whose application
raises leaves: the incident's failed action (kind alert, `not_applied`, the error), the incident escalated, the
run RUNNING, and an engine that forgot the rung.
"""

from __future__ import annotations

from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup

from ulyssesd.daemon.store.enums import RunState
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision, LadderState


def test_a_decision_that_fails_to_apply_is_recorded_and_forgotten(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    assert sup.state == RunState.RUNNING

    def refuse(patch, reason):
        raise ValueError("train.min_lr=3e-05 is above train.lr=2.7e-05")
    sup.new_config_version = refuse
    eng = sup.engine
    f = Finding("loss_spike", 10, "critical", {"since_step": 9}, "step 10: loss far above its band", fos.time())
    sup.incidents.finding(f)
    st = eng.ladders.setdefault("loss", LadderState(position=2))   # the lower_lr rung
    d = Decision("lower_lr", "loss_spike", "hot", "learning rate 3e-05 -> 2.7e-05 because ...", "loss", 2, step=10,
                 config_patch={"train.lr": 2.7e-5}, previous={"train.lr": 3e-5}, hot_control={"lr_scale": 0.9})
    eng.values["train.lr"] = 2.7e-5
    st.last, st.verify_left, st.uses = d, 200, 1
    from ulyssesd.daemon.core.decisions import handle_outputs
    handle_outputs(sup, [d], 10)
    inc = sup.store.get_incident(sup.store.list_incidents(sup.run_id)[-1].id)
    acts = [a for a in inc.actions if a.parameters.get("not_applied")]
    assert acts and "min_lr" in acts[0].parameters["failed"] and acts[0].kind.value == "alert", inc.actions
    assert inc.status.value == "escalated"
    assert sup.state == RunState.RUNNING
    assert eng.values["train.lr"] == 3e-5 and st.last is None and st.verify_left == 0 and st.position == 3
    assert eng.failures and "lower_lr" in eng.failures[0]
