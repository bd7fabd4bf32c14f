"""`model.offload_checkpoints` on a GPU (training/model/offload.py's stream path): pinned host copies, the
device memory after forward lower by the inputs not in flight, and the same training math as without the
option. Skipped without CUDA (run on the lent GPU machine:
`python -m pytest -q tests/training/test_offload_checkpoints_cuda.py`; bench/gpu_long_seq.sh runs it first)."""

from __future__ import annotations

import pytest
import torch

from ulyssesd.training.model import offload
from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.spec import ModelSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, L, TOKENS = 1024, 8, 16384   # 32 MiB per bf16 block input: copies long enough for a missing sync to show


def _model(offload_on: bool, dtype=torch.bfloat16) -> GPT:
    torch.manual_seed(0)
    cfg = ModelSpec(preset=None, hidden_size=H, num_layers=L, num_attention_heads=8, vocab_size=4096,
                    max_seq_len=TOKENS, offload_checkpoints=offload_on).resolved()
    return GPT(cfg, "sdpa", checkpoint_every=1).to("cuda", dtype)


def _batch():
    g = torch.Generator(device="cuda").manual_seed(1)
    tok = torch.randint(0, 4096, (1, TOKENS + 1), device="cuda", generator=g)
    return tok[:, :-1], torch.arange(TOKENS, device="cuda")[None], tok[:, 1:]


def test_same_loss_and_grads_as_without_offload():
    grads, losses = [], []
    for on in (False, True):
        m = _model(on)
        loss = m(*_batch())
        loss.backward()
        torch.cuda.synchronize()
        losses.append(loss.detach().float())
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    assert torch.equal(losses[0], losses[1])   # forward: the same kernels on the same values
    for name in grads[0]:
        # Backward kernels may accumulate in a different order run to run (atomics); a wrong or racing
        # restore (a block input read before its copy landed) is far above this.
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-2, atol=1e-5), name


def test_device_memory_after_forward_drops_by_the_inputs_not_in_flight_and_host_copies_are_pinned(monkeypatch):
    pinned = []
    orig = offload.CheckpointInputOffloader._offload

    def spy(self, t):
        idx = orig(self, t)
        pinned.append(self._entries[idx].host.is_pinned())
        return idx

    monkeypatch.setattr(offload.CheckpointInputOffloader, "_offload", spy)
    after_forward = {}
    for on in (False, True):
        m = _model(on)
        batch = _batch()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = m(*batch)
        torch.cuda.synchronize()
        after_forward[on] = torch.cuda.memory_allocated() - before
        loss.backward()
        del loss, m
    each = TOKENS * H * 2
    saved = after_forward[False] - after_forward[True]
    assert saved >= (L - offload.CheckpointInputOffloader.max_in_flight) * each * 0.95, (saved, each)
    assert pinned and all(pinned)
