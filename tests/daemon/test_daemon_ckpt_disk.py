"""The checkpoint disk under the daemon (docs/CHECKPOINT_DISK.md), with a fake OS and clock, real files, real
manifests and real SQLite; the free space is a simulated small disk read through the `ck.bytes_free` seam (a
real 4 MiB tmpfs is in tests/training/test_checkpoint_budget.py, the real 2-rank job at the end, slow)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_daemon_disk_full import _save_fails
from test_daemon_unit_fakeos import FakeOS, _emit, _make_tag, _steps, _sup

from ulyssesd.daemon.host import disk_budget
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import budget as bd

S = RunState
NO_MARGIN = {"min_free_gib": 0}


class SimDisk:
    """A filesystem of `capacity` bytes holding only the checkpoint directory (free = capacity - its bytes)."""

    def __init__(self, root: Path, capacity: int):
        self.root, self.capacity = root, capacity

    def used(self) -> int:
        return sum(bd.tree_bytes(p) if p.is_dir() else p.stat().st_size for p in self.root.iterdir()) \
            if self.root.is_dir() else 0

    def __call__(self, _path=None) -> int:
        return self.capacity - self.used()


def _saved(sup, step: int) -> None:
    _make_tag(sup.ckpt_dir, step)
    _emit(sup, kind="event", event="checkpoint_saved", step=step, tag=ck.tag_for_step(step))
    sup.tick()


def _sized(root: Path, step: int, nbytes: int, valid: bool = True) -> str:
    d = root / ck.tag_for_step(step)
    d.mkdir(parents=True)
    (d / "state.bin").write_bytes(b"s" * nbytes)
    if valid:
        ck.write_manifest(d, step, 1.0, step, 1)
    return d.name


def _tags(sup) -> list[int]:
    return [ck.step_of_tag(t) for t in ck.list_tags(sup.ckpt_dir)]


def test_tags_arriving_faster_than_any_timer_stay_within_the_budget(tmp_path):
    # A save every 10 steps, known-good after 5 clean steps, the retention timer never fires (no scheduler):
    # the budget runs on each checkpoint_saved, so the directory never holds more than window + anchors.
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={**NO_MARGIN, "retention_every_s": 3600.0, "checkpoint_anchors": 2,
                                      "anchor_spacing_steps": 50},
               remediation={"known_good_steps": 5})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    tag_bytes = None
    for s in range(10, 310, 10):
        _steps(sup, s - 9, s, dt=0.01)
        _saved(sup, s)
        tag_bytes = tag_bytes or ck.tag_bytes(sup.ckpt_dir / ck.tag_for_step(s))
        b = disk_budget.classify_run(sup)
        assert len(ck.list_tags(sup.ckpt_dir)) <= 3 + 2, _tags(sup)          # keep_last 3 + 2 anchors
        assert b.total_bytes <= b.policy.budget_bytes(b.tag_bytes) + 64       # + the `latest` pointer
    kg = {c.tag for c in sup.store.list_checkpoints(sup.run_id) if c.known_good}
    assert len(kg) >= 2  # anchors existed and were bounded, not kept forever
    left = _tags(sup)
    assert left[-3:] == [280, 290, 300]
    anchors = [s for s in left if s < 280]
    assert len(anchors) <= 2 and all(b - a >= 50 for a, b in zip(anchors, anchors[1:], strict=False))
    # The store agrees with the disk: pruned tags are marked, status names only what exists.
    unpruned = [c.tag for c in sup.store.list_checkpoints(sup.run_id)]
    assert sorted(unpruned) == ck.list_tags(sup.ckpt_dir)
    d = disk_budget.disk_status(sup.store, sup.store.get_run(sup.run_id))
    assert d["categories"]["newest_valid"]["count"] == 1 and d["categories"]["keep_last"]["count"] == 2
    assert d["free_bytes"] > 0 and d["total_bytes"] == sum(c["bytes"] for c in d["categories"].values())
    # The job's copy of the budget (it makes room itself before a save).
    policy, known, _pred = bd.read_budget_file(sup.run_dir)
    assert policy.keep_last == 3 and policy.max_anchors == 2 and set(known) == kg


def test_set_aside_copies_piling_up_are_capped_and_shown_in_status(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={**NO_MARGIN, "set_aside_keep": 2})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10, dt=0.01)
    for i, s in enumerate((20, 30, 40, 50, 60)):  # five rollbacks' lineages and three quarantined tags
        (sup.ckpt_dir / f"{ck.tag_for_step(s)}.rolledback-{1_700_000_000 + i}").mkdir(parents=True)
        (sup.ckpt_dir / f"{ck.tag_for_step(s)}.rolledback-{1_700_000_000 + i}" / "x.pt").write_bytes(b"r" * 64)
    for i, s in enumerate((3, 4, 5)):
        (sup.ckpt_dir / f"{ck.tag_for_step(s)}.corrupt-{1_600_000_000 + i}").mkdir()
    before = disk_budget.disk_status(sup.store, sup.store.get_run(sup.run_id))
    assert before["categories"]["set_aside"]["count"] == 8 and before["categories"]["set_aside"]["bytes"] == 5 * 64
    _saved(sup, 10)
    left = sorted(p.name for p in sup.ckpt_dir.iterdir() if ".rolledback-" in p.name or ".corrupt-" in p.name)
    assert left == ["step-00000050.rolledback-1700000003", "step-00000060.rolledback-1700000004"]  # the newest 2
    d = disk_budget.disk_status(sup.store, sup.store.get_run(sup.run_id))
    assert d["set_aside"] == left and d["categories"]["set_aside"]["bytes"] == 2 * 64
    text = disk_budget.render_disk(d)
    assert "set aside 2 (128 B)" in text and "free" in text


def test_after_each_save_the_daemon_makes_room_for_the_next_but_never_while_one_is_written(tmp_path, monkeypatch):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon=NO_MARGIN)
    said: list[str] = []
    sup.say = said.append
    sup.start()
    sup.new_config_version({"checkpoint.keep_last": 5}, "test: a window the disk cannot hold")
    _emit(sup, kind="event", event="started", step=0)
    tag, root = 8192, sup.ckpt_dir
    root.mkdir(parents=True, exist_ok=True)
    disk = SimDisk(root, capacity=3 * tag + 3000)  # three tags and their manifests
    monkeypatch.setattr(ck, "bytes_free", disk)
    for s in (10, 20, 30, 40, 50):
        _steps(sup, s - 9, s, dt=0.01)
        assert disk() >= tag, f"no room for the save of step {s}"  # the job would not have to skip it
        _sized(root, s, tag)
        _emit(sup, kind="event", event="checkpoint_saved", step=s, tag=ck.tag_for_step(s))
        sup.tick()
    # The window shrank, oldest first, to what the disk holds with room left for the next save.
    assert _tags(sup) == [40, 50] and disk() >= tag
    cut = [m for m in said if "fewer than keep_last 5" in m]
    assert len(cut) == 1 and "holds 2 tag(s)" in cut[0], said  # said once, with the numbers
    # A save being written (no manifest yet): its bytes are still arriving, the window is left alone.
    _sized(root, 60, tag // 2, valid=False)
    from ulyssesd.daemon.core.housekeeping import retention

    retention(sup)
    assert _tags(sup) == [40, 50, 60]


def _disk_run(tmp_path, keep_last: int = 3, **daemon):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={**NO_MARGIN, **daemon}, interval=10)
    sup.start()
    sup.new_config_version({"checkpoint.keep_last": keep_last}, "test: the run's keep_last")
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 40, dt=0.01)
    return fos, sup


def test_enospc_mid_save_makes_room_in_the_stated_order_and_the_run_resumes(tmp_path, monkeypatch):
    fos, sup = _disk_run(tmp_path)
    tag = 8192
    root = sup.ckpt_dir
    for s in (10, 20, 30):
        _sized(root, s, tag)
    sup.store.upsert_checkpoint(sup.run_id, "step-00000010", step=10, known_good=True)
    sup.store.upsert_checkpoint(sup.run_id, "step-00000020", step=20, known_good=True)
    (root / "step-00000005.corrupt-1").mkdir()
    (root / "step-00000005.corrupt-1" / "x").write_bytes(b"c" * (tag // 4))
    _sized(root, 40, tag // 4, valid=False)  # the failed save's partial
    disk = SimDisk(root, capacity=0)
    disk.capacity = disk.used()              # the save filled the disk
    monkeypatch.setattr(ck, "bytes_free", disk)
    _save_fails(fos, sup, "ENOSPC")
    inc = sup.store.get_incident(sup.store.list_incidents(sup.run_id)[0].id)
    prune = next(a for a in inc.actions if a.kind.value == "prune")
    # The partial and the set-aside copy free half a tag; then the anchor beyond the newest known-good.
    assert prune.parameters["removed"] == ["step-00000040", "step-00000005.corrupt-1", "step-00000010"]
    assert prune.parameters["kept_newest_valid"] == "step-00000030"
    assert prune.parameters["kept_newest_known_good"] == "step-00000020"
    assert ck.list_tags(root) == ["step-00000020", "step-00000030"]
    assert disk() >= prune.parameters["next_save_needs_bytes"]
    # ... and the run resumed from the newest valid tag, then saved again.
    assert sup.attempt == 2 and sup.state == S.STARTING
    assert sup.store.list_attempts(sup.run_id)[1].resumed_from == "step-00000030"
    _emit(sup, kind="event", event="started", step=30)
    _steps(sup, 31, 50, dt=0.01)
    _sized(root, 50, tag)
    _emit(sup, kind="event", event="checkpoint_saved", step=50, tag="step-00000050")
    sup.tick()
    assert sup.state == S.RUNNING and "step-00000050" in ck.list_tags(root)


def test_a_disk_holding_fewer_tags_than_configured_lengthens_the_save_interval(tmp_path, monkeypatch):
    fos, sup = _disk_run(tmp_path, keep_last=5)
    tag, root = 8192, sup.ckpt_dir
    for s in (10, 20, 30):
        _sized(root, s, tag)
    _sized(root, 40, tag // 2, valid=False)
    disk = SimDisk(root, 0)
    disk.capacity = disk.used()  # holds these three tags and half a fourth: 3 tags, keep_last 5 + 1 wanted
    monkeypatch.setattr(ck, "bytes_free", disk)
    _save_fails(fos, sup, "ENOSPC")
    assert sup.attempt == 2
    inc = sup.store.get_incident(sup.store.list_incidents(sup.run_id)[0].id)
    prune = next(a for a in inc.actions if a.kind.value == "prune")
    assert prune.parameters["tags_fit"] == 3
    assert sup.config["checkpoint"]["interval_steps"] == 20  # 10 x ceil(6 / 3)
    assert prune.config_diff == {"checkpoint.interval_steps": [10, 20]}


def test_a_disk_that_cannot_hold_the_newest_tag_plus_one_more_ends_the_run_saying_exactly_that(tmp_path, monkeypatch):
    fos, sup = _disk_run(tmp_path)
    tag, root = 8192, sup.ckpt_dir
    for s in (10, 20, 30):
        _sized(root, s, tag)
    sup.store.upsert_checkpoint(sup.run_id, "step-00000010", step=10, known_good=True)
    _sized(root, 40, 100, valid=False)
    disk = SimDisk(root, 0)
    disk.capacity = disk.used()
    monkeypatch.setattr(ck, "bytes_free", lambda p: disk() - tag)  # something else holds a tag's worth
    _save_fails(fos, sup, "ENOSPC")
    assert sup.state == S.FAILED
    reason = sup.store.get_run(sup.run_id).state_reason
    assert "cannot hold the newest valid tag plus one more" in reason
    assert "kept step-00000030 and step-00000010" in reason and "next save needs ~" in reason
    assert ck.list_tags(root) == ["step-00000010", "step-00000030"]  # newest valid and newest known-good


def test_edquot_counts_only_what_was_freed_statvfs_does_not_see_the_quota(tmp_path, monkeypatch):
    fos, sup = _disk_run(tmp_path)
    tag, root = 8192, sup.ckpt_dir
    for s in (10, 20, 30):
        _sized(root, s, tag)
    _sized(root, 40, 100, valid=False)
    _save_fails(fos, sup, "EDQUOT")  # the real tmp filesystem reports plenty free
    inc = sup.store.get_incident(sup.store.list_incidents(sup.run_id)[0].id)
    prune = next(a for a in inc.actions if a.kind.value == "prune")
    assert prune.parameters["removed"] == ["step-00000040", "step-00000010"]  # freed >= one tag
    assert prune.parameters["bytes_freed"] >= prune.parameters["next_save_needs_bytes"]
    assert sup.attempt == 2


def _skip(sup, step: int) -> None:
    _emit(sup, kind="event", event="checkpoint_skipped", step=step, tag=ck.tag_for_step(step), reason="no_space",
          need_bytes=9000, available_bytes=100, tag_bytes=9000, margin_bytes=0, removed=[], kept=["step-00000010"])
    sup.tick()


def test_a_save_the_job_skipped_for_space_is_an_incident_and_the_run_goes_on(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon=NO_MARGIN)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 20, dt=0.01)
    _emit(sup, kind="event", event="checkpoint_skipped", step=20, tag="step-00000020", reason="no_space",
          need_bytes=9000, available_bytes=100, tag_bytes=9000, margin_bytes=0, removed=["step-00000005.corrupt-1"],
          kept=["step-00000010"])
    sup.tick()
    assert sup.state == S.RUNNING and fos.is_alive(sup.job)
    (inc,) = sup.store.list_incidents(sup.run_id)
    # open while the disk stays full: the episode ends only when a save is written again
    assert inc.symptom.value == "disk_full" and inc.status.value == "open"
    assert "needs ~9000 bytes, 100 available" in inc.summary
    assert inc.status_reason.startswith("1 save skipped so far")


def test_a_disk_that_stays_full_is_one_incident_per_episode_resolved_by_the_next_written_save(tmp_path):
    # A save every 2 steps on a full disk: 20 skips are one open incident with a count, not 20 incidents each
    # "resolved" at once; the first save written again resolves it; a later skip opens a new episode.
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon=NO_MARGIN)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10, dt=0.01)
    _saved(sup, 10)
    for s in range(12, 52, 2):
        _steps(sup, s - 1, s, dt=0.01)
        _skip(sup, s)
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert inc.symptom.value == "disk_full" and inc.status.value == "open", inc
    assert inc.status_reason.startswith("20 saves skipped so far, the last step-00000050 at step 50"), inc
    assert sup.state == S.RUNNING and fos.is_alive(sup.job)
    _steps(sup, 51, 52, dt=0.01)
    _saved(sup, 52)
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert inc.status.value == "resolved"
    assert inc.status_reason == "checkpoint step-00000052 written at step 52 after 20 skipped saves"
    _steps(sup, 53, 54, dt=0.01)
    _saved(sup, 54)  # a save with no episode open touches nothing
    _steps(sup, 55, 56, dt=0.01)
    _skip(sup, 56)
    first, second = sup.store.list_incidents(sup.run_id)
    assert first.id == inc.id and first.status.value == "resolved"
    assert second.status.value == "open" and second.status_reason.startswith("1 save skipped so far")


# ------------------------------------------------------------------------------------------ preflight
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A real filesystem of `size` mounted at `path` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:100]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _tiny_spec(tmp_path: Path, ckpt_dir: Path, **daemon) -> Path:
    from uls_daemon_helpers import write_spec

    return write_spec(tmp_path / "run.toml", {
        "run": {"name": "small-disk"}, "launcher": {"kind": "torchrun", "nproc_per_node": 2},
        "model": {"preset": "tiny"}, "parallel": {"sequence_parallel_size": 2}, "precision": {"dtype": "fp32"},
        "train": {"steps": 30, "seq_len": 64, "micro_batch_size": 1, "device": "cpu"},
        "data": {"kind": "synthetic"}, "checkpoint": {"dir": str(ckpt_dir), "interval_steps": 5, "keep_last": 3},
        "daemon": {"state_dir": str(tmp_path / "state"), "socket_path": str(tmp_path / "d.sock"), **daemon}}, None)


def test_preflight_refuses_a_plan_that_cannot_fit_with_its_numbers_and_what_fits(tmp_path):
    from ulyssesd.daemon.spec import load_run_spec

    spec = load_run_spec(_tiny_spec(tmp_path, tmp_path / "ck"))
    tag = disk_budget.predicted_tag_bytes(spec.job)
    assert tag > 0
    room = 5 * tag  # less than 3 + 2 anchors + 1 in flight + 1 set-aside + the 5 GiB margin
    verdict = disk_budget.preflight_disk(spec, free=lambda p: room)
    assert verdict is not None and "the settings need" in verdict
    assert f"{bd.describe_bytes(room)} free" in verdict
    # fewer anchors first, then a smaller keep_last; the margin last
    assert ("What fits: [daemon] checkpoint_anchors = 1, [daemon] set_aside_keep = 0, [daemon] min_free_gib = 0 "
            in verdict), verdict
    assert "another checkpoint.dir" in verdict
    # The suggested settings pass.
    fits = load_run_spec(_tiny_spec(tmp_path, tmp_path / "ck", min_free_gib=0, set_aside_keep=0, checkpoint_anchors=1))
    assert disk_budget.preflight_disk(fits, free=lambda p: room) is None
    # Plenty of room: no refusal (the negative control).
    assert disk_budget.preflight_disk(spec, free=lambda p: 100 << 30) is None
    # Tags already on disk: their real size, not the prediction, and their bytes count as the budget's.
    (tmp_path / "ck").mkdir()
    _sized(tmp_path / "ck", 10, 3 * tag)
    verdict = disk_budget.preflight_disk(fits, free=lambda p: room)
    assert verdict is not None and "in its checkpoints" in verdict


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_a_new_user_on_a_disk_too_small_is_refused_before_launch_with_what_fits(tmp_path):
    with tmpfs(tmp_path / "disk", "16m") as mnt:
        spec = _tiny_spec(tmp_path, mnt / "ckpt")
        r = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 11, r.stderr  # EXIT_PREFLIGHT
        assert "preflight refused the run: checkpoint disk:" in r.stderr
        assert "What fits:" in r.stderr and "MiB free" in r.stderr, r.stderr
        assert not (mnt / "ckpt").exists() or not any((mnt / "ckpt").iterdir())  # nothing launched or written
        assert not list((tmp_path / "state").glob("runs/*/attempts/*"))



# -------------------------------------------------------------------- the real 2-rank job on a tmpfs (slow)
#: One tag of the real 2-rank tiny job at seq 64 (tests/training/test_checkpoint_budget_job.py measured it).
REAL_TAG = 2_625_500


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_real_job_enospc_mid_save_on_a_small_disk_makes_room_lengthens_the_interval_and_completes(
        tmp_path, make_sup):
    from test_daemon_e2e_real import real_spec
    from uls_daemon_helpers import run_until

    with tmpfs(tmp_path / "disk", str(int(3.3 * REAL_TAG))) as mnt:
        ckpt = mnt / "ck"
        ckpt.mkdir()
        rb = ckpt / "step-00000099.rolledback-1700000000"  # an earlier run's set-aside lineage holds a tag's worth
        rb.mkdir()
        (rb / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"r" * REAL_TAG)
        spec = real_spec(tmp_path, steps=10, interval=2, faults=[{"kind": "disk_full", "at_step": 6}],
                         daemon={"min_free_gib": 0})
        text = spec.read_text().replace("keep_last = 10", f'keep_last = 3\ndir = "{ckpt}"')
        spec.write_text(text)
        ev: list[str] = []
        sup = make_sup(spec, ev)
        sup.start()
        run_until(sup, lambda s: s.state in (S.COMPLETED, S.FAILED, S.STOPPED), timeout=400, tick=0.2)
        assert sup.state == S.COMPLETED, ev
        incs = sup.store.list_incidents(sup.run_id)
        assert [i.symptom.value for i in incs] == ["disk_full"], [(i.symptom.value, i.summary) for i in incs]
        prune = next(a for a in sup.store.get_incident(incs[0].id).actions if a.kind.value == "prune")
        assert prune.parameters["removed"][0] == "step-00000006"          # the failed save's partial first
        assert not rb.exists()                                            # the set-aside copy went before any tag
        # The disk holds 3 tags, keep_last 3 + the save in flight want 4: saves every 4 steps instead of 2.
        assert prune.parameters["tags_fit"] == 3 and sup.config["checkpoint"]["interval_steps"] == 4
        attempts = sup.store.list_attempts(sup.run_id)
        assert len(attempts) == 2 and attempts[1].resumed_from == "step-00000004"
        tele = [json.loads(line) for line in sup.telemetry_path.read_text().splitlines()]
        failed = [r for r in tele if r.get("event") == "checkpoint_save_failed"]
        assert len(failed) == 1 and failed[0]["errno"] == "ENOSPC"       # the injected one, never a real one after
        # Two tags and room for a third: one removal after the last save. While attempt 2 still runs it maps step
        # 4's files (CPU tensors loaded with mmap), removing step 4 would free nothing and step 8 goes instead
        # (held_entries); once it has exited, step 4 goes. Before held_entries both went.
        # Whether that last removal happens before the run completes depends on the daemon's pass racing the job's
        # exit (a loaded box can end the run first): both are within the budget (the disk holds 3 tags).
        tags = ck.list_tags(ckpt)
        assert 2 <= len(tags) <= prune.parameters["tags_fit"] and tags[-1] == "step-00000010", tags
        assert all(ck.validate_tag(ckpt / t, True)[0] for t in tags)


def test_ulyssesctl_status_shows_the_directory_by_category_and_the_free_space(tmp_path, capsys):
    from ulyssesd.daemon.operator.ctl import main

    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon=NO_MARGIN)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 20, dt=0.01)
    (sup.ckpt_dir / "step-00000030.rolledback-1700000000").mkdir(parents=True)
    (sup.ckpt_dir / "step-00000030.rolledback-1700000000" / "x.pt").write_bytes(b"r" * 100)
    _saved(sup, 10)
    _saved(sup, 20)
    state = ["--state-dir", str(tmp_path / "state")]
    capsys.readouterr()
    assert main([*state, "status", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["checkpoint_disk"]
    assert d["newest_valid"] == "step-00000020" and d["set_aside"] == ["step-00000030.rolledback-1700000000"]
    assert d["categories"]["keep_last"]["count"] == 1 and d["categories"]["set_aside"]["bytes"] == 100
    assert d["free_bytes"] > 0 and d["budget_bytes"] >= d["total_bytes"]
    assert main([*state, "status"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint disk" in out and "set aside 1 (100 B)" in out and "free" in out


def test_run_help_says_no_preflight_skips_the_disk_check_too():
    from typer.testing import CliRunner

    from ulyssesd.daemon.cli import build_app

    r = CliRunner().invoke(build_app(), ["run", "--help"], env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    line = " ".join(r.output.split())
    assert "--no-preflight" in line
    assert "the memory planner's and the checkpoint disk's" in line and "still checked before every save" in line


def test_the_budget_file_is_written_before_the_first_launch_with_the_run_specs_margin(tmp_path):
    # The job checks its first save against this file: it must exist before the job starts, not only after the
    # first retention pass (which made the first save's check depend on timing).
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"min_free_gib": 0.5, "checkpoint_anchors": 1, "retention_every_s": 3600.0})
    sup.start()
    assert sup.job is not None
    published = bd.read_budget_file(sup.run_dir)
    assert published is not None
    policy, known, predicted = published
    assert policy.margin_bytes == int(0.5 * (1 << 30)) and policy.max_anchors == 1 and known == []
    assert predicted == disk_budget.predicted_from_config(sup.config) and predicted > 0
