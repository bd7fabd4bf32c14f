"""The checkpoint directory's budget (training/checkpoint/budget.py) on real directories: categories and bytes,
anchors bounded and spaced, set-aside caps, the order room is made in, and a real small filesystem (tmpfs)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import budget as bd

TAG = 4096  # bytes of state per tag in these tests


def make_tag(root: Path, step: int, nbytes: int = TAG, valid: bool = True) -> str:
    d = root / ck.tag_for_step(step)
    d.mkdir(parents=True)
    (d / "state.bin").write_bytes(bytes([step % 256]) * nbytes)
    if valid:
        ck.write_manifest(d, step, 1.0, step, 1)
    return d.name


def set_aside(root: Path, step: int, kind: str, when: int, nbytes: int = TAG) -> str:
    name = f"{ck.tag_for_step(step)}.{kind}-{when}"
    (root / name).mkdir(parents=True)
    (root / name / "state.bin").write_bytes(b"x" * nbytes)
    return name


class SimDisk:
    """A filesystem of `capacity` bytes holding only the checkpoint directory: free = capacity - its bytes."""

    def __init__(self, root: Path, capacity: int):
        self.root, self.capacity = root, capacity

    def __call__(self, _path=None) -> int:
        return self.capacity - sum(bd.tree_bytes(p) if p.is_dir() else p.stat().st_size for p in self.root.iterdir())


def cats(b: bd.DirBudget) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in sorted(b.entries, key=lambda e: e.name):
        out.setdefault(e.category, []).append(e.name)
    return out


def test_every_entry_has_a_category_and_the_bytes_add_up(tmp_path):
    for s in (10, 20, 30, 40, 50, 60):
        make_tag(tmp_path, s)
    make_tag(tmp_path, 70, valid=False)                     # the save in flight (no manifest yet)
    make_tag(tmp_path, 35, valid=False)                     # a partial older than the newest valid
    now = int(time.time())
    rb = set_aside(tmp_path, 80, "rolledback", now + 10)   # the newest set-aside copy (kept: the cap is one)
    cor = set_aside(tmp_path, 5, "corrupt", now - 1000)
    (tmp_path / "latest").write_text("step-00000060")
    b = bd.classify(tmp_path, bd.BudgetPolicy(keep_last=2, max_anchors=2), known_good=["step-00000010",
                                                                                       "step-00000030"])
    assert cats(b) == {
        "newest_valid": ["step-00000060"], "keep_last": ["step-00000050"],
        "anchor": ["step-00000010", "step-00000030"], "surplus": ["step-00000020", "step-00000040"],
        "in_flight": ["step-00000070"], "set_aside": sorted(["step-00000035", cor, rb]), "other": ["latest"]}
    by = b.by_category()
    assert sum(c["bytes"] for c in by.values()) == b.total_bytes == sum(
        bd.tree_bytes(p) if p.is_dir() else p.stat().st_size for p in tmp_path.iterdir())
    assert b.newest_valid == "step-00000060" and b.newest_known_good == "step-00000030"
    assert b.tag_bytes == bd.tree_bytes(tmp_path / "step-00000060")
    # Set-aside: the newest one (the rollback) is kept, the older two are over the cap of one.
    assert sorted(e.name for e in b.doomed()) == sorted(["step-00000020", "step-00000040", cor, "step-00000035"])


def test_anchors_are_bounded_in_number_and_spaced_in_steps():
    assert bd.select_anchors(range(0, 1001, 10), max_anchors=3, spacing=0) == [1000, 990, 980]
    assert bd.select_anchors(range(0, 1001, 10), max_anchors=3, spacing=250) == [1000, 750, 500]
    assert bd.select_anchors([5], max_anchors=3, spacing=100) == [5]
    assert bd.select_anchors([], max_anchors=3, spacing=100) == []


def test_many_known_good_tags_leave_only_the_bounded_anchors(tmp_path):
    steps = list(range(10, 310, 10))                     # 30 tags, every one known good (issue 32's 300 tags)
    for s in steps:
        make_tag(tmp_path, s)
    policy = bd.BudgetPolicy(keep_last=3, max_anchors=2, anchor_spacing_steps=100)
    b = bd.classify(tmp_path, policy, known_good=[ck.tag_for_step(s) for s in steps])
    removed = [e.name for e in bd.apply_retention(b)]
    left = ck.list_tags(tmp_path)
    # window 280..300; anchors: the newest known-good (300, in the window) and one >= 100 steps below it
    assert left == ["step-00000200", "step-00000280", "step-00000290", "step-00000300"], left
    assert len(removed) == 26
    again = bd.classify(tmp_path, policy, known_good=[ck.tag_for_step(s) for s in steps])
    assert again.doomed() == []  # retention is a fixed point


def test_room_is_made_in_the_stated_order_and_never_takes_newest_valid_or_known_good(tmp_path):
    for s in (10, 20, 30, 40, 50):
        make_tag(tmp_path, s)
    old_rb = set_aside(tmp_path, 60, "rolledback", 100)
    new_cor = set_aside(tmp_path, 45, "corrupt", 200)
    partial = make_tag(tmp_path, 60, valid=False)
    b = bd.classify(tmp_path, bd.BudgetPolicy(keep_last=3, max_anchors=2, set_aside_keep=5,
                                              set_aside_max_bytes=1 << 30),
                    known_good=["step-00000010", "step-00000020"])
    order = [e.name for e in bd.room_order(b, include_in_flight=True)]
    assert order == [partial, old_rb, new_cor, "step-00000010", "step-00000030", "step-00000040"]
    assert [e.name for e in bd.room_order(b, include_in_flight=False)][0] == old_rb  # a live save is not touched
    # A disk that holds everything left plus one tag: each removal frees one tag's worth.
    disk = SimDisk(tmp_path, capacity=b.total_bytes + TAG)
    room = bd.make_room(b, need_bytes=4 * TAG, include_in_flight=True, available=lambda _f: disk())
    assert room.fits and room.removed == [partial, old_rb, new_cor]
    # Ask for more than can ever be freed: everything but the newest valid and newest known-good goes.
    b = bd.classify(tmp_path, b.policy, known_good=["step-00000010", "step-00000020"])
    room = bd.make_room(b, need_bytes=100 * TAG, include_in_flight=True, available=lambda _f: disk())
    assert not room.fits
    assert ck.list_tags(tmp_path) == ["step-00000020", "step-00000050"]
    assert (room.newest_valid, room.newest_known_good) == ("step-00000050", "step-00000020")


def test_tags_that_fit_and_the_policy_checks():
    assert bd.tags_that_fit(available_bytes=10 * TAG, kept_tag_bytes=2 * TAG, tag_bytes=TAG) == 12
    assert bd.tags_that_fit(available_bytes=TAG, kept_tag_bytes=TAG, tag_bytes=TAG, margin_bytes=TAG) == 1
    assert bd.tags_that_fit(available_bytes=TAG, kept_tag_bytes=0, tag_bytes=0) is None
    with pytest.raises(ValueError, match="keep_last=0"):
        bd.BudgetPolicy(keep_last=0)
    with pytest.raises(ValueError, match="max_anchors=0"):
        bd.BudgetPolicy(max_anchors=0)
    p = bd.BudgetPolicy(keep_last=3, max_anchors=2, set_aside_keep=1, margin_bytes=7)
    assert p.tag_slots == 6 and p.budget_bytes(100) == 6 * 100 + 100 + 7


def test_the_published_budget_round_trips_and_a_damaged_file_reads_as_none(tmp_path):
    policy = bd.BudgetPolicy(keep_last=2, max_anchors=1, margin_bytes=5)
    bd.write_budget_file(tmp_path, policy, ["step-00000010"], predicted_tag_bytes=123)
    assert bd.read_budget_file(tmp_path) == (policy, ["step-00000010"], 123)
    (tmp_path / bd.BUDGET_FILE).write_text("{not json")
    assert bd.read_budget_file(tmp_path) is None


# ----------------------------------------------------------------------- a real small filesystem
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:100]}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_on_a_real_4_mib_filesystem_room_is_made_until_the_next_tag_fits(tmp_path):
    with tmpfs(tmp_path / "disk", "4m") as root:
        tag = 512 << 10
        for s in (10, 20, 30, 40, 50):
            make_tag(root, s, nbytes=tag)
        set_aside(root, 60, "rolledback", 100, nbytes=tag)
        free = ck.bytes_free(root)
        assert free is not None and free < 2 * tag  # 6 x 512 KiB on 4 MiB: room for one more at most
        b = bd.classify(root, bd.BudgetPolicy(keep_last=5, max_anchors=1, set_aside_keep=5,
                                              set_aside_max_bytes=1 << 30), known_good=["step-00000010"])
        room = bd.make_room(b, need_bytes=3 * tag)
        assert room.fits and ck.bytes_free(root) >= 3 * tag
        assert room.removed == ["step-00000060.rolledback-100", "step-00000020"]  # set-aside, then the window
        assert ck.list_tags(root) == ["step-00000010", "step-00000030", "step-00000040", "step-00000050"]
        make_tag(root, 60, nbytes=tag)  # and the next save really fits
        assert ck.validate_tag(root / "step-00000060")[0]


def test_a_tag_a_process_still_maps_is_left_alone_removing_it_would_free_nothing(tmp_path):
    import mmap

    for s in (10, 20, 30):
        make_tag(tmp_path, s)
    with open(tmp_path / "step-00000010" / "state.bin", "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # as torch.load(mmap=True) leaves it
    try:
        assert bd.held_entries(tmp_path) == {"step-00000010"}
        b = bd.classify(tmp_path, bd.BudgetPolicy(keep_last=3))
        disk = SimDisk(tmp_path, capacity=b.total_bytes)  # full: one tag must go
        room = bd.make_room(b, need_bytes=TAG, available=lambda _f: disk())
        assert room.fits and room.removed == ["step-00000020"] and room.skipped_held == ["step-00000010"]
    finally:
        mapped.close()
    assert bd.held_entries(tmp_path) == set()


# ------------------------------------------------- the job's check before every save (issue 38, outside-in)
def test_nothing_is_removed_for_a_save_that_could_not_fit_even_with_everything_gone(tmp_path):
    for s in (10, 20, 30):
        make_tag(tmp_path, s)
    old = set_aside(tmp_path, 5, "corrupt", 100)
    b = bd.classify(tmp_path, bd.BudgetPolicy(keep_last=3, set_aside_keep=5))
    disk = SimDisk(tmp_path, capacity=b.total_bytes + TAG // 2)
    # 3 removable entries (the set-aside copy, steps 10 and 20) + half a tag free < 5 tags: nothing goes
    room = bd.make_room(b, need_bytes=5 * TAG, include_in_flight=True, available=lambda _f: disk(),
                        only_if_it_fits=True)
    assert not room.fits and room.removed == [] and room.reachable_bytes is not None
    assert room.reachable_bytes < 5 * TAG
    assert sorted(p.name for p in tmp_path.iterdir()) == [old, "step-00000010", "step-00000020", "step-00000030"]
    # a save that can fit once two entries go: exactly those, in the stated order
    room = bd.make_room(b, need_bytes=2 * TAG, include_in_flight=True, available=lambda _f: disk(),
                        only_if_it_fits=True)
    assert room.fits and room.removed == [old, "step-00000010"]


def _room(tmp_path: Path, run_dir: Path, tag: str, **kw):
    import logging

    return bd.room_for_save(tmp_path / "ck", run_dir, tag, 3, log=logging.getLogger("t"),
                            **{"under_daemon": True, **kw})


def test_the_first_save_is_checked_against_the_published_margin_and_the_predicted_size(tmp_path, monkeypatch):
    # No tag on disk yet: the daemon's file (written before launch) gives the margin and the predicted size.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    free = {"bytes": 16 << 20}
    monkeypatch.setattr(ck, "bytes_free", lambda _p: free["bytes"])
    bd.write_budget_file(run_dir, bd.BudgetPolicy(margin_bytes=5 << 30), [], predicted_tag_bytes=2_562_816)
    skip = _room(tmp_path, run_dir, "step-00000010")
    assert skip is not None and skip["need_bytes"] == 2_562_816 + (5 << 30)
    assert skip["available_bytes"] == 16 << 20 and skip["removed"] == [] and skip["margin_bytes"] == 5 << 30
    free["bytes"] = 6 << 30
    assert _room(tmp_path, run_dir, "step-00000010") is None   # the healthy case: it fits, it is written
    # Run by hand (no daemon, no file): no margin, the job's own prediction sizes the first tag.
    (run_dir / bd.BUDGET_FILE).unlink()
    free["bytes"] = 1 << 20
    skip = _room(tmp_path, run_dir, "step-00000010", under_daemon=False, predicted_bytes=2_562_816)
    assert skip is not None and skip["need_bytes"] == 2_562_816 and skip["tag_bytes"] == 2_562_816
    free["bytes"] = 3 << 20
    assert _room(tmp_path, run_dir, "step-00000010", under_daemon=False, predicted_bytes=2_562_816) is None


def test_iso_like_set_aside_times_are_recognised_and_ordered_with_unix_ones(tmp_path):
    import calendar

    make_tag(tmp_path, 10)
    iso = set_aside(tmp_path, 20, "rolledback", "20261207T121503Z")  # type: ignore[arg-type]
    unix_old = set_aside(tmp_path, 30, "corrupt", 1_700_000_000)         # 2023: older than the ISO one
    unix_new = set_aside(tmp_path, 40, "corrupt", 1_900_000_000)         # 2030: newer
    assert bd.set_aside_time(iso, 0.0) == calendar.timegm((2026, 12, 7, 12, 15, 3))
    assert ck.QUARANTINE_RE.match("step-00000050.corrupt-20261207T121503Z-1")
    assert not bd.SET_ASIDE_RE.match("step-00000050.corrupt-2026-12-07")   # other shapes stay `other`
    b = bd.classify(tmp_path, bd.BudgetPolicy(keep_last=3, set_aside_keep=1))
    assert cats(b)["set_aside"] == sorted([iso, unix_old, unix_new])
    assert sorted(e.name for e in b.doomed()) == sorted([iso, unix_old])      # the newest (2030) is kept
    assert [e.name for e in bd.room_order(b, include_in_flight=True)] == [unix_old, iso, unix_new]  # oldest first


def _stale_budget_dir(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """Tags 10, 20, 30 on a disk with half a tag free; the daemon's budget file, written before step 30 was saved,
    still names step 10 as the newest known-good tag (the job saved and reached its next save before the
    daemon's pass over that save)."""
    root, run_dir = tmp_path / "ck", tmp_path / "run"
    run_dir.mkdir()
    for s in (10, 20, 30):
        make_tag(root, s)
    bd.write_budget_file(run_dir, bd.BudgetPolicy(keep_last=3), ["step-00000010"])
    old = (root / "step-00000030" / ck.MANIFEST_NAME).stat().st_mtime - 5
    os.utime(run_dir / bd.BUDGET_FILE, (old, old))
    disk = SimDisk(root, capacity=3 * TAG + TAG // 2)
    monkeypatch.setattr(ck, "bytes_free", disk)
    return root, run_dir


def test_a_save_that_outran_the_daemons_pass_waits_for_it_and_then_fits(tmp_path, monkeypatch):
    import mmap
    import threading

    root, run_dir = _stale_budget_dir(tmp_path, monkeypatch)
    with open(root / "step-00000020" / "state.bin", "rb") as fh:   # the running job resumed from step 20 (mmap)
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        # Without the daemon's next pass nothing may go: 10 is the newest known-good, 20 is held, 30 the newest.
        skip = _room(tmp_path, run_dir, "step-00000040", daemon_pass_wait_s=0.3)
        assert skip is not None and skip["removed"] == []
        assert sorted(p.name for p in root.iterdir()) == ["step-00000010", "step-00000020", "step-00000030"]
        # The daemon's pass (a moment later) confirms 20 and 30: step 10 is no longer the newest known-good.
        t = threading.Timer(0.2, bd.write_budget_file, (run_dir, bd.BudgetPolicy(keep_last=3),
                                                        ["step-00000010", "step-00000020", "step-00000030"]))
        t.start()
        try:
            assert _room(tmp_path, run_dir, "step-00000040", daemon_pass_wait_s=30.0) is None
        finally:
            t.join()
        assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030"]
    finally:
        mapped.close()


def test_a_current_budget_is_not_waited_for_and_a_run_by_hand_never_waits(tmp_path, monkeypatch):
    import logging

    root, run_dir = _stale_budget_dir(tmp_path, monkeypatch)

    def no_sleep(_s):
        raise AssertionError("waited for the daemon's pass")

    # Published after step 30 (current), with a margin no removal can make: skipped at once, nothing removed.
    bd.write_budget_file(run_dir, bd.BudgetPolicy(keep_last=3, margin_bytes=10 * TAG), ["step-00000030"])
    skip = bd.room_for_save(root, run_dir, "step-00000040", 3, under_daemon=True, log=logging.getLogger("t"),
                            sleep=no_sleep)
    assert skip is not None and skip["removed"] == [] and skip["margin_bytes"] == 10 * TAG
    # Stale again, but no daemon: nothing to wait for.
    old = (root / "step-00000030" / ck.MANIFEST_NAME).stat().st_mtime - 5
    os.utime(run_dir / bd.BUDGET_FILE, (old, old))
    skip = bd.room_for_save(root, run_dir, "step-00000040", 3, under_daemon=False, log=logging.getLogger("t"),
                            sleep=no_sleep)
    assert skip is not None


def test_a_command_jobs_own_names_are_categorised_with_its_recogniser(tmp_path):
    """A command job's checkpoints (its own file names) and their `*.rolledback-<time>` copies, as the daemon's
    watch recognises them; without the recogniser (the built-in job's tags) the same entries are `other`."""
    import torch

    from ulyssesd.daemon.host.disk_budget import command_recogniser

    for s in (10, 20):
        torch.save({"step": s}, tmp_path / f"ckpt_{s:05d}.pt")
    torch.save({"step": 30}, tmp_path / "ckpt_00030.pt.rolledback-1764444444")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    run = type("Run", (), {"spec": {"job": {"kind": "command", "checkpoint_dir": str(tmp_path)}}})()
    rec = command_recogniser(run, tmp_path)
    assert rec is not None
    by = {e.name: e.category for e in bd.classify(tmp_path, bd.BudgetPolicy(), recognise=rec).entries}
    assert by == {"ckpt_00020.pt": "newest_valid", "ckpt_00010.pt": "keep_last",
                  "ckpt_00030.pt.rolledback-1764444444": "set_aside", "notes.txt": "other"}, by
    builtin = {e.name: e.category for e in bd.classify(tmp_path, bd.BudgetPolicy()).entries}
    assert set(builtin.values()) == {"other"}, builtin
    assert command_recogniser(type("Run", (), {"spec": {"job": {"kind": "builtin"}}})(), tmp_path) is None
