"""A decided rollback until its relaunch (issue 38's r3 on the H100): the daemon records it before the SIGTERM, its
retention keeps the target whatever keep_last says, the relaunch never resumes from a tag saved at or after the
onset, and when the target is gone it falls back only to a valid tag before the onset, else stops loudly (never
step 0, never a poisoned tag). Fake OS and clock, real files, manifests and SQLite."""

from __future__ import annotations

import json

from test_daemon_unit_fakeos import FakeOS, _emit, _make_tag, _steps, _sup

from ulyssesd.daemon.core.launch import checkpoint_for
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import rollback_guard as rg

S = RunState


def _names(sup) -> list[str]:
    return sorted(p.name for p in sup.ckpt_dir.iterdir())


def test_target_pruned_falls_back_to_a_valid_tag_before_the_onset(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (10, 15):
        _make_tag(sup.ckpt_dir, s)
    rg.write_pending(sup.run_dir, rg.PendingRollback(onset_step=12, target_step=7))
    tag, notes = checkpoint_for(sup, rollback_to_step=7)
    assert tag == "step-00000010"                     # the legitimate case the fallback was written for
    assert "before the onset at step 12" in notes[0]
    assert any(n.startswith("step-00000015.rolledback-") for n in _names(sup))


def test_target_gone_and_only_tags_after_the_onset_is_never_a_resume_from_them(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (16, 20):   # the r3 shape: the target (step 10) was deleted, the tags left were saved after the NaN
        _make_tag(sup.ckpt_dir, s)
    rg.write_pending(sup.run_dir, rg.PendingRollback(onset_step=15, target_step=10, target_tag="step-00000010"))
    tag, notes = checkpoint_for(sup, rollback_to_step=10)
    assert tag == "none" and "none between it and the onset at step 15" in notes[-1]
    assert ck.list_tags(sup.ckpt_dir) == []           # set aside (renamed, kept as evidence), never chosen
    assert sum(".rolledback-" in n for n in _names(sup)) == 2


def test_without_a_recorded_onset_no_later_tag_is_taken(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (10, 15):
        _make_tag(sup.ckpt_dir, s)
    tag, notes = checkpoint_for(sup, rollback_to_step=7)   # unknown onset: loud, not the old "oldest after it"
    assert tag == "none" and "onset is not recorded" in notes[0]


def test_a_plain_restart_with_a_pending_rollback_never_resumes_a_tainted_tag(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (10, 16):
        _make_tag(sup.ckpt_dir, s)
    rg.write_pending(sup.run_dir, rg.PendingRollback(onset_step=15, target_step=10))
    assert checkpoint_for(sup, rollback_to_step=None)[0] == "step-00000010"
    # The healthy counter-case: no pending rollback, the newest valid tag is the resume point.
    rg.clear_pending(sup.run_dir)
    _make_tag(sup.ckpt_dir, 20)
    assert checkpoint_for(sup, rollback_to_step=None)[0] == "step-00000020"


def _nan_run(tmp_path, fos, keep_last=1):
    spec = dict(daemon={"stop_grace_s": 30.0, "min_free_gib": 0}, detectors={"warmup_steps": 2},
                remediation={"known_good_steps": 100000})
    sup = _sup(tmp_path, fos, **spec)
    sup.start()
    sup.new_config_version({"checkpoint.keep_last": keep_last}, "test: keep_last")
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    _make_tag(sup.ckpt_dir, 10)
    _emit(sup, kind="event", event="checkpoint_saved", step=10, tag="step-00000010", seconds=0.1, bytes=64)
    _steps(sup, 11, 14)
    fos.advance(0.5)
    _emit(sup, kind="step", step=15, loss="nan", step_time_s=0.5, samples=[14, 15])
    sup.tick()
    return sup


def test_the_daemon_records_the_rollback_before_its_sigterm_and_its_retention_keeps_the_target(tmp_path):
    fos = FakeOS()
    sup = _nan_run(tmp_path, fos)
    assert sup.state == S.RESTARTING
    pending = rg.read_pending(sup.run_dir)
    assert pending == rg.PendingRollback(onset_step=15, target_step=10, target_tag="step-00000010",
                                         incident=pending.incident)
    assert json.loads((sup.run_dir / "control.json").read_text())["suspect"] is True
    act = next(a for a in sup.store.list_actions(run_id=sup.run_id) if a.kind.value == "rollback_skip")
    assert act.parameters["rollback_onset_step"] == 15 and act.parameters["rollback_to_step"] == 10
    # The job, SIGTERMed, writes an exit save anyway (an older job, or a command): keep_last 1 must not delete
    # the pending target on this checkpoint_saved, and the relaunch must not resume from the exit save.
    fos.advance(0.5)
    _emit(sup, kind="step", step=16, loss=2.9, step_time_s=0.5, samples=[15, 16])
    _make_tag(sup.ckpt_dir, 16)
    _emit(sup, kind="event", event="checkpoint_saved", step=16, tag="step-00000016", seconds=0.1, bytes=64)
    sup.tick()
    assert "step-00000010" in ck.list_tags(sup.ckpt_dir)
    job1 = sup.job
    fos.die(job1.pid, __import__("ulyssesd.daemon.host.process", fromlist=["ExitStatus"]).ExitStatus(0, None, "file"))
    for _ in range(80):
        if sup.attempt == 2:
            break
        fos.advance(0.5)
        sup.tick()
    att2 = sup.store.list_attempts(sup.run_id)[1]
    assert att2.resumed_from == "step-00000010"
    assert any(n.startswith("step-00000016.rolledback-") for n in _names(sup))
    assert rg.read_pending(sup.run_dir) is None        # done once the relaunch chose its tag
    incidents = [i.summary for i in sup.store.list_incidents(sup.run_id)]
    assert not [s for s in incidents if "fallback" in s], incidents


def test_a_rollback_whose_target_was_lost_stops_loudly_with_what_was_tried(tmp_path):
    from ulyssesd.daemon.host.process import ExitStatus

    fos = FakeOS()
    sup = _nan_run(tmp_path, fos)
    ck.retention.remove_dir(sup.ckpt_dir / "step-00000010")   # lost by hand (or a bug): nothing before the onset
    _make_tag(sup.ckpt_dir, 16)
    fos.die(sup.job.pid, ExitStatus(0, None, "file"))
    for _ in range(80):
        if sup.state in (S.FAILED, S.STARTING, S.RUNNING):
            break
        fos.advance(0.5)
        sup.tick()
    assert sup.state == S.FAILED and len(sup.store.list_attempts(sup.run_id)) == 1
    inc = next(sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id)
               if i.symptom.value == "checkpoint_corrupt")
    assert inc.severity.value == "critical" and "nor from step 0" in inc.summary
    assert any("onset at step 15" in t for t in inc.evidence["tried"])
    assert [a.kind.value for a in inc.actions] == ["stop"]
    assert ck.list_tags(sup.ckpt_dir) == [] and any(".rolledback-" in n for n in _names(sup))   # kept, not deleted
