"""The real job (2 ranks, gloo, DeepSpeed ZeRO-3) saving onto a real small filesystem (tmpfs, root only): it makes
room before each save in the budget's order, and skips a save that cannot fit instead of failing (slow)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from train_job_helpers import launch, tiny_spec

from ulyssesd.training import checkpoint as ck

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]
#: One tag of tiny_spec() on 2 ranks, measured: 2,625,500 bytes (the model prediction, 12 B/param: 2,562,816).
TAG_BYTES = 2_625_500


def _mount(path: Path, nbytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()[:100]}")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    yield lambda tags: (_mount(mnt, int(tags * TAG_BYTES)), mnt)[1]
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_disk_for_three_tags_with_keep_last_5_makes_room_before_each_save_and_never_fails(tmp_path, small_disk):
    disk = small_disk(3.6)
    spec = tiny_spec(train={"steps": 10}, checkpoint={"interval_steps": 2, "keep_last": 5, "dir": str(disk / "ck")})
    run = launch(spec, tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    assert [e["tag"] for e in run.events("checkpoint_saved")] == [ck.tag_for_step(s) for s in (2, 4, 6, 8, 10)]
    assert not run.events("checkpoint_save_failed") and not run.events("checkpoint_skipped")
    tags = ck.list_tags(disk / "ck")
    assert tags[-1] == "step-00000010" and len(tags) <= 3, tags
    assert all(ck.validate_tag(disk / "ck" / t, verify_checksums=True)[0] for t in tags)
    assert "made room for checkpoint" in run.output


def test_a_disk_for_less_than_two_tags_skips_the_save_with_its_numbers_and_training_goes_on(tmp_path, small_disk):
    disk = small_disk(1.6)
    spec = tiny_spec(train={"steps": 6}, checkpoint={"interval_steps": 2, "keep_last": 3, "dir": str(disk / "ck")})
    run = launch(spec, tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]          # never a crash
    assert max(run.steps()) == 6                            # training went on to the end
    assert [e["tag"] for e in run.events("checkpoint_saved")] == ["step-00000002"]
    skipped = run.events("checkpoint_skipped")
    assert [e["tag"] for e in skipped] == ["step-00000004", "step-00000006"]
    first = skipped[0]
    assert first["reason"] == "no_space" and first["kept"] == ["step-00000002"]
    assert first["need_bytes"] >= TAG_BYTES - 4096 and first["available_bytes"] < first["need_bytes"]
    assert ck.list_tags(disk / "ck") == ["step-00000002"]   # the newest valid tag was never touched
    assert ck.validate_tag(disk / "ck" / "step-00000002", verify_checksums=True)[0]
