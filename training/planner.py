"""Memory planner: will this run spec fit this cluster, and if not, what is the smallest change that would?

Pure arithmetic over the job spec (no torch, no DeepSpeed, no GPU): per-GPU and per-host breakdown of a
ZeRO-3 + Ulysses step of `training/model.py`'s GPT, a verdict with its margin, and a search over candidate
changes (more nodes, offload, SP degree, micro-batch, checkpointing, sequence length, bigger GPUs or more
host RAM) that re-plans each candidate and reports those that fit, cheapest first.
Formulas, their sources in DeepSpeed 0.19.8 and how they differ from DeepSpeed's own estimator:
docs/PLANNER.md.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .ds_config import MISPLACED_ZERO_KEYS, deep_merge, load_user_config
from .spec import JobSpec, ResolvedModel, SpecError

GiB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Allocator/driver overheads the peak of torch.cuda.max_memory_allocated() does not include.
ALLOCATOR_HEADROOM = 0.08   # caching-allocator fragmentation, fraction of the allocated peak (5-10 % seen)
CUDA_CONTEXT_GIB = 1.0      # CUDA context + NCCL/cuBLAS workspaces allocated outside the torch allocator
HOST_PER_RANK_GIB = 3.0     # RSS of one rank's process (torch, CUDA libs, DeepSpeed, data loader)
HOST_OS_RESERVE = 0.03      # fraction of host RAM left to the OS and page cache (at least 4 GiB)


class PlanInputError(ValueError):
    """The spec/cluster/ds_config cannot be planned (message names the offending key)."""


# ------------------------------------------------------------------------------------- cluster
@dataclass(frozen=True)
class Cluster:
    """The hardware a run is planned for."""

    gpus_per_node: int           # GPUs (= ranks) per node
    nodes: int = 1               # number of nodes
    gpu_mem_gib: float = 80.0    # device memory per GPU as torch reports it (total_memory / 2**30)
    host_mem_gib: float = 1024.0  # host RAM per node
    nvme_gib: float = 0.0        # NVMe capacity per node usable for ZeRO-Infinity swap (0 = none)
    gpu_name: str = ""           # label for reports

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes"):
            if getattr(self, key) < 1:
                raise PlanInputError(f"cluster.{key}={getattr(self, key)} must be >= 1")
        for key in ("gpu_mem_gib", "host_mem_gib"):
            if getattr(self, key) <= 0:
                raise PlanInputError(f"cluster.{key}={getattr(self, key)} must be > 0")
        if self.nvme_gib < 0:
            raise PlanInputError(f"cluster.nvme_gib={self.nvme_gib} must be >= 0")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        nvme = f", {self.nvme_gib:.0f} GiB NVMe" if self.nvme_gib else ""
        name = self.gpu_name or f"{self.gpu_mem_gib:.0f} GiB GPU"
        return (f"{self.nodes} node(s) x {self.gpus_per_node} x {name} ({self.gpu_mem_gib:.1f} GiB), "
                f"{self.host_mem_gib:.0f} GiB host RAM per node{nvme}")

    @classmethod
    def preset(cls, name: str, gpus_per_node: int = 8, nodes: int = 1, **overrides: Any) -> Cluster:
        """A named GPU (see GPU_PRESETS) with its usual host RAM; any field can be overridden."""
        if name not in GPU_PRESETS:
            raise PlanInputError(f"unknown GPU preset {name!r}; known: {', '.join(sorted(GPU_PRESETS))}")
        fields = dict(GPU_PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(gpus_per_node=gpus_per_node, nodes=nodes, **fields)


# Capacities are what torch reports as total_memory (A100-80GB: 79.18 GiB per the real OOM message in docs/DEEPSPEED_docs/DEEPSPEED_FACTS.md).
GPU_PRESETS: dict[str, dict[str, Any]] = {
    "a100-80g": dict(gpu_mem_gib=79.18, host_mem_gib=1024.0, gpu_name="A100-80GB"),
    "h100-80g": dict(gpu_mem_gib=79.11, host_mem_gib=2048.0, gpu_name="H100-80GB"),
    "h200-141g": dict(gpu_mem_gib=139.8, host_mem_gib=2048.0, gpu_name="H200-141GB"),
}


# -------------------------------------------------------------------------------- ZeRO settings
@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO-3 knobs that move memory, read from a DeepSpeed config (DeepSpeed 0.19.8 defaults)."""

    offload_optimizer: str = "none"          # none | cpu | nvme
    offload_param: str = "none"              # none | cpu | nvme
    pin_memory: bool = False                 # offloaded buffers are page-locked (cannot be swapped out)
    param_persistence_threshold: int = 100_000  # params with numel <= this stay gathered on every GPU
    model_persistence_threshold: int = sys.maxsize  # cap on the total numel of persistent params
    max_live_parameters: int = 1_000_000_000  # cap on gathered (unpartitioned) numel
    prefetch_bucket_size: int = 50_000_000    # numel gathered ahead of use
    reduce_bucket_size: int = 500_000_000     # numel of the gradient reduce bucket
    sub_group_size: int = 1_000_000_000       # optimizer-step granularity (fp32 grad copy per sub-group)
    overlap_comm: bool = True                 # stage-3 default; a second bucket is in flight
    grad_accum_dtype: str | None = None       # data_types.grad_accum_dtype; None = the model dtype
    optimizer_buffer_count: int = 4           # NVMe optimizer swap buffers
    param_buffer_count: int = 5               # NVMe param swap buffers
    param_buffer_size: int = 100_000_000      # numel per NVMe param swap buffer

    @classmethod
    def from_ds_config(cls, cfg: dict[str, Any] | None) -> ZeroSettings:
        cfg = cfg or {}
        zo = dict(cfg.get("zero_optimization", {}) or {})
        # ZeRO keys written at the top level (the seed's §5.2 snippet): build_ds_config moves them in the same way.
        for key, inner in MISPLACED_ZERO_KEYS.items():
            if key in cfg and inner not in zo:
                zo[inner] = cfg[key]
        stage = int(zo.get("stage", 3))
        if stage != 3:
            raise PlanInputError(f"deepspeed zero_optimization.stage={stage}: the planner models ZeRO stage 3 only")

        def num(*keys: str, default: int) -> int:
            for k in keys:
                if k in zo and zo[k] is not None:
                    return int(float(zo[k]))
            return default

        def device(key: str) -> str:
            sub = zo.get(key) or {}
            dev = str(sub.get("device", "none") or "none").lower()
            if dev not in ("none", "cpu", "nvme"):
                raise PlanInputError(f"zero_optimization.{key}.device={dev!r} must be none, cpu or nvme")
            return dev

        opt, par = device("offload_optimizer"), device("offload_param")
        pin = any(bool((zo.get(k) or {}).get("pin_memory", False)) for k in ("offload_optimizer", "offload_param"))
        gad = (cfg.get("data_types") or {}).get("grad_accum_dtype")
        if gad is not None:
            gad = {"float32": "fp32", "fp32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                   "fp16": "fp16", "float16": "fp16", "half": "fp16"}.get(str(gad).lower())
            if gad is None:
                raise PlanInputError(f"data_types.grad_accum_dtype={cfg['data_types']['grad_accum_dtype']!r} unknown")
        d = cls()
        return cls(
            offload_optimizer=opt, offload_param=par, pin_memory=pin,
            param_persistence_threshold=num("stage3_param_persistence_threshold", "param_persistence_threshold",
                                            default=d.param_persistence_threshold),
            model_persistence_threshold=num("stage3_model_persistence_threshold", "model_persistence_threshold",
                                            default=d.model_persistence_threshold),
            max_live_parameters=num("stage3_max_live_parameters", "max_live_parameters",
                                    default=d.max_live_parameters),
            prefetch_bucket_size=num("stage3_prefetch_bucket_size", "prefetch_bucket_size",
                                     default=d.prefetch_bucket_size),
            reduce_bucket_size=num("reduce_bucket_size", default=d.reduce_bucket_size),
            sub_group_size=num("sub_group_size", default=d.sub_group_size),
            overlap_comm=bool(zo.get("overlap_comm", True) if zo.get("overlap_comm") is not None else True),
            grad_accum_dtype=gad,
            optimizer_buffer_count=int((zo.get("offload_optimizer") or {}).get("buffer_count", 4)),
            param_buffer_count=int((zo.get("offload_param") or {}).get("buffer_count", 5)),
            param_buffer_size=int(float((zo.get("offload_param") or {}).get("buffer_size", 1e8))),
        )


def effective_ds_config(job: JobSpec) -> dict[str, Any]:
    """The user's base ds_config file (deepspeed.config_path) with the inline deepspeed.config merged over it
    (the job's own merge, `ds_config.load_user_config`)."""
    try:
        return load_user_config(job)[0]
    except SpecError as exc:
        raise PlanInputError(f"{exc.source}: {'; '.join(exc.problems)}") from None


# ---------------------------------------------------------------------------- model parameters
@dataclass(frozen=True)
class ParamShape:
    module: str   # owning module (DeepSpeed's "layer" for largest_layer_params)
    name: str     # full parameter name as in GPT.named_parameters()
    numel: int


def param_shapes(m: ResolvedModel) -> list[ParamShape]:
    """Parameters of training/model.py's GPT in named_parameters() order (checked against it in the tests)."""
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


def _backward_transient_per_token(m: ResolvedModel, d: int, sp: int) -> int:
    fin = (2 if m.mlp == "swiglu" else 1) * m.ffn_hidden_size
    staging = 4 * d * m.hidden_size if sp > 1 else 0   # all-to-all permute/contiguous copies
    if m.mlp_chunk_tokens:  # TiledMLP: the ffn-wide gradients exist for one chunk only (_mlp_chunk_transient)
        return d * 2 * m.hidden_size + staging
    return d * (2 * fin + 2 * m.hidden_size) + staging


def _mlp_chunk_transient(m: ResolvedModel, d: int, tokens: int) -> int:
    """TiledMLP in backward: one recomputed chunk's saved intermediates plus their gradients, 2·2·d·ffn_in per
    chunk token (GELU: fc_in output and GELU output; SwiGLU: the fused input, silu(gate) and the product)."""
    fin = (2 if m.mlp == "swiglu" else 1) * m.ffn_hidden_size
    return min(m.mlp_chunk_tokens, tokens) * 4 * d * fin


# ------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Item:
    name: str                 # what it is
    bytes: int                # per GPU (where=gpu) or per node (host, nvme)
    where: str                # gpu | host | nvme
    formula: str              # how it was computed
    phases: tuple[str, ...] = ("loss", "backward", "step")  # GPU phases during which it is allocated


PHASES = ("loss", "backward", "step")
PHASE_DOC = {"loss": "end of forward / start of backward (logits + loss alive)",
             "backward": "backward through the last checkpointed chunk (recomputed activations alive)",
             "step": "optimizer step (activations freed; GPU Adam: fp32 grad + temp of one sub-group)"}


@dataclass
class Suggestion:
    changes: list[str]                 # human-readable changes
    overrides: dict[str, Any]          # machine-readable: dotted spec/cluster keys -> new value
    cost: float                        # relative cost (see MOVE_COSTS); lower first
    gpu_required_gib: float
    host_required_gib: float
    nvme_required_gib: float
    gpu_margin_gib: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    cluster: Cluster
    zero: ZeroSettings
    summary: dict[str, Any]            # model/parallel/batch facts the plan used
    items: list[Item]
    phase_bytes: dict[str, int]        # allocated GPU bytes per phase
    gpu_peak_allocated: int            # predicted torch.cuda.max_memory_allocated() per GPU
    gpu_required: int                  # peak + allocator headroom + CUDA context
    host_required: int                 # per node
    nvme_required: int                 # per node
    fits: bool
    problems: list[str]
    notes: list[str]
    deepspeed_view: dict[str, int]     # model states in DeepSpeed's estimator accounting (for comparison)
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phase_bytes, key=lambda k: self.phase_bytes[k])

    @property
    def gpu_margin_gib(self) -> float:
        return self.cluster.gpu_mem_gib - self.gpu_required / GiB

    @property
    def host_margin_gib(self) -> float:
        return self.cluster.host_mem_gib - self.host_required / GiB

    def item(self, name: str) -> Item:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(name)

    def bytes_of(self, name: str) -> int:
        """Bytes of an item, 0 if this plan has no such item."""
        return next((it.bytes for it in self.items if it.name == name), 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "verdict": "fits" if self.fits else "does not fit",
            "cluster": asdict(self.cluster),
            "zero": {k: v for k, v in asdict(self.zero).items() if k != "model_persistence_threshold"},
            "summary": self.summary,
            "items": [{**asdict(it), "gib": it.bytes / GiB} for it in self.items],
            "phases_gib": {k: v / GiB for k, v in self.phase_bytes.items()},
            "peak_phase": self.peak_phase,
            "gpu_peak_allocated_gib": self.gpu_peak_allocated / GiB,
            "gpu_required_gib": self.gpu_required / GiB,
            "gpu_capacity_gib": self.cluster.gpu_mem_gib,
            "gpu_margin_gib": self.gpu_margin_gib,
            "host_required_gib": self.host_required / GiB,
            "host_capacity_gib": self.cluster.host_mem_gib,
            "host_margin_gib": self.host_margin_gib,
            "nvme_required_gib": self.nvme_required / GiB,
            "nvme_capacity_gib": self.cluster.nvme_gib,
            "problems": self.problems,
            "notes": self.notes,
            "deepspeed_view": self.deepspeed_view,
            "suggestions": [s.to_dict() for s in self.suggestions],
        }

    def render(self) -> str:
        s = self.summary
        lines = [
            f"Memory plan: {s['model']} ({s['params'] / 1e9:.2f}B params), {s['dtype']}, seq {s['seq_len']} "
            f"(SP {s['sp']} -> {s['seq_local']} tokens/GPU), micro-batch {s['micro_batch']}, "
            f"checkpointing {s['checkpointing']}",
            f"Cluster: {self.cluster.describe()}; ZeRO-3 over {s['zero_partitions']} GPUs (DP {s['dp']} x SP {s['sp']}); "
            f"offload optimizer={self.zero.offload_optimizer} param={self.zero.offload_param}",
            "",
            f"{'per GPU':<46} {'GiB':>9}  {'GB':>8}  phases            formula",
        ]
        for it in (i for i in self.items if i.where == "gpu"):
            ph = ",".join(it.phases) if it.phases != PHASES else "all"
            lines.append(f"  {it.name:<44} {it.bytes / GiB:9.2f}  {it.bytes / 1e9:8.2f}  {ph:<17} {it.formula}")
        for ph in PHASES:
            mark = "  <- peak" if ph == self.peak_phase else ""
            lines.append(f"  {'= allocated, ' + ph:<44} {self.phase_bytes[ph] / GiB:9.2f}  "
                         f"{self.phase_bytes[ph] / 1e9:8.2f}  {PHASE_DOC[ph]}{mark}")
        lines.append(f"  {'required (+headroom, CUDA context)':<44} {self.gpu_required / GiB:9.2f}  "
                     f"{self.gpu_required / 1e9:8.2f}  capacity {self.cluster.gpu_mem_gib:.2f} GiB, "
                     f"margin {self.gpu_margin_gib:+.2f} GiB")
        lines += ["", f"{'per host (node)':<46} {'GiB':>9}  {'GB':>8}"]
        for it in (i for i in self.items if i.where in ("host", "nvme")):
            tag = " [NVMe]" if it.where == "nvme" else ""
            lines.append(f"  {(it.name + tag):<44} {it.bytes / GiB:9.1f}  {it.bytes / 1e9:8.1f}  {it.formula}")
        lines.append(f"  {'required host RAM':<44} {self.host_required / GiB:9.1f}  {self.host_required / 1e9:8.1f}  "
                     f"capacity {self.cluster.host_mem_gib:.0f} GiB, margin {self.host_margin_gib:+.1f} GiB")
        if self.nvme_required:
            lines.append(f"  {'required NVMe':<44} {self.nvme_required / GiB:9.1f}  {self.nvme_required / 1e9:8.1f}  "
                         f"capacity {self.cluster.nvme_gib:.0f} GiB")
        lines += ["", "VERDICT: " + ("FITS" if self.fits else "DOES NOT FIT")]
        lines += [f"  - {p}" for p in self.problems]
        if self.notes:
            lines += ["Notes:"] + [f"  - {n}" for n in self.notes]
        if not self.fits:
            if self.suggestions:
                lines.append("Smallest changes that would fit (cheapest first; each re-planned):")
                for i, sg in enumerate(self.suggestions, 1):
                    lines.append(f"  {i}. {' + '.join(sg.changes)}  -> GPU {sg.gpu_required_gib:.1f} GiB "
                                 f"(margin {sg.gpu_margin_gib:+.1f}), host {sg.host_required_gib:.0f} GiB/node"
                                 + (f", NVMe {sg.nvme_required_gib:.0f} GiB/node" if sg.nvme_required_gib else "")
                                 + f"  [cost {sg.cost:g}]")
            else:
                lines.append("No candidate change found that fits.")
        return "\n".join(lines)


