"""A pending rollback in the checkpoint budget (training/checkpoint/rollback_guard.py): retention never deletes the
tag the decided rollback will load, whatever keep_last says, and a tag saved at or after the incident's onset is
never the newest valid one. Each rule with the bad case (no pending record: what the H100's r3 run did) and the
healthy one. Real directories and manifests; the free space through the `ck.bytes_free` seam."""

from __future__ import annotations

import json
import logging

from test_checkpoint_budget import TAG, SimDisk, cats, make_tag

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import budget as bd
from ulyssesd.training.checkpoint import rollback_guard as rg

KEEP_1 = bd.BudgetPolicy(keep_last=1, max_anchors=1, set_aside_keep=0)


def test_r3_keep_last_1_an_exit_save_after_the_nan_no_longer_dooms_the_rollback_target(tmp_path):
    make_tag(tmp_path, 100)   # the rollback target (saved before the NaN at 120)
    make_tag(tmp_path, 121)   # the SIGTERM exit save one step after the NaN
    # Without the record (the H100 run): step-121 is the newest valid, step-100 surplus, and retention deletes it.
    bad = bd.classify(tmp_path, KEEP_1)
    assert bad.newest_valid == "step-00000121" and [e.name for e in bad.doomed()] == ["step-00000100"]
    pending = rg.PendingRollback(onset_step=120, target_step=100, target_tag="step-00000100", incident=2)
    b = bd.classify(tmp_path, KEEP_1, pending=pending)
    assert cats(b) == {"rollback_target": ["step-00000100"], "tainted": ["step-00000121"]}
    assert b.newest_valid == "step-00000100" and b.rollback_target == "step-00000100" and b.doomed() == []
    assert bd.apply_retention(b) == [] and ck.list_tags(tmp_path) == ["step-00000100", "step-00000121"]
    counted = b.by_category()
    assert counted["rollback_target"] == {"count": 1, "bytes": b.by_name()["step-00000100"].bytes}
    assert counted["tainted"]["count"] == 1 and counted["newest_valid"]["count"] == 0


def test_a_target_older_than_the_window_is_kept_whatever_keep_last_says(tmp_path):
    for s in (100, 200):
        make_tag(tmp_path, s)
    # The engine chose step 100 (step 200 fell in the margin before a smoothed onset at 210).
    assert [e.name for e in bd.classify(tmp_path, KEEP_1).doomed()] == ["step-00000100"]
    pending = rg.PendingRollback(onset_step=210, target_step=100, target_tag="step-00000100")
    b = bd.classify(tmp_path, KEEP_1, pending=pending)
    assert cats(b)["rollback_target"] == ["step-00000100"] and cats(b)["newest_valid"] == ["step-00000200"]
    assert b.doomed() == [] and bd.apply_retention(b) == []


def test_the_target_is_what_the_relaunch_loads_even_when_the_named_tag_is_gone(tmp_path):
    for s in (50, 80, 130):
        make_tag(tmp_path, s)
    # The decision named step 100 (since quarantined): the relaunch loads the newest valid at or before 100.
    pending = rg.PendingRollback(onset_step=120, target_step=100, target_tag="step-00000100")
    b = bd.classify(tmp_path, bd.BudgetPolicy(keep_last=1, max_anchors=1), pending=pending)
    assert b.rollback_target == "step-00000080" and cats(b)["tainted"] == ["step-00000130"]
    assert b.newest_valid == "step-00000080"   # counted under rollback_target, protected as the newest valid too
    assert [e.name for e in b.doomed()] == ["step-00000050"]   # an older surplus tag still goes


def test_making_room_never_takes_a_tainted_tag_nor_the_target(tmp_path):
    """Tags after a pending rollback's onset are set aside by the relaunch (evidence), never deleted to make room:
    deleting them could delete the directory's newest valid tag (simulator seeds 11 and 21)."""
    for s in (100, 121, 130):
        make_tag(tmp_path, s)
    pending = rg.PendingRollback(onset_step=120, target_step=100)
    b = bd.classify(tmp_path, KEEP_1, pending=pending)
    assert bd.room_order(b, include_in_flight=True) == []                  # neither the target nor a tainted tag
    room = bd.make_room(b, need_bytes=10 * TAG, available=lambda freed: freed)   # can never fit: nothing goes
    assert room.removed == [] and ck.list_tags(tmp_path) == ["step-00000100", "step-00000121", "step-00000130"]


def test_the_jobs_own_room_making_reads_the_pending_record(tmp_path, monkeypatch):
    ckpt, run = tmp_path / "ck", tmp_path / "run"
    ckpt.mkdir()
    run.mkdir()
    for s in (100, 121):
        make_tag(ckpt, s)
    bd.write_budget_file(run, KEEP_1, [])
    rg.write_pending(run, rg.PendingRollback(onset_step=120, target_step=100))
    disk = SimDisk(ckpt, capacity=0)
    disk.capacity = TAG // 2 - disk()   # what the two tags hold + half a tag: no room for a third
    monkeypatch.setattr(ck, "bytes_free", disk)
    skip = bd.room_for_save(ckpt, run, "step-00000130", 1, under_daemon=True, log=logging.getLogger("t"),
                            daemon_pass_wait_s=0)
    assert skip is not None                                                # no room: the save waits, a skip
    assert ck.list_tags(ckpt) == ["step-00000100", "step-00000121"]         # nothing deleted
    # Healthy counter-case: no pending rollback, the newest valid tag is kept and the older one goes.
    rg.clear_pending(run)
    make_tag(ckpt, 140)
    skip = bd.room_for_save(ckpt, run, "step-00000150", 1, under_daemon=True, log=logging.getLogger("t"),
                            daemon_pass_wait_s=0)
    assert skip is None and ck.list_tags(ckpt) == ["step-00000140"]


def test_the_record_round_trips_and_an_unreadable_one_is_said(tmp_path, caplog):
    assert rg.read_pending(tmp_path) is None
    p = rg.PendingRollback(onset_step=120, target_step=100, target_tag="step-00000100", incident=7)
    rg.write_pending(tmp_path, p)
    assert rg.read_pending(tmp_path) == p
    assert json.loads((tmp_path / rg.PENDING_FILE).read_text())["onset_step"] == 120
    (tmp_path / rg.PENDING_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert rg.read_pending(tmp_path) is None
    assert "unreadable" in caplog.text
    rg.clear_pending(tmp_path)
    rg.clear_pending(tmp_path)   # twice: a missing record is fine
    assert not (tmp_path / rg.PENDING_FILE).exists()


def test_a_target_at_or_after_the_onset_is_refused():
    import pytest

    with pytest.raises(ValueError, match="not before the onset"):
        rg.PendingRollback(onset_step=100, target_step=100)
