"""Pre-LayerNorm GPT decoder with rotary positions, written to run under ZeRO-3 and Ulysses.

- Every rank holds a sequence shard `[b, s/sp]`; rotary angles come from the GLOBAL position ids the
  data slicer supplies, so the math is identical to SP=1.
- LayerNorm, rotary angles, softmax and the loss are computed in fp32 whatever the parameter dtype.
- `fp32_layers=N`: the first N blocks upcast their input and weights and compute in fp32 (a remediation
  for unstable loss, seed 000 §6.3), then cast back.
- Activation checkpointing recomputes chunks of `checkpoint_every` blocks (Megatron semantics: only the
  chunk input is kept); torch's non-reentrant checkpoint cooperates with ZeRO-3's parameter hooks.
- `loss_chunk_tokens=N` tiles the head + fp32 cross-entropy over chunks of N local tokens, each chunk
  checkpointed, so the [tokens, V] fp32 logits of the whole local sequence never exist at once (the idea of
  DeepSpeed ALST's TiledFusedLogitsLoss).
- Speed levers (GPU, off by default, same math; bench/RESULTS.md "GPU: step speed on 1xH200"):
  `rotary_fused` compiles the q/k rotation into one kernel per tensor pass, `qkv_copy=false` hands v to
  attention as a strided view of the qkv output (SP=1), `checkpoint_keep_attention` makes checkpointed blocks
  keep the attention kernel's outputs so recompute skips the attention forward (torch selective checkpoint).
- `mlp_chunk_tokens=N` (long sequences) runs each block's MLP over checkpointed chunks of N local tokens.
- `compile_blocks` runs each block's work before and after attention as two inductor graphs (fused_block.py).
- `offload_checkpoints` (long sequences) moves each checkpointed chunk input to (pinned) host memory in
  forward and prefetches it back in backward (offload.py); `offload_keep_last` keeps the last N on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..spec import ResolvedModel
from . import fused_block
from .attention import UlyssesAttention
from .fused_block import apply_rotary, rotate_qk  # noqa: F401  (apply_rotary: this module's API)
from .offload import CheckpointInputOffloader, OffloadStats, first_forward_host_budget

log = logging.getLogger(__name__)


class _Linear(nn.Linear):
    """nn.Linear with GPT's normal(0, std) init (runs inside __init__, i.e. before zero.Init partitions)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, std: float):
        self._std = std
        super().__init__(n_in, n_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self._std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    # Only for fp32 blocks (weights upcast to the activation dtype). Reading `layer.weight` outside the
    # layer's own forward makes ZeRO-3 gather it synchronously as an "external parameter" with no
    # prefetch/overlap; the normal path calls the module (see Block._lin), whose hooks prefetch.
    w = layer.weight if layer.weight.dtype == x.dtype else layer.weight.to(x.dtype)
    b: torch.Tensor | None = layer.bias
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    return F.linear(x, w, b)


class LayerNorm32(nn.LayerNorm):
    """LayerNorm computed in fp32, output in the input's dtype.

    `fp32_copy=False` (GPU lever `model.norm_fp32_copy=false`): call the fused kernel on the half-precision
    input directly; CUDA's layer_norm accumulates mean/variance in fp32 internally, so only the saved
    input (half instead of an fp32 copy) and two cast kernels go away."""

    fp32_copy = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp32_copy and x.is_cuda and x.dtype == self.weight.dtype:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                            None if self.bias is None else self.bias.float(), self.eps).to(x.dtype)


