"""The memory planner's cost model: parameter shapes and ZeRO-3 partition statistics of the built-in GPT,
activation bytes per token, and the per-GPU / per-host items of one plan (`compute_plan`). Formulas and
their sources in DeepSpeed 0.19.8: docs/PLANNER.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..spec import PRESETS, JobSpec, ResolvedModel
from .host_extras import NO_STANDBY, RestartLike, async_snapshot_items, host_problem, standby_items
from .inputs import (
    DTYPE_BYTES,
    HOST_OS_RESERVE,
    HOST_PER_RANK_GIB,
    Cluster,
    GiB,
    PlanInputError,
    ZeroSettings,
)
from .rendering import PHASES, Item, Plan
from .standby_gpu import STANDBY_GPU_OFF, standby_gpu_items, standby_gpu_notes


# ---------------------------------------------------------------------------- model parameters
@dataclass(frozen=True)
class ParamShape:
    module: str   # owning module (DeepSpeed's "layer" for largest_layer_params)
    name: str     # full parameter name as in GPT.named_parameters()
    numel: int


def param_shapes(m: ResolvedModel) -> list[ParamShape]:
    """Parameters of training/model/gpt.py's GPT in named_parameters() order (checked against it in the tests)."""
    h, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    fin = (2 if m.mlp == "swiglu" else 1) * f
    out = [ParamShape("embed", "embed.weight", v * h)]

    def linear(mod: str, n_in: int, n_out: int, bias: bool) -> None:
        out.append(ParamShape(mod, f"{mod}.weight", n_in * n_out))
        if bias:
            out.append(ParamShape(mod, f"{mod}.bias", n_out))

    def norm(mod: str) -> None:
        out.append(ParamShape(mod, f"{mod}.weight", h))
        if m.bias:
            out.append(ParamShape(mod, f"{mod}.bias", h))

    for i in range(m.num_layers):
        p = f"blocks.{i}"
        norm(f"{p}.ln1")
        linear(f"{p}.qkv", h, 3 * h, m.bias)
        linear(f"{p}.proj", h, h, m.bias)
        norm(f"{p}.ln2")
        linear(f"{p}.fc_in", h, fin, m.bias)
        linear(f"{p}.fc_out", f, h, m.bias)
    norm("ln_f")
    if not m.tie_embeddings:
        linear("head", h, v, False)
    return out


@dataclass(frozen=True)
class ModelStats:
    total: int               # P
    largest_module: int      # numel of the module with most direct params (DeepSpeed's largest_layer_params)
    largest_module_name: str
    persistent: int          # numel kept gathered on every GPU (param_persistence_threshold)
    persistent_count: int    # how many such tensors
    largest_gathered: int    # largest non-persistent module


def model_stats(m: ResolvedModel, zero: ZeroSettings) -> ModelStats:
    """Parameter counts the plan needs (cached: the suggestion search re-plans the same model many times)."""
    key = (m.hidden_size, m.num_layers, m.num_attention_heads, m.vocab_size, m.mlp, m.ffn_hidden_size,
           m.tie_embeddings, m.bias, zero.param_persistence_threshold, zero.model_persistence_threshold)
    if key not in _STATS_CACHE:
        if len(_STATS_CACHE) > 256:
            _STATS_CACHE.clear()
        _STATS_CACHE[key] = _model_stats(m, zero.param_persistence_threshold, zero.model_persistence_threshold)
    return _STATS_CACHE[key]


_STATS_CACHE: dict[tuple, ModelStats] = {}


def _model_stats(m: ResolvedModel, zero_thr: int, model_thr: int) -> ModelStats:
    shapes = param_shapes(m)
    per_module: dict[str, int] = {}
    for s in shapes:
        per_module[s.module] = per_module.get(s.module, 0) + s.numel
    # Same loop as DeepSpeed's DeepSpeedZeRoOffload.mark_persistent_parameters.
    persistent, count, persist_names = 0, 0, set()
    for s in shapes:
        if s.numel + persistent > model_thr:
            continue
        if s.numel <= zero_thr:
            persistent += s.numel
            count += 1
            persist_names.add(s.name)
    nonpersist_module: dict[str, int] = {}
    for s in shapes:
        if s.name not in persist_names:
            nonpersist_module[s.module] = nonpersist_module.get(s.module, 0) + s.numel
    name = max(per_module, key=lambda k: per_module[k])
    return ModelStats(total=sum(s.numel for s in shapes), largest_module=per_module[name], largest_module_name=name,
                      persistent=persistent, persistent_count=count,
                      largest_gathered=max(nonpersist_module.values(), default=0))


