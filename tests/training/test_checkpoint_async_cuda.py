"""The async writer's GPU paths (training/checkpoint/saving.py): a first save cloned on the device and moved to
pinned host memory in the background, later saves straight into the reused pinned buffers, O_DIRECT writes.
Skipped without CUDA (run on the lent GPU machine: `python -m pytest -q tests/training/test_checkpoint_async_cuda.py`)."""

from __future__ import annotations

import pytest
import torch

from ulyssesd.training import checkpoint as ck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(seed: float):
    g = torch.arange(3_000_000, dtype=torch.float32, device="cuda") * seed
    return {"optimizer_state_dict": {"state": {0: {"exp_avg": g.clone(), "exp_avg_sq": g * 2, "step": torch.tensor(3.0)}}},
            "fp32_flat_groups": [g.clone().to(torch.bfloat16)], "meta": {"lr": [0.1]}}


def test_first_save_is_staged_on_the_device_later_saves_reuse_pinned_buffers(tmp_path):
    writer = ck.AsyncCheckpointWriter(0, device_staging=True)   # off by default (bench/RESULTS.md, call 9)
    for n, seed in ((1, 1.0), (2, 3.0)):
        tag_dir = tmp_path / ck.tag_for_step(n)
        writer.begin(tag_dir)
        state = _state(seed)
        writer.collect(state, str(tag_dir / "optim.pt"))
        staged, alloc = writer.last_staged_bytes, writer.last_alloc_bytes
        writer.start(commit=lambda d=tag_dir, n=n: ck.commit_when_durable(d, 1, n, 1.0, 8, 1, timeout_s=30))
        for t in (state["optimizer_state_dict"]["state"][0]["exp_avg"], state["fp32_flat_groups"][0]):
            t.add_(100.0)   # training goes on: the snapshot keeps the values at collect time
        assert writer.wait(60) and writer.take_failure() is None
        back = torch.load(tag_dir / "optim.pt")
        want = _state(seed)
        assert torch.equal(back["optimizer_state_dict"]["state"][0]["exp_avg"], want["optimizer_state_dict"]["state"][0]["exp_avg"].cpu())
        assert torch.equal(back["fp32_flat_groups"][0], want["fp32_flat_groups"][0].cpu())
        assert ck.validate_tag(tag_dir, verify_checksums=True) == (True, "ok")
        if n == 1:
            assert staged > 0 and alloc == 0   # nothing pinned yet: cloned on the GPU
        else:
            assert staged == 0 and alloc == 0   # every buffer came from the pool
