"""The resume's checkpoint loads map the files instead of copying them (training/startup.py `mapped_loads`):
the same bytes, a legacy-format file still loads, a standby's preload still answers first, and a load + copy
is not slower than the plain one (the H200's 17 GB load was 12.2 s of copying out of the page cache)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from test_standby_gate import _same, _tag

from ulyssesd.training.standby import Preload
from ulyssesd.training.startup import mapped_loads


class _Engine:
    def __init__(self):
        self.checkpoint_engine = TorchCheckpointEngine()


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_load_maps_the_file_bit_for_bit_and_the_engine_is_restored_after(tmp_path):
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = {"w": torch.randn(4096, 64), "b": torch.randn(64).to(torch.bfloat16), "step": 7}
    torch.save(sd, f)
    eng = _Engine()
    with mapped_loads(eng):
        got = eng.checkpoint_engine.load(str(f), map_location="cpu")
        assert _mapped(f)  # the tensors are the file's pages, not a copy
    assert _same(got, sd)
    assert "load" not in vars(eng.checkpoint_engine)  # the class's own load again
    got["w"].add_(1.0)  # a write to a mapped tensor is private: the file keeps its bytes
    del got
    assert _same(torch.load(f, weights_only=False), sd)


def test_with_zero_offload_to_the_host_the_loads_copy_as_before(tmp_path):
    """Offloaded states stay host tensors: mapped, they would pin a tag retention deletes for the attempt."""
    from types import SimpleNamespace

    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"w": torch.randn(4096)}, f)
    for optimizer, param, mapped in ((SimpleNamespace(device="cpu"), None, False),
                                     (None, SimpleNamespace(device=SimpleNamespace(value="nvme")), False),
                                     (SimpleNamespace(device=SimpleNamespace(value="none")), None, True)):
        eng = _Engine()
        eng.zero_offload_optimizer, eng.zero_offload_param = (lambda o=optimizer: o), (lambda p=param: p)
        with mapped_loads(eng):
            got = eng.checkpoint_engine.load(str(f), map_location="cpu")
            assert _mapped(f) == mapped, (optimizer, param)
        del got


def test_a_legacy_format_file_is_loaded_as_before(tmp_path):
    f = tmp_path / "old.pt"
    sd = {"w": torch.randn(128)}
    torch.save(sd, f, _use_new_zipfile_serialization=False)
    eng = _Engine()
    with mapped_loads(eng):
        assert _same(eng.checkpoint_engine.load(str(f), map_location="cpu"), sd)


def test_a_standby_preload_answers_first_and_the_rest_is_mapped_from_disk(tmp_path):
    root = tmp_path / "checkpoints"
    d = _tag(root, 4, seed=3)
    pre = Preload.read(root, rank=0)
    assert pre is not None
    eng, events = _Engine(), []
    mine = d / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    other = d / "zero_pp_rank_1_mp_rank_00_model_states.pt"  # rank 1's: not in rank 0's preload
    with mapped_loads(eng), pre.serve(eng, root, d.name, lambda name, **f: events.append(f)):
        a = eng.checkpoint_engine.load(str(mine), map_location="cpu")
        b = eng.checkpoint_engine.load(str(other), map_location="cpu")
        assert _mapped(other) and not _mapped(mine)  # rank 0's own shard came from the memfd
    assert events[-1]["from_memory"] == 1 and events[-1]["from_disk"] == 1
    assert _same(a, torch.load(mine, weights_only=False)) and _same(b, torch.load(other, weights_only=False))
    assert "load" not in vars(eng.checkpoint_engine)


def test_a_mapped_load_and_copy_is_not_slower_than_a_plain_one(tmp_path):
    f = tmp_path / "shard.pt"
    torch.save({f"w{i}": torch.randn(8 << 20) for i in range(8)}, f)  # 256 MiB, in the page cache now
    dst = {k: torch.empty_like(v) for k, v in torch.load(f, weights_only=False).items()}
    eng = _Engine()

    def plain():
        for k, v in eng.checkpoint_engine.load(str(f), map_location="cpu").items():
            dst[k].copy_(v)

    def mapped():
        with mapped_loads(eng):
            plain()

    best = {"plain": float("inf"), "mapped": float("inf")}
    for _ in range(3):  # interleaved, best of 3: the box is shared
        for name, fn in (("plain", plain), ("mapped", mapped)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"\n256 MiB load + copy: plain {best['plain']:.3f} s, mapped {best['mapped']:.3f} s")
    assert best["mapped"] <= best["plain"] * 1.10, best