# ------------------------------------------------------------------------------ activations
def block_saved_bytes_per_token(m: ResolvedModel, d: int, sp: int = 1) -> int:
    """Bytes one Block keeps for backward per local token (flash/cuDNN attention: no s x s matrix).

    LayerNorm32 saves its fp32 input copy (+ mean/rstd) twice; qkv/fc_in/fc_out save their inputs; SDPA
    saves q, k, v, out + an fp32 logsumexp per head. With SP=1 the proj input is a view of SDPA's output
    (flash kernels allocate it [b, s, h, d]); with Ulysses it is the all-to-all's new tensor, saved apart.
    GELU saves its input; SwiGLU its fused input, silu(gate) and the product. Checked on the CPU against
    torch's saved-tensor hooks (tests/planner/test_planner_activations.py). `model.norm_fp32_copy = false`
    (GPU only; the CPU always copies) saves the half-precision LayerNorm input instead of an fp32 copy.
    """
    h, f, a = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    layernorms = 2 * (_norm_input_bytes(m, d) * h + 8)
    # `model.qkv_copy = false` (SP=1): attention saves v as a view, which keeps the whole [tokens, 3h] qkv
    # output alive instead of a [tokens, h] copy of v.
    v_view = 2 * h if not m.qkv_copy and sp == 1 else 0
    attention = d * (h + 3 * h + v_view + h + (h if sp > 1 else 0)) + 4 * a
    mlp = d * h + (2 * d * f if m.mlp == "gelu" else 4 * d * f)
    if m.mlp_chunk_tokens:
        # model.mlp_chunk_tokens (TiledMLP): each chunk is checkpointed; only its input (a view of the
        # LayerNorm output) is kept, the [tokens, ffn] intermediates are recomputed chunk by chunk.
        mlp = d * h
    return layernorms + attention + mlp


def _norm_input_bytes(m: ResolvedModel, d: int) -> int:
    """Bytes per element of the input a LayerNorm saves: its fp32 copy, or with `model.norm_fp32_copy = false`
    (GPU) the half-precision input itself (measured on 2xH200: the shipped gpt-7b config, bench/RESULTS.md)."""
    return 4 if m.norm_fp32_copy else d


# Attention's backward, per local token in units of d·h: the residual and output gradients (2) plus 3 more
# (q, k and v's gradients beside their stacked qkv gradient). Measured on one H200 with cuDNN attention:
# gpt-1b blocks with TiledMLP, 128K-1M tokens, the peak above the planner's former 2·d·h was 3·d·h per token
# at 128K and 256K, 3.75 at 1M (bench/gpu_act_mem.py, bench/RESULTS.md device call 21).
ATTENTION_BACKWARD_H = 5


def _backward_transient_per_token(m: ResolvedModel, d: int, sp: int) -> int:
    fin = (2 if m.mlp == "swiglu" else 1) * m.ffn_hidden_size
    staging = 4 * d * m.hidden_size if sp > 1 else 0   # all-to-all permute/contiguous copies
    attention = d * ATTENTION_BACKWARD_H * m.hidden_size
    if m.mlp_chunk_tokens:  # TiledMLP: the ffn-wide gradients exist for one chunk only (_mlp_chunk_transient)
        return attention + staging
    # Untiled, the MLP's backward (ffn-wide gradients) and attention's come one after the other: the larger.
    return max(d * (2 * fin + 2 * m.hidden_size), attention) + staging