def _chunks(num_layers: int, k: int) -> list[int]:
    return [min(k, num_layers - s) for s in range(0, num_layers, k)]


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
        items.append(Item(f"checkpointed block inputs ({n_ck} blocks)", t * d * m.hidden_size * n_ck, "gpu",
                          f"b·s/sp·{n_ck}·{d}·h", FWD_BWD))
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
        items.append(Item("checkpointed chunk inputs", t * d * m.hidden_size * len(chunks), "gpu",
                          f"b·s/sp·{len(chunks)} chunks·{d}·h", FWD_BWD))
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
                      ("b·s/sp·d·2h" if m.mlp_chunk_tokens else "b·s/sp·d·(2·ffn_in + 2h)")
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


def _host_items(c: _Ctx, host_mem_gib: float) -> list[Item]:
    """Per-node host RAM and NVMe items."""
    z, shard, gpn, d, g = c.zero, c.shard, c.gpn, c.d, c.g
    items: list[Item] = []
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


def _compute(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any], *,
             allocator_headroom: float, cuda_context_gib: float) -> Plan:
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
             # ZeRO-3 partitions over DP x SP = all GPUs (mpu passed, docs/DEEPSPEED_FACTS.md).
             n=n, shard=math.ceil(st.total / n), gpn=cluster.gpus_per_node, sp=sp,
             tokens=job.train.micro_batch_size * (job.train.seq_len // sp))
    k = job.train.activation_checkpoint_every
    items = _model_state_items(c) + _activation_items(c, k, min(job.precision.fp32_layers, m.num_layers),
                                                      job.train.activation_checkpoint_layers,
                                                      job.train.loss_chunk_tokens)
    phase_bytes = {ph: sum(it.bytes for it in items if ph in it.phases) for ph in PHASES}
    peak = max(phase_bytes.values())
    required = int(peak * (1 + allocator_headroom) + cuda_context_gib * GiB)
    host = _host_items(c, cluster.host_mem_gib)
    host_required = sum(it.bytes for it in host if it.where == "host")
    nvme_required = sum(it.bytes for it in host if it.where == "nvme")
    items += host

    problems: list[str] = []
    if required > cluster.gpu_mem_gib * GiB:
        problems.append(
            f"GPU: needs {required / GiB:.1f} GiB per GPU (peak allocated {peak / GiB:.1f} GiB at "
            f"'{max(phase_bytes, key=lambda k: phase_bytes[k])}' + {allocator_headroom:.0%} allocator headroom + "
            f"{cuda_context_gib:g} GiB CUDA context) but the GPU has {cluster.gpu_mem_gib:.1f} GiB: "
            f"short by {required / GiB - cluster.gpu_mem_gib:.1f} GiB")
    if host_required > cluster.host_mem_gib * GiB:
        problems.append(
            f"host: needs {host_required / GiB:.0f} GiB ({host_required / 2**40:.2f} TiB) of RAM per node "
            f"but the node has {cluster.host_mem_gib:.0f} GiB: short by "
            f"{host_required / GiB - cluster.host_mem_gib:.0f} GiB")
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

    summary = {
        "model": job.model.preset or "custom", "params": st.total, "largest_module": st.largest_module,
        "largest_module_name": st.largest_module_name, "dtype": dtype, "seq_len": job.train.seq_len, "sp": sp,
        "seq_local": job.train.seq_len // sp, "micro_batch": job.train.micro_batch_size,
        "grad_accum": job.train.gradient_accumulation_steps,
        "checkpointing": "none" if k == 0 else ("every layer" if k == 1 else f"chunks of {k} blocks"),
        "activation_checkpoint_every": k, "zero_partitions": n, "dp": n // sp,
        "persistent_params": st.persistent, "world_size": n,
    }
    return Plan(cluster=cluster, zero=zero, summary=summary, items=items, phase_bytes=phase_bytes,
                gpu_peak_allocated=peak, gpu_required=required, host_required=host_required,
                nvme_required=nvme_required, fits=not problems, problems=problems, notes=notes,
                deepspeed_view=_deepspeed_view(c))


# ------------------------------------------------------------------------- suggestion search
@dataclass(frozen=True)
class _Scenario:
    job: JobSpec
    ds: dict[str, Any]
    cluster: Cluster


# Relative costs: slowdown or hardware spend, roughly "how much would an operator mind". Documented in PLANNER.md.
MOVE_COSTS = {"no_offload": 0.0, "ckpt_every_layer": 1.0, "halve_micro_batch": 1.0, "double_sp": 1.5, "offload_optimizer_cpu": 3.0,
              "more_host_ram": 3.0, "offload_param_cpu": 4.0, "bigger_gpu": 5.0, "nvme_offload": 6.0,
              "more_nodes_per_doubling": 3.0, "halve_seq": 8.0}


def _set_zero(ds: dict[str, Any], **kv: Any) -> dict[str, Any]:
    out = copy.deepcopy(ds)
    zo = out.setdefault("zero_optimization", {})
    zo.setdefault("stage", 3)
    for key, val in kv.items():
        zo[key] = deep_merge(zo.get(key) or {}, val) if isinstance(val, dict) else val
    return out


def _job_with(job: JobSpec, **changes: Any) -> JobSpec | None:
    data = job.model_dump()
    for dotted, val in changes.items():
        sec, key = dotted.split(".")
        data[sec][key] = val
    try:
        new = JobSpec.model_validate(data)
    except ValueError:
        return None
    return new


Move = Callable[[_Scenario, Plan], tuple[_Scenario, list[str], dict[str, Any], float] | None]


def _mv_ckpt(k: int) -> Move:
    # Megatron chunk semantics (training/model.py): k=1 is not always the smallest (it keeps L inputs).
    def mv(sc: _Scenario, base: Plan):
        if sc.job.train.activation_checkpoint_every == k:
            return None
        j = _job_with(sc.job, **{"train.activation_checkpoint_every": k})
        what = "every layer" if k == 1 else f"in chunks of {k} blocks"
        return j and (replace(sc, job=j), [f"activation checkpointing {what}"],
                      {"train.activation_checkpoint_every": k}, MOVE_COSTS["ckpt_every_layer"])
    return mv


def _mv_halve_mb(sc: _Scenario, base: Plan):
    b, ga = sc.job.train.micro_batch_size, sc.job.train.gradient_accumulation_steps
    if b < 2:
        return None
    j = _job_with(sc.job, **{"train.micro_batch_size": b // 2, "train.gradient_accumulation_steps": ga * 2})
    ch = {"train.micro_batch_size": b // 2, "train.gradient_accumulation_steps": ga * 2}
    return j and (replace(sc, job=j), [f"micro-batch {b} -> {b // 2} (grad accumulation {ga} -> {ga * 2})"], ch,
                  MOVE_COSTS["halve_micro_batch"])


def _mv_sp(factor: int) -> Move:
    def mv(sc: _Scenario, base: Plan):
        sp = sc.job.parallel.sequence_parallel_size * factor
        if sc.cluster.world_size % sp:
            return None
        j = _job_with(sc.job, **{"parallel.sequence_parallel_size": sp})
        return j and (replace(sc, job=j), [f"Ulysses SP {sp // factor} -> {sp}"],
                      {"parallel.sequence_parallel_size": sp}, MOVE_COSTS["double_sp"] * math.log2(factor))
    return mv


def _mv_seq(factor: int) -> Move:
    def mv(sc: _Scenario, base: Plan):
        s = sc.job.train.seq_len // factor
        j = _job_with(sc.job, **{"train.seq_len": s})
        return j and (replace(sc, job=j), [f"sequence length {s * factor} -> {s} (changes the experiment)"],
                      {"train.seq_len": s}, MOVE_COSTS["halve_seq"] * math.log2(factor))
    return mv


def _mv_offload(opt: str, par: str) -> Move:
    def mv(sc: _Scenario, base: Plan):
        z = ZeroSettings.from_ds_config(sc.ds)
        rank = {"none": 0, "cpu": 1, "nvme": 2}
        if rank[opt] <= rank[z.offload_optimizer] and rank[par] <= rank[z.offload_param]:
            return None
        new_opt = opt if rank[opt] > rank[z.offload_optimizer] else z.offload_optimizer
        new_par = par if rank[par] > rank[z.offload_param] else z.offload_param
        ds = _set_zero(sc.ds, offload_optimizer={"device": new_opt, "pin_memory": True})
        cost = 0.0
        changes: list[str] = []
        ov: dict[str, Any] = {}
        if new_opt != z.offload_optimizer:
            changes.append(f"offload optimizer to {new_opt}")
            ov["deepspeed.config.zero_optimization.offload_optimizer.device"] = new_opt
            cost += MOVE_COSTS["offload_optimizer_cpu"]
        if new_par != "none" and new_par != z.offload_param:
            ds = _set_zero(ds, offload_param={"device": new_par, "pin_memory": True})
            changes.append(f"offload parameters to {new_par}")
            ov["deepspeed.config.zero_optimization.offload_param.device"] = new_par
            cost += MOVE_COSTS["offload_param_cpu"]
        cluster = sc.cluster
        if "nvme" in (new_opt, new_par):
            cost += MOVE_COSTS["nvme_offload"]
            trial = _compute(sc.job, replace(cluster, nvme_gib=1e9), ds,
                             allocator_headroom=ALLOCATOR_HEADROOM, cuda_context_gib=CUDA_CONTEXT_GIB)
            need = math.ceil(trial.nvme_required / GiB / 512) * 512
            if need > cluster.nvme_gib:
                changes.append(f"NVMe >= {need} GiB per node")
                ov["cluster.nvme_gib"] = need
                cluster = replace(cluster, nvme_gib=float(need))
        return replace(sc, ds=ds, cluster=cluster), changes, ov, cost
    return mv


def _mv_no_offload(sc: _Scenario, base: Plan):
    # Taking offload away is faster (no PCIe traffic, GPU Adam) - worth showing when more GPUs make room.
    z = ZeroSettings.from_ds_config(sc.ds)
    if z.offload_optimizer == "none" and z.offload_param == "none":
        return None
    ds = copy.deepcopy(sc.ds)
    zo = ds.setdefault("zero_optimization", {})
    zo.pop("offload_optimizer", None)
    zo.pop("offload_param", None)
    ov = {"deepspeed.config.zero_optimization.offload_optimizer.device": "none",
          "deepspeed.config.zero_optimization.offload_param.device": "none"}
    return replace(sc, ds=ds), ["no offload (optimizer and params on the GPUs: faster steps)"], ov, \
        MOVE_COSTS["no_offload"]


def _mv_bigger_gpu(sc: _Scenario, base: Plan):
    big = GPU_PRESETS["h200-141g"]
    if sc.cluster.gpu_mem_gib >= big["gpu_mem_gib"]:
        return None
    cl = replace(sc.cluster, gpu_mem_gib=big["gpu_mem_gib"], gpu_name=big["gpu_name"],
                 host_mem_gib=max(sc.cluster.host_mem_gib, big["host_mem_gib"]))
    return (replace(sc, cluster=cl), [f"H200-141GB GPUs with {cl.host_mem_gib:.0f} GiB host RAM per node"],
            {"cluster.gpu": "h200-141g", "cluster.host_mem_gib": cl.host_mem_gib}, MOVE_COSTS["bigger_gpu"])


def _apply_host_ram(sc: _Scenario, plan_now: Plan):
    if plan_now.host_required <= sc.cluster.host_mem_gib * GiB:
        return None
    # Round up to a purchasable size (multiples of 512 GiB), then re-check the OS reserve that grows with it.
    need = math.ceil(plan_now.host_required / GiB / 512) * 512
    while need * (1 - HOST_OS_RESERVE) < (plan_now.host_required / GiB - max(4, HOST_OS_RESERVE * sc.cluster.host_mem_gib)):
        need += 512
    cl = replace(sc.cluster, host_mem_gib=float(need))
    return replace(sc, cluster=cl), [f"host RAM >= {need} GiB per node"], {"cluster.host_mem_gib": need}, \
        MOVE_COSTS["more_host_ram"]


_MOVE_GROUPS: list[list[Move]] = [
    [_mv_ckpt(1), _mv_ckpt(2)],
    [_mv_halve_mb],
    [_mv_sp(2), _mv_sp(4), _mv_sp(8)],
    [_mv_no_offload, _mv_offload("cpu", "none"), _mv_offload("cpu", "cpu"), _mv_offload("nvme", "none"), _mv_offload("nvme", "cpu"),
     _mv_offload("nvme", "nvme")],
    [_mv_bigger_gpu],
    [_mv_seq(2), _mv_seq(4)],
]
MAX_NODES = 64
MAX_SUGGESTIONS = 8


def _search(job: JobSpec, cluster: Cluster, ds: dict[str, Any], base: Plan, **kw: float) -> list[Suggestion]:
    found: list[tuple[float, frozenset[tuple[str, str]], Suggestion]] = []
    start = _Scenario(job, ds, cluster)
    changes: list[str]
    ov: dict[str, Any]
    for size in range(0, 4):
        for groups in itertools.combinations(range(len(_MOVE_GROUPS)), size):
            for moves in itertools.product(*(_MOVE_GROUPS[i] for i in groups)):
                sc, changes, ov, cost, ok = start, [], {}, 0.0, True
                for mv in moves:
                    out = mv(sc, base)
                    if out is None:
                        ok = False
                        break
                    sc, ch, o, c = out
                    changes, ov, cost = changes + ch, {**ov, **o}, cost + c
                if not ok:
                    continue
                for extra in (None, "nodes", "host", "nodes+host"):
                    res = _finish(sc, changes, ov, cost, extra, **kw)
                    if res is not None:
                        found.append(res)
    # Keep minimal candidates: drop any that a cheaper fitting one dominates.
    found.sort(key=lambda t: (t[0], t[2].gpu_required_gib))
    kept: list[Suggestion] = []
    for _cost, _keys, sg in found:
        if not any(_dominates(k.overrides, sg.overrides) for k in kept):
            kept.append(sg)
    return kept[:MAX_SUGGESTIONS]


def _dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """`a` (cheaper) makes `b` pointless: b makes every change a makes, with at least as much hardware
    (numeric cluster values >=) - unless b buys speed a lacks (taking offload away)."""
    speedup = {k for k, v in b.items() if v == "none"} - set(a)
    if speedup:
        return False
    for key, va in a.items():
        if key not in b:
            return False
        vb = b[key]
        if vb != va and not (key.startswith("cluster.") and isinstance(va, int | float)
                             and isinstance(vb, int | float) and vb >= va):
            return False
    return True


def _finish(sc: _Scenario, changes: list[str], ov: dict[str, Any], cost: float, extra: str | None,
            **kw: float) -> tuple[float, frozenset[tuple[str, str]], Suggestion] | None:
    def evaluate(s: _Scenario) -> Plan | None:
        try:
            return _compute(s.job, s.cluster, s.ds, **kw)
        except PlanInputError:
            return None

    changes, ov = list(changes), dict(ov)
    if extra in ("nodes", "nodes+host"):
        base_nodes = sc.cluster.nodes
        for nodes in range(base_nodes + 1, MAX_NODES + 1):
            trial = replace(sc, cluster=replace(sc.cluster, nodes=nodes))
            p = evaluate(trial)
            if p is None:
                continue
            gpu_ok = p.gpu_required <= trial.cluster.gpu_mem_gib * GiB
            host_ok = extra == "nodes+host" or p.host_required <= trial.cluster.host_mem_gib * GiB
            if gpu_ok and host_ok and p.nvme_required <= trial.cluster.nvme_gib * GiB:
                sc = trial
                changes.append(f"{nodes} nodes ({nodes * sc.cluster.gpus_per_node} GPUs) instead of {base_nodes}")
                ov["cluster.nodes"] = nodes
                cost += MOVE_COSTS["more_nodes_per_doubling"] * math.log2(nodes / base_nodes)
                break
        else:
            return None
    if extra in ("host", "nodes+host"):
        p = evaluate(sc)
        out = p and _apply_host_ram(sc, p)
        if not out:
            return None
        sc, ch, o, c = out
        changes, ov, cost = changes + ch, {**ov, **o}, cost + c
    if not changes:
        return None
    p = evaluate(sc)
    if p is None or not p.fits:
        return None
    keys = frozenset((k, repr(v)) for k, v in ov.items())
    sg = Suggestion(changes=changes, overrides=ov, cost=round(cost, 2), gpu_required_gib=round(p.gpu_required / GiB, 2),
                    host_required_gib=round(p.host_required / GiB, 1), nvme_required_gib=round(p.nvme_required / GiB, 1),
                    gpu_margin_gib=round(p.gpu_margin_gib, 2))
    return cost, keys, sg


# ------------------------------------------------------------------------------- public API
def plan(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any] | None = None, *, search: bool = True,
         allocator_headroom: float = ALLOCATOR_HEADROOM, cuda_context_gib: float = CUDA_CONTEXT_GIB) -> Plan:
    """Per-GPU/per-host memory plan of `job` on `cluster`, with a verdict and (if it does not fit and
    `search`) the cheapest changes that would fit. `ds_config` defaults to the spec's own DeepSpeed config
    (base file + inline); pass the job's effective config when you have it."""
    ds = effective_ds_config(job) if ds_config is None else ds_config
    kw = dict(allocator_headroom=allocator_headroom, cuda_context_gib=cuda_context_gib)
    result = _compute(job, cluster, ds, **kw)
    if search and not result.fits:
        result.suggestions = _search(job, cluster, ds, result, **kw)
    return result


def apply_overrides(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any],
                    overrides: dict[str, Any]) -> tuple[JobSpec, Cluster, dict[str, Any]]:
    """Apply a Suggestion's `overrides` (dotted keys: `train.*`, `parallel.*`, `deepspeed.config.*`,
    `cluster.*`) and return the changed (job, cluster, ds_config)."""
    data = job.model_dump()
    ds = copy.deepcopy(ds_config)
    for dotted, val in overrides.items():
        parts = dotted.split(".")
        if parts[0] == "cluster":
            if parts[1] == "gpu":
                cluster = Cluster.preset(val, cluster.gpus_per_node, cluster.nodes, host_mem_gib=cluster.host_mem_gib,
                                         nvme_gib=cluster.nvme_gib)
            else:
                cluster = replace(cluster, **{parts[1]: val})
            continue
        node = ds if parts[:2] == ["deepspeed", "config"] else data
        parts = parts[2:] if node is ds else parts
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = val
    return JobSpec.model_validate(data), cluster, ds


def predict_peak_gib(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any] | None = None) -> float:
    """Predicted steady-state `torch.cuda.max_memory_allocated()` of the worst rank over a training step
    (forward, backward, optimizer step), in GiB. Excludes what the caching allocator reserves beyond
    allocations and the CUDA context — compare with max_memory_allocated, not reserved or nvidia-smi."""
    return plan(job, cluster, ds_config, search=False).gpu_peak_allocated / GiB
