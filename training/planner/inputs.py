"""What the memory planner plans against: the cluster, the ZeRO-3 settings read from the DeepSpeed config,
the allocator/driver overheads, and the error for input it cannot plan.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

from ulyssesd.remediation.job import ZERO3_DEFAULTS

from ..ds_config import MISPLACED_ZERO_KEYS, ZERO_STAGE, load_user_config
from ..spec import JobSpec, SpecError

GiB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Allocator/driver overheads the peak of torch.cuda.max_memory_allocated() does not include.
ALLOCATOR_HEADROOM = 0.08   # caching-allocator fragmentation, fraction of the allocated peak (5-10 % seen)
EXPANDABLE_HEADROOM = 0.03  # the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)
CUDA_CONTEXT_GIB = 1.0      # CUDA context + NCCL/cuBLAS workspaces allocated outside the torch allocator
HOST_PER_RANK_GIB = 3.0     # RSS of one rank's process (torch, CUDA libs, DeepSpeed, data loader)
HOST_OS_RESERVE = 0.03      # fraction of host RAM left to the OS and page cache (at least 4 GiB)


#: Benchmarks only: a bigger GPU made to behave as a smaller one (an H200 standing in for an 80 GB H100). The job
#: caps its allocator there (training/train.py `cap_gpu_memory`); the planner of the same host plans for the cap.
GPU_MEMORY_CAP_ENV = "ULYSSESD_GPU_MEMORY_CAP_GIB"


def gpu_memory_cap_gib(environ: Any = None) -> float | None:
    """The cap of GPU_MEMORY_CAP_ENV in GiB, None when unset or not a positive number."""
    import os

    raw = (os.environ if environ is None else environ).get(GPU_MEMORY_CAP_ENV)
    try:
        cap = float(raw) if raw else None
    except ValueError:
        return None
    return cap if cap and cap > 0 else None


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
    origin: str = ""             # where the figures come from (measured on this host, given, or assumed)

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

    def with_origin(self, origin: str) -> Cluster:
        return replace(self, origin=origin)

    @classmethod
    def preset(cls, name: str, gpus_per_node: int = 8, nodes: int = 1, **overrides: Any) -> Cluster:
        """A named GPU (see GPU_PRESETS) with its usual host RAM; any field can be overridden."""
        if name not in GPU_PRESETS:
            raise PlanInputError(f"unknown GPU preset {name!r}; known: {', '.join(sorted(GPU_PRESETS))}")
        fields = dict(GPU_PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(gpus_per_node=gpus_per_node, nodes=nodes, **fields)


# Capacities are what torch reports as total_memory (A100-80GB: 79.18 GiB per the real OOM message in docs/DEEPSPEED_docs/DEEPSPEED_NOTES.md).
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
    # params with numel <= this stay gathered on every GPU
    param_persistence_threshold: int = ZERO3_DEFAULTS["stage3_param_persistence_threshold"]
    model_persistence_threshold: int = sys.maxsize  # cap on the total numel of persistent params
    max_live_parameters: int = ZERO3_DEFAULTS["stage3_max_live_parameters"]  # cap on gathered numel
    prefetch_bucket_size: int = ZERO3_DEFAULTS["stage3_prefetch_bucket_size"]  # numel gathered ahead of use
    reduce_bucket_size: int = ZERO3_DEFAULTS["reduce_bucket_size"]  # numel of the gradient reduce bucket
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
        stage = int(zo.get("stage", ZERO_STAGE))
        if stage != ZERO_STAGE:
            raise PlanInputError(f"deepspeed zero_optimization.stage={stage}: the planner models ZeRO stage "
                                 f"{ZERO_STAGE} only")

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


def user_ds_config(job: JobSpec) -> dict[str, Any]:
    """The user's base ds_config file (deepspeed.config_path) with the inline deepspeed.config merged over it
    (the job's own merge, `ds_config.load_user_config`): what the user wrote, before the job's builder adds
    its own keys (`ulyssesctl`'s `effective_ds_config` is the built config the job actually runs)."""
    try:
        return load_user_config(job)[0]
    except SpecError as exc:
        raise PlanInputError(f"{exc.source}: {'; '.join(exc.problems)}") from None
