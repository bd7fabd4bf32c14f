"""The tiny GPT on one process (no DeepSpeed) and an equality check, shared by the model-level tests."""

from __future__ import annotations

import torch

from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.spec import ModelSpec


def tiny_model(**kw) -> GPT:
    """Seeded tiny GPT with the math attention kernel; `model={...}` overrides ModelSpec fields."""
    torch.manual_seed(0)
    cfg = ModelSpec(preset="tiny", **kw.pop("model", {})).resolved()
    return GPT(cfg, "math", **kw)


def token_batch(b: int = 2, s: int = 32, vocab: int = 256):
    """(input ids, global position ids, labels) of a seeded random batch."""
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tok[:, :-1], torch.arange(s).expand(b, s), tok[:, 1:]


def assert_same_loss_and_grads(ref: GPT, other: GPT, atol: float = 1e-7) -> None:
    """One forward/backward of each on the same batch: bit-identical loss, gradients within `atol`."""
    x, pos, y = token_batch()
    l1, l2 = ref(x, pos, y), other(x, pos, y)
    l1.backward()
    l2.backward()
    assert torch.equal(l1, l2)
    for (name, p1), (_, p2) in zip(ref.named_parameters(), other.named_parameters(), strict=True):
        assert torch.allclose(p1.grad, p2.grad, atol=atol), name
