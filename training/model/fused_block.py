"""`model.compile_blocks`: a block's work around attention as two torch.compile'd functions.

Eager, a no-recompute gpt-1b step at 32K on one H200 spends ~160 ms outside attention and matmuls
(LayerNorm, GELU, residual adds, casts, rotary); inductor fuses each side of attention into a few kernels and
may recompute cheap pointwise ops in backward instead of saving them. Attention itself stays eager (the cuDNN
kernel, and what `checkpoint_keep_attention` keeps); matmuls stay cuBLAS calls inside the graphs.

The functions take the weights as arguments (not the modules), so one compiled graph serves every block of
the same shape (no per-block recompiles) and no module hooks run inside it. Under ZeRO-3 use it with
`train.zero3_leaf_blocks`: the block's leaf hook has gathered all its parameters before the block runs; a
weight still partitioned (0 elements) when read here is refused, naming that setting.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..spec import SpecError

# ZeRO-3's zero.Init replaces torch.nn.functional.linear for good with its memory-efficient autograd.Function
# (`memory_efficient_linear`, it saves weight ids, not tensors); inside these graphs the plain aten op is
# what inductor should see (same matmul), and the block's weights are gathered for the whole block anyway.
_aten_linear = torch._C._nn.linear
log = logging.getLogger(__name__)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of `[b, s, h, d]` in fp32 (GPT-NeoX layout)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (strided views of the qkv output are fine) rotated in fp32, as new contiguous tensors."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _layer_norm(x: torch.Tensor, w, b, eps: float, fp32_copy: bool) -> torch.Tensor:
    # Same math as gpt.LayerNorm32 (the eager path).
    if not fp32_copy and x.dtype == w.dtype:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return F.layer_norm(x.float(), (x.shape[-1],), w.float(), None if b is None else b.float(), eps).to(x.dtype)


def pre_attention(x, ln_w, ln_b, qkv_w, qkv_b, cos, sin, n_heads: int, head_dim: int, eps: float,
                  fp32_copy: bool):
    """ln1 -> qkv projection -> rotary of q and k; returns q, k (contiguous) and v (a view of qkv)."""
    b, s, _ = x.shape
    hn = _layer_norm(x, ln_w, ln_b, eps, fp32_copy)
    q, k, v = _aten_linear(hn, qkv_w, qkv_b).view(b, s, 3, n_heads, head_dim).unbind(2)
    q, k = rotate_qk(q, k, cos, sin)
    return q, k, v


def post_attention(x, a, proj_w, proj_b, ln_w, ln_b, fc_in_w, fc_in_b, fc_out_w, fc_out_b, eps: float,
                   fp32_copy: bool, swiglu: bool):
    """Residual + output projection, ln2, MLP (GELU tanh or SwiGLU), residual."""
    x = x + _aten_linear(a, proj_w, proj_b)
    hn = _layer_norm(x, ln_w, ln_b, eps, fp32_copy)
    u = _aten_linear(hn, fc_in_w, fc_in_b)
    if swiglu:
        gate, up = u.chunk(2, dim=-1)
        u = F.silu(gate) * up
    else:
        u = F.gelu(u, approximate="tanh")
    return x + _aten_linear(u, fc_out_w, fc_out_b)


@functools.cache
def compiled() -> tuple:
    """(pre_attention, post_attention) through inductor, compiled once per process and shape."""
    log.info("compile_blocks: compiling each block's work around attention (inductor; first step pays it)")
    return (torch.compile(pre_attention, fullgraph=True, dynamic=False),
            torch.compile(post_attention, fullgraph=True, dynamic=False))


class NotGatheredError(SpecError, RuntimeError):
    """compile_blocks met a partitioned weight: a config refusal (the job exits 2 on every rank, config_rejected),
    so a daemon stops the run instead of relaunching it into the same first step."""


def check_gathered(*params: torch.Tensor) -> None:
    for p in params:
        if p.numel() == 0:  # a ZeRO-3 partitioned weight that no hook gathered
            raise NotGatheredError("model.compile_blocks", [
                "model.compile_blocks reads each block's weights directly: under ZeRO-3 it needs "
                "train.zero3_leaf_blocks = true (a weight was still partitioned, 0 elements)"])
