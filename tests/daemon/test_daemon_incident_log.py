"""The supervisor's incident log on a real SQLite store: recording, settling, verifying, re-adoption."""

from __future__ import annotations

import pytest

from ulyssesd.daemon.core.incident_log import IncidentLog, Position
from ulyssesd.daemon.core.relaunch import Relaunch
from ulyssesd.daemon.core.termination import UNREQUESTED, TerminationPlan, Then
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, RunState, Severity, Symptom
from ulyssesd.remediation.detectors import Finding


@pytest.fixture
def log_and_store(tmp_path):
    store = open_store(tmp_path / "u.db")
    store.create_run("r", run_dir=str(tmp_path / "r"), spec_path=None, spec={}, state=RunState.STARTING)
    where = {"step": 10}
    said: list[str] = []
    alerts: list[tuple[str, str]] = []
    log = IncidentLog(store, lambda: Position("r", 1, where["step"]),
                      alert=lambda event, text, **kw: alerts.append((event, text)), say=said.append)
    return log, store, where, said, alerts


def _status(store, iid):
    return store.get_incident(iid).status


def test_a_fix_is_verified_by_the_next_checkpoint_after_it_and_not_by_an_earlier_one(log_and_store):
    log, store, where, said, alerts = log_and_store
    iid = log.incident(Symptom.loss_spike, 10, Severity.warning, "loss 9.1 vs 3.0", {"loss": 9.1})
    log.action(iid, ActionKind.hot_control, {"rung": "clip"}, {}, ApplyMode.hot)
    assert log.counts == {"loss_spike": 1} and log.actions_by_kind == {"hot_control": 1}
    assert [e for e, _ in alerts] == ["incident", "action"] and said[0].startswith("INCIDENT #")
    log.verify(ckpt_step=10, grace_steps=5)  # the checkpoint at the fix's own step proves nothing
    assert iid in log.remedied
    log.verify(ckpt_step=20, grace_steps=5)
    assert iid not in log.remedied and _status(store, iid) == IncidentStatus.resolved
    act = store.list_actions(incident_id=iid)[0]
    assert act.outcome.value == "effective" and act.verified_at is not None


def test_unacted_findings_settle_only_once_outside_the_grace_window(log_and_store):
    log, store, where, _, _ = log_and_store
    early = log.finding(Finding("loss_spike", 5, "warning", message="spike"))
    late = log.finding(Finding("loss_spike", 18, "warning", message="spike"))
    log.verify(ckpt_step=20, grace_steps=5)  # settles findings before step 15
    assert _status(store, early) == IncidentStatus.resolved
    assert _status(store, late) == IncidentStatus.open and log.unacted == {"loss_spike": [(late, 18)]}
    assert log.take_unacted("loss_spike") == [(late, 18)] and log.unacted == {}


def test_fail_all_fails_what_waited_for_verification_and_pick_up_restores_it(log_and_store):
    log, store, where, _, _ = log_and_store
    fixed = log.incident(Symptom.nan_loss, 10, Severity.critical, "nan", {})
    log.action(fixed, ActionKind.rollback_skip, {}, {}, ApplyMode.restart)
    store.update_incident_status(fixed, IncidentStatus.remediating, "restarting")
    seen = log.finding(Finding("slow_step", 12, "warning", message="slow"))
    again = IncidentLog(store, lambda: Position("r", 1, 12), alert=lambda *a, **k: None, say=lambda m: None)
    again.pick_up("r")  # a new daemon: the same bookkeeping, read back from the store
    assert set(again.remedied) == {fixed} and again.unacted == {"slow_step": [(seen, 12)]}
    again.fail_all("budget spent")
    assert _status(store, fixed) == IncidentStatus.failed and again.remedied == {}
    assert _status(store, seen) == IncidentStatus.open  # a finding nothing acted on is not the fix's failure


def test_termination_plan_carries_a_relaunch_exactly_when_it_relaunches():
    r = Relaunch("hang", 3)
    assert TerminationPlan.relaunching(r).relaunch is r and str(TerminationPlan.relaunching(r)) == "relaunch (hang)"
    assert UNREQUESTED.then is Then.CRASH and UNREQUESTED.relaunch is None
    with pytest.raises(ValueError, match="needs Relaunch"):
        TerminationPlan(Then.RELAUNCH)
    with pytest.raises(ValueError, match="takes no Relaunch"):
        TerminationPlan(Then.STOP, r)
