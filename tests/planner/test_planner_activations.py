"""The activation coefficients against what the real model saves for backward (CPU, torch saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch

from ulyssesd.training.model.gpt import GPT, rotary_cos_sin
from ulyssesd.training.planner import block_saved_bytes_per_token
from ulyssesd.training.spec import JobSpec

B, S = 2, 256


def _model(mlp: str, dtype: torch.dtype) -> tuple[GPT, object]:
    m = JobSpec.model_validate({"model": {"hidden_size": 128, "num_layers": 2, "num_attention_heads": 4,
                                          "vocab_size": 512, "max_seq_len": 1024, "mlp": mlp}}).resolved_model()
    torch.manual_seed(0)
    return GPT(m, attention_backend="sdpa").to(dtype), m


def _saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of distinct storages autograd saves while running fn(), minus parameters and `exclude`."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _param_ptrs(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_saved_bytes_match_the_model(mlp, dtype):
    model, m = _model(mlp, dtype)
    x = torch.randn(B, S, m.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(S)[None].expand(B, S), m.head_dim, m.rope_theta)
    exclude = _param_ptrs(model) | {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    measured = _saved_bytes(lambda: model.blocks[0](x, cos, sin), exclude)
    d = 2 if dtype == torch.bfloat16 else 4
    predicted = B * S * block_saved_bytes_per_token(m, d, sp=1)
    # Only the fp32 copies of the LayerNorm weights (2·4h bytes, parameter-sized) are not in the formula.
    assert predicted == pytest.approx(measured, rel=0.01)
    # Negative control: the Ulysses variant (separate proj input) is measurably different.
    assert B * S * block_saved_bytes_per_token(m, d, sp=2) != pytest.approx(measured, rel=0.01)


def test_head_and_loss_saved_bytes():
    """ln_f (fp32 input copy) + head input + fp32 log-softmax output: 4h + d·h + 4V bytes per token; the
    planner's 12·V for logits is this 4V plus the two fp32 [tokens, V] gradients alive in its backward."""
    model, m = _model("gelu", torch.bfloat16)
    x = torch.randn(B, S, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, m.vocab_size, (B, S))

    def head():
        h = model.ln_f(x)
        logits = model.embed(h, as_head=True) if model.head is None else torch.nn.functional.linear(h, model.head.weight)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, m.vocab_size), labels.reshape(-1))

    measured = _saved_bytes(head, _param_ptrs(model) | {labels.untyped_storage().data_ptr()})
    per_token = 4 * m.hidden_size + 8 + 2 * m.hidden_size + 4 * m.vocab_size
    assert B * S * per_token == pytest.approx(measured, rel=0.02)


# Speed and long-sequence levers (bench/RESULTS.md, issue 20): the planner's terms against autograd.
def test_qkv_view_lever_keeps_the_whole_qkv_output_as_the_planner_says():
    # model.qkv_copy=false: attention saves v as a view of qkv, so the [tokens, 3h] qkv output stays alive.
    model, m = _model("gelu", torch.bfloat16)
    view_model, mv = _model("gelu", torch.bfloat16)
    for blk in view_model.blocks:
        blk.qkv_copy = False
    mv = mv.model_copy(update={"qkv_copy": False})
    x = torch.randn(B, S, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(S)[None].expand(B, S), m.head_dim, m.rope_theta)
    exclude = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    copy = _saved_bytes(lambda: model.blocks[0](x, cos, sin), exclude | _param_ptrs(model))
    view = _saved_bytes(lambda: view_model.blocks[0](x, cos, sin), exclude | _param_ptrs(view_model))
    assert view - copy == B * S * 2 * 2 * m.hidden_size  # + 2h bf16 per token
    assert B * S * block_saved_bytes_per_token(mv, 2, sp=1) == pytest.approx(view, rel=0.01)


def test_tiled_mlp_saved_bytes_match_the_planner():
    model, m = _model("gelu", torch.bfloat16)
    for blk in model.blocks:
        blk.mlp_chunk_tokens = 64
    mt = m.model_copy(update={"mlp_chunk_tokens": 64})
    x = torch.randn(B, S, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(S)[None].expand(B, S), m.head_dim, m.rope_theta)
    exclude = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()} | _param_ptrs(model)
    measured = _saved_bytes(lambda: model.blocks[0](x, cos, sin), exclude)
    assert B * S * block_saved_bytes_per_token(mt, 2, sp=1) == pytest.approx(measured, rel=0.01)
    # Negative control: the untiled formula is far off (the GELU MLP's 2·d·4h per token are gone).
    assert B * S * block_saved_bytes_per_token(m, 2, sp=1) > 1.3 * measured
