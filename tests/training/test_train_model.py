"""The GPT model on one process (no DeepSpeed): checkpointing, fp32 blocks, rotary positions, presets."""

from __future__ import annotations

import pytest
import torch
from model_helpers import assert_same_loss_and_grads
from model_helpers import tiny_model as _model
from model_helpers import token_batch as _batch

from ulyssesd.training.model.gpt import apply_rotary, rotary_cos_sin
from ulyssesd.training.spec import ModelSpec


def test_activation_checkpointing_gives_identical_loss_and_grads():
    assert_same_loss_and_grads(_model(), _model(checkpoint_every=2), atol=1e-7)


def test_tied_head_shares_the_embedding_and_untied_has_a_head():
    assert _model().head is None
    untied = _model(model={"tie_embeddings": False})
    assert untied.head is not None and untied.head.weight.shape == (256, 64)


def test_swiglu_and_bias_variants_run():
    m = _model(model={"mlp": "swiglu", "bias": True})
    x, pos, y = _batch()
    assert torch.isfinite(m(x, pos, y))


def test_fp32_layers_compute_in_fp32_in_a_bf16_model():
    x, pos, y = _batch()
    m = _model(fp32_layers=2).to(torch.bfloat16)
    seen = []
    m.blocks[0].attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    with torch.no_grad():
        assert torch.isfinite(m(x, pos, y))
    # One attention module serves all blocks: first two calls fp32, the rest bf16.
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    assert [b.fp32 for b in m.blocks] == [True, True, False, False]
    m.set_fp32_layers(0)
    assert not any(b.fp32 for b in m.blocks)


def test_fp32_residual_mode_keeps_the_residual_stream_fp32_and_matmuls_in_bf16():
    # precision.fp32_mode="residual": the fp32 blocks sum their residual stream and normalise in fp32, while
    # attention (and the matmuls) stay in the model's dtype -- the cheap form of the fp32 rung.
    x, pos, y = _batch()
    m = _model(fp32_layers=2, fp32_mode="residual").to(torch.bfloat16)
    attn_in, ln_in = [], []
    m.blocks[0].attn.register_forward_pre_hook(lambda mod, args: attn_in.append(args[0].dtype))
    m.blocks[0].ln1.register_forward_pre_hook(lambda mod, args: ln_in.append(args[0].dtype))
    m.blocks[3].ln1.register_forward_pre_hook(lambda mod, args: ln_in.append(args[0].dtype))
    with torch.no_grad():
        loss_residual = m(x, pos, y)
    assert torch.isfinite(loss_residual)
    assert attn_in == [torch.bfloat16] * 4
    assert ln_in == [torch.float32, torch.bfloat16]
    # Same weights, every block fully bf16: the loss differs (the fp32 sums are real) but only by rounding.
    m.set_fp32_layers(0)
    with torch.no_grad():
        loss_bf16 = m(x, pos, y)
    assert abs(loss_residual.item() - loss_bf16.item()) < 0.05
    with pytest.raises(ValueError, match="fp32_mode"):
        _model(fp32_mode="half")


def test_rotary_uses_global_positions():
    # A shard's rotary must equal the slice of the full sequence's rotary: positions are global.
    q = torch.randn(1, 16, 2, 8)
    cos, sin = rotary_cos_sin(torch.arange(16)[None], 8, 10000.0)
    full = apply_rotary(q, cos, sin)
    cos2, sin2 = rotary_cos_sin(torch.arange(8, 16)[None], 8, 10000.0)
    assert torch.allclose(apply_rotary(q[:, 8:], cos2, sin2), full[:, 8:])
    cos_local, sin_local = rotary_cos_sin(torch.arange(8)[None], 8, 10000.0)
    assert not torch.allclose(apply_rotary(q[:, 8:], cos_local, sin_local), full[:, 8:])


@pytest.mark.parametrize("preset, billions", [("gpt-7b", 6.86), ("gpt-176b", 174.6)])
def test_presets_parameter_counts(preset, billions):
    cfg = ModelSpec(preset=preset).resolved()
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=0.01)
