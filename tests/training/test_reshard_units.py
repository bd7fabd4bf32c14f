"""training/checkpoint/reshard.py without a training run: how many ranks saved a tag, when a conversion is needed, the
collective's answer on one rank, a failed conversion (named, the tag kept), a finished one reused, stale ones
removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulyssesd.training.checkpoint import reshard


def _tag(root: Path, name: str, ranks: int, manifest: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for r in range(ranks):
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x")
        (d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").write_bytes(b"x")
    if manifest:
        (d / "manifest.json").write_text(json.dumps({"v": 3, "step": 4}))
    return d


class OneRankOfTwo:
    """torch.distributed as rank 0 sees it: its broadcast sends what rank 0 holds."""

    def __init__(self):
        self.sent: list = []

    def broadcast_object_list(self, box, src):
        self.sent.append((list(box), src))


def test_saved_world_size_counts_the_optimizer_partitions(tmp_path):
    assert reshard.saved_world_size(_tag(tmp_path, "step-00000004", 3)) == 3
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (bf16 / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    assert reshard.saved_world_size(bf16) == 2
    assert reshard.saved_world_size(tmp_path / "missing") is None
    assert reshard.needs_reshard(tmp_path / "step-00000004", 3) is None
    assert reshard.needs_reshard(tmp_path / "step-00000004", 2) == 3


def test_same_world_loads_as_is_and_removes_a_stale_conversion(tmp_path):
    _tag(tmp_path, "step-00000004", 2)
    stale = tmp_path / reshard.UNIVERSAL_DIR / "step-00000002"
    stale.mkdir(parents=True)
    dist = OneRankOfTwo()
    assert reshard.agree_on_reshard(dist, 0, tmp_path, "step-00000004", 2) is None
    assert dist.sent == [([None], 0)]  # every rank hears "load it as it is"
    assert not (tmp_path / reshard.UNIVERSAL_DIR).exists()


def test_a_tag_without_partitions_or_manifest_is_refused_by_name(tmp_path):
    (tmp_path / "step-00000004").mkdir()
    with pytest.raises(reshard.ReshardError, match="no ZeRO optimizer partitions"):
        reshard.convert(tmp_path, "step-00000004")
    _tag(tmp_path, "step-00000008", 2, manifest=False)
    with pytest.raises(reshard.ReshardError, match="manifest cannot be read"):
        reshard.convert(tmp_path, "step-00000008")


def test_a_failed_conversion_names_the_tag_and_keeps_it(tmp_path):
    tag = _tag(tmp_path, "step-00000004", 2)  # not real shards: DeepSpeed's converter fails on them
    with pytest.raises(reshard.ReshardError) as err:
        reshard.agree_on_reshard(None, 0, tmp_path, "step-00000004", 1)
    assert "converting step-00000004 (saved by 2 ranks)" in str(err.value) and "exit" in str(err.value)
    assert tag.is_dir() and len(list(tag.iterdir())) == 5  # the tag itself untouched
    assert not (tmp_path / reshard.UNIVERSAL_DIR / "step-00000004" / reshard.SOURCE_NAME).exists()


def test_a_finished_conversion_of_the_same_tag_is_reused(tmp_path):
    _tag(tmp_path, "step-00000004", 2)
    out = tmp_path / reshard.UNIVERSAL_DIR / "step-00000004"
    out.mkdir(parents=True)
    digest = reshard._manifest_digest(tmp_path / "step-00000004")
    (out / reshard.SOURCE_NAME).write_text(json.dumps({"manifest_sha256": digest}))
    got = reshard.convert(tmp_path, "step-00000004", python="/nonexistent/python")  # never run: reused
    assert got.reused and got.load_dir == tmp_path / reshard.UNIVERSAL_DIR and got.from_world == 2
    # the same tag name with other contents (a rolled-back timeline saved it again): not reused
    (tmp_path / "step-00000004" / "manifest.json").write_text(json.dumps({"v": 3, "step": 4, "other": 1}))
    with pytest.raises(FileNotFoundError):
        reshard.convert(tmp_path, "step-00000004", python="/nonexistent/python")
