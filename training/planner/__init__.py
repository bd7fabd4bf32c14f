"""Memory planner: will this run spec fit this cluster, and if not, what is the smallest change that would?

Pure arithmetic over the job spec (no torch, no DeepSpeed, no GPU): per-GPU and per-host breakdown of a
ZeRO-3 + Ulysses step of `training/model/gpt.py`'s GPT, a verdict with its margin, and a search over candidate
changes (more nodes, offload, SP degree, micro-batch, checkpointing, sequence length, bigger GPUs or more
host RAM) that re-plans each candidate and reports those that fit, cheapest first.
Formulas, their sources in DeepSpeed 0.19.8 and how they differ from DeepSpeed's own estimator:
docs/PLANNER.md.

Modules: `inputs` (cluster, ZeRO settings, overheads), `cost_model` (the bytes of one plan), `search` (the
suggestions), `rendering` (the Plan and its text/JSON). This package's namespace is the planner's public,
documented import path (`from ulyssesd.training.planner import Cluster, plan, ...`, docs/PLANNER.md), so it
re-exports the public names of its modules.
"""

from __future__ import annotations

from typing import Any

from ..spec import JobSpec
from .cost_model import block_saved_bytes_per_token, compute_plan, model_stats, param_shapes
from .fixes import Fix, FixSearch, search_fixes
from .host_extras import NO_STANDBY, Restart, RestartLike
from .inputs import (
    ALLOCATOR_HEADROOM,
    CUDA_CONTEXT_GIB,
    EXPANDABLE_HEADROOM,
    GPU_PRESETS,
    Cluster,
    GiB,
    PlanInputError,
    ZeroSettings,
    user_ds_config,
)
from .overrides import apply_overrides
from .rendering import Item, Plan, Suggestion
from .search import search_suggestions

__all__ = [
    "ALLOCATOR_HEADROOM", "CUDA_CONTEXT_GIB", "EXPANDABLE_HEADROOM", "GPU_PRESETS", "NO_STANDBY", "Cluster", "Fix",
    "FixSearch", "GiB", "Item", "Plan", "search_fixes",
    "PlanInputError", "Restart", "RestartLike", "Suggestion", "ZeroSettings", "apply_overrides",
    "apply_restart_overrides", "block_saved_bytes_per_token", "model_stats", "param_shapes", "plan",
    "predict_peak_gib", "user_ds_config",
]


def plan(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any] | None = None, *, search: bool = True,
         allocator_headroom: float = ALLOCATOR_HEADROOM, cuda_context_gib: float = CUDA_CONTEXT_GIB,
         restart: RestartLike = NO_STANDBY, alloc_conf: str | None = None) -> Plan:
    """Per-GPU/per-host memory plan of `job` on `cluster`, with a verdict and (if it does not fit and
    `search`) the fixes that keep the experiment and the hardware, cheapest predicted step time first
    (`fixes`, fixes.py), then the other changes that would fit, hardware and experiment changes among them
    (`suggestions`, search.py: advice). `ds_config` defaults to the spec's own DeepSpeed config (base file +
    inline); pass the job's effective config when you have it. `restart`: the daemon's `[restart]` section (a
    warm standby holds host RAM on the node; default: no standby). `alloc_conf`: the run's
    PYTORCH_CUDA_ALLOC_CONF (the fix search may add expandable segments to it)."""
    ds = user_ds_config(job) if ds_config is None else ds_config
    result = compute_plan(job, cluster, ds, allocator_headroom=allocator_headroom,
                          cuda_context_gib=cuda_context_gib, restart=restart)
    if search and not result.fits:
        found = search_fixes(job, cluster, ds, allocator_headroom=allocator_headroom, cuda_context_gib=cuda_context_gib,
                             restart=restart, alloc_conf=alloc_conf,
                             headroom_lever=allocator_headroom > EXPANDABLE_HEADROOM)
        result.fixes, result.fix_search = found.fixes, found.describe()
        result.fix_search_complete = found.complete
        result.suggestions = search_suggestions(job, cluster, ds, result, allocator_headroom=allocator_headroom,
                                                cuda_context_gib=cuda_context_gib, restart=restart)
    return result


def apply_restart_overrides(restart: RestartLike, overrides: dict[str, Any]) -> Restart:
    """The `[restart]` settings after a Suggestion's `restart.*` overrides."""
    fields = {"standby": restart.standby, "standby_preload": restart.standby_preload}
    fields.update({k.removeprefix("restart."): bool(v) for k, v in overrides.items() if k.startswith("restart.")})
    return Restart(**fields)


def predict_peak_gib(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any] | None = None) -> float:
    """Predicted steady-state `torch.cuda.max_memory_allocated()` of the worst rank over a training step
    (forward, backward, optimizer step), in GiB. Excludes what the caching allocator reserves beyond
    allocations and the CUDA context — compare with max_memory_allocated, not reserved or nvidia-smi."""
    return plan(job, cluster, ds_config, search=False).gpu_peak_allocated / GiB