class TokenEmbedding(nn.Module):
    """Input embedding; also the output head when tied (called through forward so ZeRO-3 gathers it)."""

    def __init__(self, vocab: int, hidden: int, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, x: torch.Tensor, as_head: bool = False) -> torch.Tensor:
        if as_head:
            return F.linear(x, self.weight.to(x.dtype))
        return F.embedding(x, self.weight)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[b, s, 1, head_dim/2]` in fp32 for absolute (global) positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                              dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [b, s, d/2]
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


@functools.cache
def _compiled_rotate_qk():
    # Eager, rotate_qk is ~8 kernels per tensor (fp32 upcast, chunk muls, cat, downcast) and as many in
    # backward; inductor fuses each pass into one kernel that keeps the fp32 math in registers. It touches
    # no parameters, so ZeRO-3's module hooks are not involved.
    return torch.compile(rotate_qk, fullgraph=True, dynamic=False)


# Kernels whose outputs a checkpointed block keeps under `checkpoint_keep_attention` (the fused SDPA ops;
# the math kernel is a chain of matmuls and softmax and is recomputed as usual).
_ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))


def _keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_contexts():
    return create_selective_checkpoint_contexts(_keep_attention_policy)


class Block(nn.Module):
    def __init__(self, cfg: ResolvedModel, attn: UlyssesAttention, fp32: bool, layer_index: int,
                 fp32_mode: str = "full"):
        super().__init__()
        h, f, std = cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std
        # GPT-2 style scaled init of the residual projections keeps deep stacks stable.
        out_std = std / math.sqrt(2 * cfg.num_layers)
        self.n_heads, self.head_dim, self.theta = cfg.num_attention_heads, cfg.head_dim, cfg.rope_theta
        self.fp32 = fp32
        # "residual": only the residual stream and the norms in fp32; see GPT's `fp32_mode`.
        self.fp32_residual_only = fp32_mode == "residual"
        self.layer_index = layer_index
        self.ln1 = LayerNorm32(h, bias=cfg.bias)
        self.qkv = _Linear(h, 3 * h, cfg.bias, std)
        self.proj = _Linear(h, h, cfg.bias, out_std)
        self.ln2 = LayerNorm32(h, bias=cfg.bias)
        self.swiglu = cfg.mlp == "swiglu"
        self.fc_in = _Linear(h, (2 if self.swiglu else 1) * f, cfg.bias, std)
        self.fc_out = _Linear(f, h, cfg.bias, out_std)
        self.attn = attn
        self.rotary_fused, self.qkv_copy = cfg.rotary_fused, cfg.qkv_copy or attn.sp_size > 1
        # TiledMLP: the MLP over chunks of this many local tokens, each checkpointed (0 = whole sequence).
        self.mlp_chunk_tokens = cfg.mlp_chunk_tokens
        self.compile_blocks = cfg.compile_blocks  # the work around attention through inductor (fused_block.py)

    def _lin(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        # Calling the module lets ZeRO-3's module hooks fetch (and prefetch) its weight; measured on
        # 2xH200 this is what overlaps parameter all-gathers with compute (bench/RESULTS.md).
        return _linear(x, layer) if self.fp32 and not self.fp32_residual_only else layer(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        tiled = self.mlp_chunk_tokens and torch.is_grad_enabled() and x.shape[0] * x.shape[1] > self.mlp_chunk_tokens
        if self.compile_blocks and not self.fp32 and not tiled:
            return self._compiled_forward(x, cos, sin)
        if self.fp32 and self.fp32_residual_only:
            return self._residual_fp32_forward(x, cos, sin, tiled)
        if self.fp32:
            x = x.float()
        b, s, _ = x.shape
        # One unbind for q, k and v: its backward stacks their three gradients into one qkv gradient.
        q, k, v = self._lin(self.ln1(x), self.qkv).view(b, s, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = (_compiled_rotate_qk() if self.rotary_fused and q.is_cuda else rotate_qk)(q, k, cos, sin)
        # Ulysses' all-to-all needs contiguous tensors; at SP=1 the SDPA kernels take v's strides as they
        # are (attention then keeps the whole qkv output alive for backward instead of a v copy: +2h/token).
        a = self.attn(q, k, v.contiguous() if self.qkv_copy else v).reshape(b, s, -1)
        x = x + self._lin(a, self.proj)
        hn = self.ln2(x)
        x = x + (self._tiled_mlp(hn, self.mlp_chunk_tokens) if tiled else self._mlp(hn))
        return x.to(in_dtype)

    def _residual_fp32_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tiled) -> torch.Tensor:
        """fp32 residual stream and LayerNorms; the matmuls and attention in the model's dtype. The sums that
        grow through depth and the normalisation statistics are where low precision hurts; the matmuls keep
        their tensor-core kernels and ZeRO-3's prefetching module calls."""
        dt = x.dtype
        r = x.float()
        b, s, _ = r.shape
        q, k, v = self.qkv(self.ln1(r).to(dt)).view(b, s, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = (_compiled_rotate_qk() if self.rotary_fused and q.is_cuda else rotate_qk)(q, k, cos, sin)
        a = self.attn(q, k, v.contiguous() if self.qkv_copy else v).reshape(b, s, -1)
        r = r + self.proj(a).float()
        hn = self.ln2(r).to(dt)
        r = r + (self._tiled_mlp(hn, self.mlp_chunk_tokens) if tiled else self._mlp(hn)).float()
        return r.to(dt)

    def _compiled_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # fp32 blocks and TiledMLP take the eager path (other dtypes / chunking: other graphs).
        pre, post = fused_block.compiled()
        ln1, ln2 = self.ln1, self.ln2
        fused_block.check_gathered(ln1.weight, self.qkv.weight, self.fc_out.weight)
        b, s, _ = x.shape
        q, k, v = pre(x, ln1.weight, ln1.bias, self.qkv.weight, self.qkv.bias, cos, sin, self.n_heads,
                      self.head_dim, ln1.eps, ln1.fp32_copy)
        a = self.attn(q, k, v.contiguous() if self.qkv_copy else v).reshape(b, s, -1)
        return post(x, a, self.proj.weight, self.proj.bias, ln2.weight, ln2.bias, self.fc_in.weight,
                    self.fc_in.bias, self.fc_out.weight, self.fc_out.bias, ln2.eps, ln2.fp32_copy, self.swiglu)

    def _mlp(self, hn: torch.Tensor) -> torch.Tensor:
        u = self._lin(hn, self.fc_in)
        if self.swiglu:
            gate, up = u.chunk(2, dim=-1)
            u = F.silu(gate) * up
        else:
            u = F.gelu(u, approximate="tanh")
        return self._lin(u, self.fc_out)

    def _tiled_mlp(self, hn: torch.Tensor, n: int) -> torch.Tensor:
        """The MLP `n` tokens at a time (DeepSpeed ALST's TiledMLP idea), each chunk checkpointed: only the
        chunk inputs (views of `hn`) are kept, and the [tokens, ffn] intermediates of one chunk exist at a
        time, in forward and when the chunk is recomputed in backward. Costs one more MLP forward."""
        flat = hn.reshape(-1, hn.shape[-1])
        out = [checkpoint(self._mlp, chunk, use_reentrant=False) for chunk in flat.split(n)]
        return torch.cat(out).view(hn.shape)


# precision.fp32_mode: what a block with fp32=True keeps in fp32 (training/spec.py PrecisionSpec).
FP32_MODES = ("full", "tf32", "residual")

# F.cross_entropy's default ignore_index: labels equal to it count neither in the loss nor in its mean.
IGNORE_INDEX = -100


class GPT(nn.Module):
    """Decoder-only LM; `forward(input_ids, position_ids, labels)` returns the mean token loss (fp32)."""

    def __init__(self, cfg: ResolvedModel, attention_backend: str = "sdpa", sp_group=None, sp_size: int = 1,
                 fp32_layers: int = 0, checkpoint_every: int = 0, checkpoint_layers: int | None = None,
                 loss_chunk_tokens: int = 0, fp32_mode: str = "full"):
        super().__init__()
        if loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 0 (0 = untiled loss)")
        self.cfg = cfg
        self.checkpoint_every = checkpoint_every
        # Tiled loss: head + fp32 cross-entropy over chunks of this many local tokens (0 = whole sequence).
        self.loss_chunk_tokens = loss_chunk_tokens
        # Per-sample loss for the per-source telemetry (the job sets it for multi-source data): each forward
        # then leaves (sum of token losses, count of labelled tokens) per sample, detached, in
        # `last_sample_loss`; the mean loss it returns is the same value.
        self.track_sample_loss = False
        self.last_sample_loss: tuple[torch.Tensor, torch.Tensor] | None = None
        self.logit_max: torch.Tensor | None = None   # the last forward's largest |logit| (`_note_logits`)
        if loss_chunk_tokens:
            log.info("tiled LM loss: head + fp32 cross-entropy over chunks of %d local tokens", loss_chunk_tokens)
        # Selective recompute: the first N blocks are checkpointed one by one, the rest keep activations.
        self.checkpoint_layers = checkpoint_layers
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std)
        # One attention wrapper shared by all blocks: it has no parameters.
        attn = UlyssesAttention(attention_backend, sp_group, sp_size)
        if fp32_mode not in FP32_MODES:
            raise ValueError(f"fp32_mode={fp32_mode!r} must be one of {FP32_MODES}")
        self.fp32_mode = fp32_mode
        if fp32_mode == "tf32":
            # TF32 tensor cores for fp32 matmuls (only the fp32 blocks run any): ~8x the fp32 SIMT rate on Hopper.
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.blocks = nn.ModuleList(Block(cfg, attn, i < fp32_layers, i, fp32_mode) for i in range(cfg.num_layers))
        self.ln_f = LayerNorm32(cfg.hidden_size, bias=cfg.bias)
        self.head = None if cfg.tie_embeddings else _Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.init_std)
        for mod in self.modules():
            if isinstance(mod, LayerNorm32):
                mod.fp32_copy = cfg.norm_fp32_copy
        # Block checkpoints: plain (recompute everything) or keeping the attention kernel's outputs.
        self._ckpt_kw: dict[str, Any] = {"use_reentrant": False}
        if cfg.checkpoint_keep_attention:
            self._ckpt_kw["context_fn"] = _keep_attention_contexts
        # What the last training forward offloaded to host (model.offload_checkpoints), None when off.
        self.last_offload: OffloadStats | None = None

    def _checkpoint(self, offloader: CheckpointInputOffloader | None, start: int, end: int, x, cos, sin):
        # The offloader's saved-tensor hooks wrap the checkpoint call itself: they see its saved inputs only.
        ctx = offloader.region(x) if offloader is not None else contextlib.nullcontext()
        with ctx:
            return checkpoint(self._run_chunk, start, end, x, cos, sin, **self._ckpt_kw)

    def set_fp32_layers(self, n: int) -> None:
        for blk in cast("list[Block]", self.blocks):
            blk.fp32 = blk.layer_index < n

    def _run_chunk(self, start: int, end: int, x, cos, sin):
        for blk in self.blocks[start:end]:
            x = blk(x, cos, sin)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # The head is called as a module (not F.linear on its weight) so ZeRO-3's hooks gather it, also
        # when a checkpointed loss chunk re-runs it in backward (see `_linear` on external parameters).
        return self.embed(x, as_head=True) if self.head is None else self.head(x)

    def _note_logits(self, logits: torch.Tensor) -> None:
        """The largest |logit| of this forward (early warning: logit growth comes before a blow-up), kept on the
        device (no sync); a checkpointed chunk's recompute in backward sees the same values (max: unchanged)."""
        m = logits.detach().abs().amax().float()
        self.logit_max = m if self.logit_max is None else torch.maximum(self.logit_max, m)

    def _chunk_loss_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self._logits(x)
        self._note_logits(logits)
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def _chunk_token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self._logits(x)
        self._note_logits(logits)
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")

    def _keep_sample_loss(self, token_loss: torch.Tensor, labels: torch.Tensor) -> None:
        b = labels.shape[0]
        self.last_sample_loss = (token_loss.detach().view(b, -1).sum(1),
                                 (labels != IGNORE_INDEX).view(b, -1).sum(1))

    def _tiled_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss computed `loss_chunk_tokens` tokens at a time: equal to the untiled mean up to
        fp32 summation order. Under autograd each chunk is checkpointed, so only one chunk's logits (and
        their fp32 copies and gradients) are alive at a time; the chunk inputs are views of `x`."""
        n = self.loss_chunk_tokens
        flat_x, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        recompute = self.training and torch.is_grad_enabled()
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        if self.track_sample_loss:
            parts = []
            for xc, yc in zip(flat_x.split(n), flat_labels.split(n), strict=True):
                tok = (checkpoint(self._chunk_token_losses, xc, yc, use_reentrant=False) if recompute
                       else self._chunk_token_losses(xc, yc))
                total = total + tok.sum()
                parts.append(tok.detach())
            self._keep_sample_loss(torch.cat(parts), labels)
            return total / (flat_labels != IGNORE_INDEX).sum()
        for xc, yc in zip(flat_x.split(n), flat_labels.split(n), strict=True):
            if recompute:
                part = checkpoint(self._chunk_loss_sum, xc, yc, use_reentrant=False)
            else:
                part = self._chunk_loss_sum(xc, yc)
            total = total + part
        # Same denominator as reduction="mean": the count of non-ignored labels (0 -> nan, as untiled).
        return total / (flat_labels != IGNORE_INDEX).sum()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.logit_max = None
        x = self.embed(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        n, k = len(self.blocks), self.checkpoint_every
        recompute = self.training and torch.is_grad_enabled()
        offloader = None
        if self.cfg.offload_checkpoints and recompute:
            # The first forward pins the host blocks: fail it with the numbers, not the OOM killer.
            offloader = CheckpointInputOffloader(
                host_budget=first_forward_host_budget() if self.last_offload is None else None)
        # model.offload_keep_last: the last N checkpointed chunks keep their inputs on the GPU (no offloader).
        keep = self.cfg.offload_keep_last
        if self.checkpoint_layers is not None and recompute:
            n_ck = min(self.checkpoint_layers, n)
            for i in range(n):
                if i < n_ck:
                    x = self._checkpoint(offloader if i < n_ck - keep else None, i, i + 1, x, cos, sin)
                else:
                    x = self.blocks[i](x, cos, sin)
        elif k > 0 and recompute:
            n_chunks = -(-n // k)
            for j, start in enumerate(range(0, n, k)):
                x = self._checkpoint(offloader if j < n_chunks - keep else None, start, min(n, start + k), x,
                                     cos, sin)
        else:
            x = self._run_chunk(0, n, x, cos, sin)
        if offloader is not None:
            if self.last_offload is None:
                log.info("offload_checkpoints: %d checkpointed block inputs, %.3f GiB to host per forward",
                         offloader.stats.tensors, offloader.stats.bytes / 2**30)
            self.last_offload = offloader.stats
        x = self.ln_f(x)
        if self.loss_chunk_tokens > 0:
            return self._tiled_loss(x, labels)
        logits = self._logits(x)
        self._note_logits(logits)
        if self.track_sample_loss:
            tok = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1),
                                  ignore_index=IGNORE_INDEX, reduction="none")
            self._keep_sample_loss(tok, labels)
            return tok.sum() / (labels != IGNORE_INDEX).sum()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