def _mlp_chunk_transient(m: ResolvedModel, d: int, tokens: int) -> int:
    """TiledMLP in backward: one recomputed chunk's saved intermediates plus their gradients, 2·2·d·ffn_in per
    chunk token (GELU: fc_in output and GELU output; SwiGLU: the fused input, silu(gate) and the product)."""
    fin = (2 if m.mlp == "swiglu" else 1) * m.ffn_hidden_size
    return min(m.mlp_chunk_tokens, tokens) * 4 * d * fin


def _chunks(num_layers: int, k: int) -> list[int]:
    return [min(k, num_layers - s) for s in range(0, num_layers, k)]


# model.offload_checkpoints: chunk inputs on the GPU at once besides the host copies: in forward, the copies
# not yet done (CheckpointInputOffloader.max_in_flight = 2); in backward, the chunk being recomputed and the
# previous one being prefetched (training/model/offload.py).
OFFLOAD_IN_FLIGHT = 2


def _pinned_block(nbytes: int) -> int:
    """torch's CUDA caching host allocator rounds every pinned allocation up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


def checkpointed_inputs(c_tokens: int, m: ResolvedModel, d: int, k: int, ck_layers: int | None) -> tuple[int, int]:
    """(how many checkpointed chunk inputs one forward keeps, bytes of each: b·s/sp·h·d)."""
    if ck_layers is not None:
        count = min(ck_layers, m.num_layers)
    else:
        count = len(_chunks(m.num_layers, k)) if k > 0 else 0
    return count, c_tokens * m.hidden_size * d


@dataclass(frozen=True)
class _Ctx:
    """Quantities every item formula needs."""

    m: ResolvedModel
    zero: ZeroSettings
    st: ModelStats
    dtype: str
    d: int          # model dtype bytes
    g: int          # gradient accumulation dtype bytes
    n: int          # ZeRO partitions (all GPUs)
    shard: int      # ceil(P / N)
    gpn: int        # GPUs per node
    sp: int
    tokens: int     # local tokens per micro-batch: b·s/sp


FWD_BWD = ("loss", "backward")


def _model_state_items(c: _Ctx) -> list[Item]:
    z, st, d, g, shard = c.zero, c.st, c.d, c.g, c.shard
    items: list[Item] = []
    if z.offload_param == "none":
        items.append(Item(f"{c.dtype} parameter shard", d * shard, "gpu", f"{d}·P/N = {d}·{st.total:,}/{c.n}"))
    if z.offload_optimizer == "none":
        gname = z.grad_accum_dtype or c.dtype
        items.append(Item(f"gradient partition ({gname})", g * shard, "gpu", f"{g}·P/N (grad_accum_dtype)"))
        items.append(Item("fp32 master + Adam m, v", 12 * shard, "gpu", "12·P/N"))
        # _prepare_fp32_grad_for_sub_group makes an fp32 copy of the sub-group's gradient; torch AdamW
        # (foreach) adds one more fp32 temporary (sqrt of v) of the same size during the step.
        items.append(Item("fp32 grad + AdamW temp of one sub-group", 8 * min(z.sub_group_size, shard), "gpu",
                          f"8·min(sub_group_size={z.sub_group_size:.0e}, P/N)", ("step",)))
    items.append(Item("persistent params (below threshold)", d * st.persistent, "gpu",
                      f"{d}·{st.persistent:,} ({st.persistent_count} tensors <= "
                      f"{z.param_persistence_threshold:.0e} numel, unpartitioned)"))
    gathered = min(st.total - st.persistent,
                   max(st.largest_gathered, min(z.max_live_parameters, st.largest_gathered + z.prefetch_bucket_size)))
    items.append(Item("gathered params (live + prefetch)", d * gathered, "gpu",
                      f"{d}·min(max_live={z.max_live_parameters:.0e}, largest module {st.largest_gathered:,} "
                      f"+ prefetch {z.prefetch_bucket_size:.0e})", FWD_BWD))
    items.append(Item("full grad of module being reduced", d * st.largest_gathered, "gpu",
                      f"{d}·largest module ({st.largest_module_name})", FWD_BWD))
    buckets = (2 if z.overlap_comm else 1) * min(z.reduce_bucket_size, st.total)
    items.append(Item("reduce bucket(s)", d * buckets, "gpu", f"{d}·reduce_bucket_size={z.reduce_bucket_size:.0e}"
                      + (" x2 (overlap_comm)" if z.overlap_comm else "")))
    return items


def _activation_items(c: _Ctx, k: int, fp32_layers: int, ck_layers: int | None = None,
                      loss_chunk: int = 0) -> list[Item]:
    m, d, t = c.m, c.d, c.tokens
    if m.mlp_chunk_tokens >= t:  # a sequence no longer than one MLP chunk runs untiled
        m = m.model_copy(update={"mlp_chunk_tokens": 0})
    L = m.num_layers
    blk = [block_saved_bytes_per_token(m, 4 if i < fp32_layers else d, c.sp) for i in range(L)]
    items: list[Item] = []
    if ck_layers is not None:
        # Selective recompute (train.activation_checkpoint_layers = N): the first N blocks keep only their
        # input and are recomputed one at a time; the other L - N blocks keep everything autograd saves.
        n_ck = min(ck_layers, L)
        items.append(_chunk_inputs_item(m, f"checkpointed block inputs ({n_ck} blocks)", n_ck, t * d * m.hidden_size,
                                        f"b·s/sp·{n_ck}·{d}·h"))
        items.append(Item(f"activations of {L - n_ck} uncheckpointed blocks", t * sum(blk[n_ck:]), "gpu",
                          f"b·s/sp·{L - n_ck}·{blk[-1]} B/token", FWD_BWD))
        if n_ck:
            items.append(Item("recomputed block (1 block)", t * max(blk[:n_ck]), "gpu",
                              f"b·s/sp·{blk[0]} B/token", ("backward",)))
    elif k == 0:
        items.append(Item("activations, all blocks (no checkpointing)", t * sum(blk), "gpu",
                          f"b·s/sp·L·{blk[-1]} B/token", FWD_BWD))
    else:
        chunks = _chunks(L, k)
        items.append(_chunk_inputs_item(m, "checkpointed chunk inputs", len(chunks), t * d * m.hidden_size,
                                        f"b·s/sp·{len(chunks)} chunks·{d}·h"))
        items.append(Item(f"recomputed chunk ({max(chunks)} block(s))",
                          t * max(sum(blk[i:i + k]) for i in range(0, L, k)), "gpu",
                          f"b·s/sp·{max(chunks)}·{blk[-1]} B/token", ("backward",)))
    n_kept = (0 if k == 0 else L) if ck_layers is None else min(ck_layers, L)
    if m.checkpoint_keep_attention and n_kept:
        # model.checkpoint_keep_attention: each checkpointed block also keeps its attention kernel's output
        # (d·h per local token, [b, s/sp, h] or Ulysses' [b, s, h/sp]) and fp32 logsumexp (4 per head).
        items.append(Item(f"kept attention outputs ({n_kept} checkpointed blocks)",
                          t * n_kept * (d * m.hidden_size + 4 * m.num_attention_heads), "gpu",
                          f"b·s/sp·{n_kept}·(d·h + 4·heads)", FWD_BWD))
    items.append(Item("block backward transients", t * _backward_transient_per_token(m, d, c.sp), "gpu",
                      (f"b·s/sp·d·{ATTENTION_BACKWARD_H}h (attention backward)" if m.mlp_chunk_tokens
                       else f"b·s/sp·d·max(2·ffn_in + 2h, {ATTENTION_BACKWARD_H}h)")
                      + (" + all-to-all staging 4·d·h" if c.sp > 1 else ""), ("backward",)))
    if m.mlp_chunk_tokens:
        items.append(Item("TiledMLP chunk in backward", _mlp_chunk_transient(m, d, t), "gpu",
                          f"min(N={m.mlp_chunk_tokens}, b·s/sp)·4·d·ffn_in (one recomputed chunk + its grads)",
                          ("backward",)))
    nb = _norm_input_bytes(m, d)
    items.append(Item("final norm + head inputs", t * (nb * m.hidden_size + 8 + d * m.hidden_size), "gpu",
                      f"b·s/sp·({nb}h + d·h)", ("loss",)))
    if loss_chunk > 0:
        # train.loss_chunk_tokens = N: one checkpointed chunk of N tokens at a time (recomputed in backward).
        # Its inputs are views of the head input counted in the item above, so nothing else is kept.
        items.append(Item("logits + fp32 loss", min(loss_chunk, t) * 12 * m.vocab_size, "gpu",
                          f"min(N={loss_chunk}, b·s/sp)·12·V (tiled: one chunk's fp32 log-softmax out + its grad "
                          "+ grad input, recomputed in backward)", ("loss",)))
    else:
        items.append(Item("logits + fp32 loss", t * 12 * m.vocab_size, "gpu",
                          "b·s/sp·12·V (fp32 log-softmax out + its grad + grad input; untiled)", ("loss",)))
    items.append(Item("inputs, labels, rotary tables", t * (24 + 4 * m.head_dim), "gpu",
                      "b·s/sp·(3·8 + 4·head_dim)", FWD_BWD))
    return items


def _chunk_inputs_item(m: ResolvedModel, name: str, count: int, each: int, formula: str) -> Item:
    if not m.offload_checkpoints:
        return Item(name, count * each, "gpu", formula, FWD_BWD)
    # model.offload_checkpoints: the inputs live on the host; only those in flight are on the GPU, besides
    # the last model.offload_keep_last chunks, which are never offloaded (backward needs them first).
    keep = min(m.offload_keep_last, count)
    live = min(count, keep + OFFLOAD_IN_FLIGHT)
    kept = f"{keep} kept + " if keep else ""
    return Item(f"{name}, {kept}in flight ({live} of {count}; the rest offloaded to host)", live * each, "gpu",
                f"min({count}, {keep} kept + {OFFLOAD_IN_FLIGHT})·b·s/sp·d·h (offload_checkpoints)", FWD_BWD)


def _host_items(c: _Ctx, host_mem_gib: float, offloaded: tuple[int, int] = (0, 0)) -> list[Item]:
    """Per-node host RAM and NVMe items of the training step; `offloaded` = (count, bytes) of the checkpointed
    inputs one rank offloads (model.offload_checkpoints). Async saves and the standby: host_extras."""
    z, shard, gpn, d, g = c.zero, c.shard, c.gpn, c.d, c.g
    items: list[Item] = []
    count, each = offloaded
    if count:
        items.append(Item("offloaded checkpointed inputs (pinned)", count * _pinned_block(each) * gpn, "host",
                          f"{count}·pow2ceil(b·s/sp·d·h = {each:,} B)·gpus_per_node (pinned: the OS cannot swap "
                          "it; torch rounds pinned blocks up to a power of two)",
                          off="model.offload_checkpoints = false, or a larger model.offload_keep_last (the "
                              "inputs then stay on the GPU)"))
    if z.offload_optimizer == "cpu":
        items.append(Item("fp32 master + Adam m, v (offloaded)", 12 * shard * gpn, "host", "12·P/N·gpus_per_node"))
        items.append(Item("fp32 gradient partitions (offload)", 4 * shard * gpn, "host", "4·P/N·gpus_per_node"))
    elif z.offload_optimizer == "nvme":
        items.append(Item("fp32 master + m, v + fp32 grads (swapped)", 16 * shard * gpn, "nvme",
                          "16·P/N·gpus_per_node"))
        items.append(Item("optimizer swap buffers (pinned)",
                          4 * z.optimizer_buffer_count * min(z.sub_group_size, shard) * gpn, "host",
                          "4·buffer_count·min(sub_group_size, P/N)·gpus_per_node"))
    if z.offload_optimizer != "none":
        # DeepSpeed puts the gradient partition buffer on self.device, which is the CPU under offload.
        items.append(Item(f"gradient partition ({z.grad_accum_dtype or c.dtype}) on host", g * shard * gpn,
                          "host", f"{g}·P/N·gpus_per_node"))
    if z.offload_param == "cpu":
        items.append(Item(f"{c.dtype} parameter shard (offloaded)", d * shard * gpn, "host", f"{d}·P/N·gpus_per_node"))
    elif z.offload_param == "nvme":
        items.append(Item(f"{c.dtype} parameter shard (swapped)", d * shard * gpn, "nvme", f"{d}·P/N·gpus_per_node"))
        items.append(Item("param swap buffers (pinned)", d * z.param_buffer_count * z.param_buffer_size * gpn,
                          "host", "d·buffer_count·buffer_size·gpus_per_node"))
    items.append(Item("rank processes (torch, CUDA libs, loader)", int(HOST_PER_RANK_GIB * GiB) * gpn, "host",
                      f"{HOST_PER_RANK_GIB:g} GiB·gpus_per_node"))
    items.append(Item("OS reserve", int(max(4 * GiB, HOST_OS_RESERVE * host_mem_gib * GiB)), "host",
                      f"max(4 GiB, {HOST_OS_RESERVE:.0%} of RAM)"))
    return items


def _deepspeed_view(c: _Ctx) -> dict[str, int]:
    """Our components in the accounting of DeepSpeed's estimate_zero3_model_states_mem_needs: fp16 params
    (2 B) + gradients counted as fp32 (4 B) + optimizer (12 B) per param, + 4·largest layer on the GPU.
    The host figure is before its additional_buffer_factor (1.5), which the caller applies."""
    z, shard, ll = c.zero, c.shard, c.st.largest_module
    gpu = 4 * ll + (2 * shard if z.offload_param == "none" else 0)
    if z.offload_optimizer == "none":
        gpu += 12 * shard + 4 * shard
        cpu = 4 * ll * c.gpn
    else:
        cpu = (12 + 4) * shard * c.gpn + (2 * shard * c.gpn if z.offload_param != "none" else 0)
    return {"total_params": c.st.total, "largest_layer_params": ll, "gpu_bytes": gpu,
            "cpu_bytes_per_node_unbuffered": cpu}


def compute_plan(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any], *,
             allocator_headroom: float, cuda_context_gib: float, restart: RestartLike = NO_STANDBY) -> Plan:
    m = job.resolved_model()
    zero = ZeroSettings.from_ds_config(ds_config)
    sp = job.parallel.sequence_parallel_size
    n = cluster.world_size
    if n % sp:
        raise PlanInputError(f"cluster world size {n} (nodes x gpus_per_node) is not divisible by "
                             f"parallel.sequence_parallel_size={sp}")
    problems_in = job.cross_problems()
    if problems_in:
        raise PlanInputError("; ".join(problems_in))
    dtype = job.precision.dtype
    st = model_stats(m, zero)
    c = _Ctx(m=m, zero=zero, st=st, dtype=dtype, d=DTYPE_BYTES[dtype], g=DTYPE_BYTES[zero.grad_accum_dtype or dtype],
             # ZeRO-3 partitions over DP x SP = all GPUs (mpu passed, docs/DEEPSPEED_NOTES.md).
             n=n, shard=math.ceil(st.total / n), gpn=cluster.gpus_per_node, sp=sp,
             tokens=job.train.micro_batch_size * (job.train.seq_len // sp))
    k = job.train.activation_checkpoint_every
    items = _model_state_items(c) + _activation_items(c, k, min(job.precision.fp32_layers, m.num_layers),
                                                      job.train.activation_checkpoint_layers,
                                                      job.train.loss_chunk_tokens)
    phase_bytes = {ph: sum(it.bytes for it in items if ph in it.phases) for ph in PHASES}
    peak = max(phase_bytes.values())
    # Other processes on the same GPU (the warm standby): no allocator headroom, not in the job's peak.
    others = standby_gpu_items(restart)
    others_bytes = sum(it.bytes for it in others)
    required = int(peak * (1 + allocator_headroom) + cuda_context_gib * GiB) + others_bytes
    items += others
    offloaded = (checkpointed_inputs(c.tokens, m, c.d, k, job.train.activation_checkpoint_layers)
                 if m.offload_checkpoints else (0, 0))
    offloaded = (max(0, offloaded[0] - m.offload_keep_last), offloaded[1])   # model.offload_keep_last stay on GPU
    host = (async_snapshot_items(c.shard, c.gpn, zero, async_save=job.checkpoint.async_save,
                                 snapshot_pool=job.checkpoint.snapshot_pool)
            + standby_items(c.shard, c.gpn, restart) + _host_items(c, cluster.host_mem_gib, offloaded))
    host_required = sum(it.bytes for it in host if it.where == "host")
    nvme_required = sum(it.bytes for it in host if it.where == "nvme")
    items += host

    problems: list[str] = []
    if required > cluster.gpu_mem_gib * GiB:
        problems.append(
            f"GPU: needs {required / GiB:.1f} GiB per GPU (peak allocated {peak / GiB:.1f} GiB at "
            f"'{max(phase_bytes, key=lambda k: phase_bytes[k])}' + {allocator_headroom:.0%} allocator headroom + "
            f"{cuda_context_gib:g} GiB CUDA context"
            + "".join(f" + {it.bytes / GiB:.2f} GiB {it.name}" for it in others)
            + f") but the GPU has {cluster.gpu_mem_gib:.1f} GiB: "
            f"short by {required / GiB - cluster.gpu_mem_gib:.1f} GiB"
            + (f"; {STANDBY_GPU_OFF} frees {others_bytes / GiB:.2f} GiB per GPU" if others else ""))
    host_short = host_problem(host, cluster.host_mem_gib)
    if host_short:
        problems.append(host_short)
    if nvme_required > cluster.nvme_gib * GiB:
        problems.append(f"NVMe: needs {nvme_required / GiB:.0f} GiB per node for ZeRO-Infinity swap but the node "
                        f"has {cluster.nvme_gib:.0f} GiB")
    notes: list[str] = []
    if zero.offload_param != "none" and zero.offload_optimizer == "none":
        notes.append("offload_param without offload_optimizer is unusual; the optimizer states stay on the GPU")
    if zero.offload_optimizer != "none" and zero.pin_memory:
        notes.append("pin_memory: offloaded buffers are page-locked; the OS cannot swap them, so host RAM must "
                     "really hold them")
    if job.parallel.world_size is not None and job.parallel.world_size != n:
        notes.append(f"parallel.world_size={job.parallel.world_size} differs from the cluster's {n} GPUs; "
                     f"planned for {n}")
    if "sparse_attention" in ds_config:
        notes.append("ds_config sparse_attention is ignored: the model uses dense flash/cuDNN attention")
    notes.append("attention memory is linear in sequence length (flash/cuDNN SDPA keeps no s x s matrix)")
    notes += standby_gpu_notes(restart, n)

    summary = {
        "model": _label(job), "params": st.total, "largest_module": st.largest_module,
        "largest_module_name": st.largest_module_name, "dtype": dtype, "seq_len": job.train.seq_len, "sp": sp,
        "seq_local": job.train.seq_len // sp, "micro_batch": job.train.micro_batch_size,
        "grad_accum": job.train.gradient_accumulation_steps,
        "checkpointing": "none" if k == 0 else ("every layer" if k == 1 else f"chunks of {k} blocks"),
        "activation_checkpoint_every": k, "zero_partitions": n, "dp": n // sp,
        "persistent_params": st.persistent, "world_size": n,
        "offload_checkpoints": m.offload_checkpoints, "offloaded_checkpoint_bytes_per_rank": offloaded[0] * offloaded[1],
    }
    return Plan(cluster=cluster, zero=zero, summary=summary, items=items, phase_bytes=phase_bytes,
                gpu_peak_allocated=peak, gpu_required=required, host_required=host_required,
                nvme_required=nvme_required, fits=not problems, problems=problems, notes=notes,
                deepspeed_view=_deepspeed_view(c))


def _label(job: JobSpec) -> str:
    """The preset's name when its dimensions are kept, else "custom" (explicit dims over the default preset)."""
    m, presets = job.model, PRESETS
    if m.preset is None or any(getattr(m, k) not in (None, presets[m.preset].get(k)) for k in
                               ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size")):
        return "custom"
    return m.preset
