"""Retention (prune), disk guard with an injected usage function, and the known-good helper."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ulyssesd.training import checkpoint as ck


def make_tag(root: Path, step: int, valid: bool = True, size: int = 1000) -> Path:
    tag = root / ck.tag_for_step(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * size)
    if valid:
        ck.write_manifest(tag, step, 1.0, step, 1)
    return tag


# ---------------------------------------------------------------------------------------- prune
def test_prune_keeps_last_k_valid_anchors_and_in_progress(tmp_path):
    for s in (10, 20, 30, 40, 50):
        make_tag(tmp_path, s)
    make_tag(tmp_path, 25, valid=False)  # old partial save: removable
    make_tag(tmp_path, 60, valid=False)  # newer than newest valid: maybe in progress, kept
    removed = ck.prune(tmp_path, keep_last=2, anchors=["step-00000020"])
    assert removed == ["step-00000010", "step-00000025", "step-00000030"]
    assert ck.list_tags(tmp_path) == ["step-00000020", "step-00000040", "step-00000050", "step-00000060"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".deleting")]


def test_prune_dry_run_removes_nothing(tmp_path):
    for s in (1, 2, 3):
        make_tag(tmp_path, s)
    assert ck.prune(tmp_path, keep_last=1, dry_run=True) == ["step-00000001", "step-00000002"]
    assert len(ck.list_tags(tmp_path)) == 3


def test_prune_with_no_valid_tag_removes_nothing(tmp_path):
    for s in (1, 2):
        make_tag(tmp_path, s, valid=False)
    assert ck.prune(tmp_path, keep_last=1) == []
    assert len(ck.list_tags(tmp_path)) == 2


def test_prune_quarantined_only_when_asked_and_only_old_ones(tmp_path):
    for s in (10, 20, 30):
        make_tag(tmp_path, s)
    (tmp_path / "step-00000005.corrupt-1700000000").mkdir()
    (tmp_path / "step-00000030.corrupt-1700000001").mkdir()
    ck.prune(tmp_path, keep_last=1)
    assert len(ck.list_quarantined(tmp_path)) == 2  # default keeps evidence
    removed = ck.prune(tmp_path, keep_last=1, prune_quarantined=True)
    assert removed == ["step-00000005.corrupt-1700000000"]
    assert ck.list_quarantined(tmp_path) == ["step-00000030.corrupt-1700000001"]


def test_prune_cleans_leftovers_of_an_interrupted_delete(tmp_path):
    make_tag(tmp_path, 1)
    (tmp_path / ".deleting-step-00000000-123").mkdir()
    ck.prune(tmp_path, keep_last=1)
    assert not (tmp_path / ".deleting-step-00000000-123").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=10,
                unique_by=lambda t: t[0]),
       st.integers(1, 4), st.lists(st.integers(1, 40), max_size=3))
def test_prune_property_never_removes_newest_valid_anchors_or_newer(tmp_path_factory, tags, keep, anchor_steps):
    root = tmp_path_factory.mktemp("ck")
    for step, valid in tags:
        make_tag(root, step, valid, size=10)
    valid_steps = sorted(s for s, v in tags if v)
    anchors = [ck.tag_for_step(s) for s in anchor_steps]
    before = set(ck.list_tags(root))
    removed = ck.prune(root, keep_last=keep, anchors=anchors)
    after = set(ck.list_tags(root))
    assert after == before - set(removed)
    for a in anchors:
        assert a not in removed
    if valid_steps:
        newest = valid_steps[-1]
        assert ck.tag_for_step(newest) in after
        assert all(ck.tag_for_step(s) in after for s, _ in tags if s > newest)
        # The last K valid tags all survive.
        assert all(ck.tag_for_step(s) in after for s in valid_steps[-keep:])
        assert ck.latest_valid_tag(root) == ck.tag_for_step(newest)
    else:
        assert removed == []
    shutil.rmtree(root)


# ----------------------------------------------------------------------------------- disk guard
def fake_usage(root: Path, capacity: int):
    """free = capacity - bytes currently under root (so deletions really free space)."""
    def usage(_path: str):
        used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        return SimpleNamespace(total=capacity, used=used, free=capacity - used)
    return usage


def test_disk_guard_prunes_oldest_until_enough_free(tmp_path):
    for s in (10, 20, 30, 40):
        make_tag(tmp_path, s, size=1000)
    make_tag(tmp_path, 15, valid=False, size=1000)
    usage = fake_usage(tmp_path, capacity=8000)  # ~5000+manifests used
    need = usage("x").free + 1500
    removed = ck.disk_guard(tmp_path, min_free_bytes=need, usage=usage)
    # Invalid tag first, then the oldest valid one; stops as soon as there is enough space.
    assert removed == ["step-00000015", "step-00000010"]
    assert usage("x").free >= need


def test_disk_guard_stops_at_keep_min_and_spares_anchors_and_newest(tmp_path):
    for s in (10, 20, 30, 40):
        make_tag(tmp_path, s, size=1000)
    make_tag(tmp_path, 50, valid=False, size=1000)  # in progress
    usage = fake_usage(tmp_path, capacity=6000)
    removed = ck.disk_guard(tmp_path, min_free_bytes=10**9, keep_min=2, anchors=[10], usage=usage)
    # 10 is an anchor (and counts as one of the keep_min valid tags), 40 is the newest valid, 50 may be
    # a save in progress: only 20 and 30 may go, and both must go to approach the (unreachable) target.
    assert removed == ["step-00000020", "step-00000030"]
    assert ck.list_tags(tmp_path) == ["step-00000010", "step-00000040", "step-00000050"]
    for s in (20, 30):
        make_tag(tmp_path, s, size=1000)
    removed = ck.disk_guard(tmp_path, min_free_bytes=10**9, keep_min=3, anchors=[10], usage=usage)
    assert removed == ["step-00000020"]  # stops when only keep_min=3 valid tags remain


def test_disk_guard_noop_when_space_is_enough_and_dry_run(tmp_path):
    for s in (1, 2, 3):
        make_tag(tmp_path, s, size=1000)
    usage = fake_usage(tmp_path, capacity=10**6)
    assert ck.disk_guard(tmp_path, min_free_bytes=1000, usage=usage) == []
    tight = fake_usage(tmp_path, capacity=usage("x").used + 100)
    assert ck.disk_guard(tmp_path, min_free_bytes=1500, usage=tight, dry_run=True) == ["step-00000001", "step-00000002"]
    assert len(ck.list_tags(tmp_path)) == 3
    assert ck.disk_guard(tmp_path, min_free_bytes=1500, usage=tight, dry_run=True) == ["step-00000001", "step-00000002"]


def test_disk_guard_real_disk_usage_smoke(tmp_path):
    make_tag(tmp_path, 1)
    make_tag(tmp_path, 2)
    assert ck.disk_guard(tmp_path, min_free_bytes=1) == []  # the real filesystem has > 1 byte free


# ----------------------------------------------------------------------------------- known good
def test_known_good_requires_an_observed_anomaly_free_window():
    tags = [100, 200, 300, 400]
    anomalies = [250, 305]
    assert ck.known_good(tags, anomalies, window=50, last_step=500) == [100, 400]
    # 200: anomaly at 250 is inside (200, 250]; 300: 305 inside; 400: window observed up to 450 <= 500.
    assert ck.known_good(tags, anomalies, window=49, last_step=500) == [100, 200, 400]
    assert ck.known_good(tags, anomalies, window=50, last_step=449) == [100]  # 400's window not yet seen
    assert ck.known_good(tags, [100], window=10, last_step=500) == [200, 300, 400]  # anomaly AT the tag taints it
    assert ck.known_good([], anomalies, window=5, last_step=10) == []
    with pytest.raises(ValueError):
        ck.known_good(tags, anomalies, window=-1, last_step=0)


def test_known_good_tags_maps_names():
    tags = ["step-00000100", "step-00000200", "step-00000300.corrupt-5"]
    assert ck.known_good_tags(tags, [150], window=60, last_step=1000) == ["step-00000200"]
    assert ck.known_good_tags(tags, [150], window=20, last_step=1000) == ["step-00000100", "step-00000200"]
