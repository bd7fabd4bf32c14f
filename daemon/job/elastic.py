"""Continue on fewer nodes when a node is lost and no spare is left; grow back when it returns (docs/SLURM.md
"Continue at a smaller size").

The decision is pure (`choose_layout`, `decide`): the layout after the loss keeps the global batch (micro-batch ×
accumulation × DP) through gradient accumulation, keeps SP (or lowers it only to a degree that divides the heads,
the sequence and the new world size), and is taken only when the memory planner says it fits on the remaining
nodes (the re-planned memory is part of the decision's text and evidence). The training job resumes the newest
valid tag at the new world size itself (training/checkpoint/reshard.py: DeepSpeed's universal checkpoint); the
sampler's order is a function of the global sample index, so the samples of every step stay the same.

The run's current size lives in `{run_dir}/slurm/resize.json` (`nnodes`, the full size, the layout before), so a
restarted daemon launches at the size the run has; the job's side (accumulation, micro-batch, SP) is a config
version like any other patch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ulyssesd.daemon.job import slurm as sl

RESIZE_FILE = "resize.json"


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over its ranks and how many samples one optimizer step takes."""

    nnodes: int
    nproc_per_node: int
    sp: int            # parallel.sequence_parallel_size
    micro_batch: int   # train.micro_batch_size
    accum: int         # train.gradient_accumulation_steps

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.accum

    def describe(self) -> str:
        return (f"{self.nnodes} node(s) x {self.nproc_per_node} = {self.world} ranks, SP {self.sp}, DP {self.dp}, "
                f"micro-batch {self.micro_batch} x accumulation {self.accum} (global batch {self.global_batch})")


@dataclass(frozen=True)
class Replan:
    """The memory planner's answer for a layout: fits or not, and the figures in words."""

    fits: bool
    text: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """Continue at `after` (ok) or stop with `reason`; `memory`: the re-plan the decision rests on."""

    ok: bool
    before: Layout
    after: Layout | None
    reason: str
    memory: Replan | None = None

    def patch(self, job_world_size_set: bool) -> dict[str, Any]:
        """The job config's patch for `after` (only what changes)."""
        assert self.after is not None
        b, a = self.before, self.after
        out: dict[str, Any] = {}
        if a.accum != b.accum:
            out["train.gradient_accumulation_steps"] = a.accum
        if a.micro_batch != b.micro_batch:
            out["train.micro_batch_size"] = a.micro_batch
        if a.sp != b.sp:
            out["parallel.sequence_parallel_size"] = a.sp
        if job_world_size_set:
            out["parallel.world_size"] = a.world
        return out

    def evidence(self) -> dict[str, Any]:
        return {"before": record(self.before), "after": None if self.after is None else record(self.after),
                "memory": None if self.memory is None else {"fits": self.memory.fits, "plan": self.memory.text,
                                                            **self.memory.figures}}


def record(layout: Layout) -> dict[str, Any]:
    """A layout as a resize action's `before`/`after`: nodes, ranks per node, SP, micro-batch, accumulation, and
    the world size, DP and global batch they make."""
    return {**asdict(layout), "world": layout.world, "dp": layout.dp, "global_batch": layout.global_batch}


def choose_layout(before: Layout, nnodes: int, heads: int, seq_len: int) -> Layout | str:
    """The layout on `nnodes` nodes that keeps the global batch and the samples of every step, or why none does.
    SP stays unless the new world size is not a multiple of it; then the largest degree below it that divides the
    world size, the heads and the sequence length (Ulysses needs all three)."""
    world = nnodes * before.nproc_per_node
    sp = next((s for s in range(before.sp, 0, -1) if world % s == 0 and heads % s == 0 and seq_len % s == 0), 1)
    dp = world // sp
    if before.global_batch % dp:
        return (f"the global batch {before.global_batch} ({before.describe()}) cannot be split over DP {dp} on "
                f"{nnodes} node(s): not a multiple")
    per_rank = before.global_batch // dp
    # The largest micro-batch not above today's that divides the per-rank share: activations never grow.
    micro = next(m for m in range(min(before.micro_batch, per_rank), 0, -1) if per_rank % m == 0)
    return Layout(nnodes, before.nproc_per_node, sp, micro, per_rank // micro)


def decide(before: Layout, usable_nodes: int, *, min_nnodes: int, heads: int, seq_len: int,
           replan: Callable[[Layout], Replan]) -> Decision:
    """Continue on the usable nodes (at most today's count) when a layout keeps the global batch and the planner
    says it fits; otherwise stop, saying which of these failed."""
    nnodes = min(usable_nodes, before.nnodes)
    if nnodes < max(1, min_nnodes):
        return Decision(False, before, None, f"{usable_nodes} usable node(s) left, fewer than slurm.min_nnodes="
                        f"{min_nnodes}")
    layout = choose_layout(before, nnodes, heads, seq_len)
    if isinstance(layout, str):
        return Decision(False, before, None, layout)
    memory = replan(layout)
    if not memory.fits:
        return Decision(False, before, layout, f"the model does not fit on {nnodes} node(s) ({layout.describe()}): "
                        f"{memory.text}", memory)
    return Decision(True, before, layout, f"continuing on {nnodes} node(s): {layout.describe()} (was "
                    f"{before.describe()}); memory re-planned: {memory.text}", memory)


# --------------------------------------------------------------------------------------- the run's size
def read_resize(run_dir: Path) -> dict[str, Any] | None:
    """The run's resize record, None when it runs at its full size (or the file is unreadable: said in the log
    of the caller, which then launches at the spec's size)."""
    try:
        data = json.loads((run_dir / sl.SLURM_DIR / RESIZE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("nnodes"), int) else None


def write_resize(run_dir: Path, record: dict[str, Any] | None) -> None:
    path = run_dir / sl.SLURM_DIR / RESIZE_FILE
    if record is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def layout_of(job: Any, nnodes: int, nproc_per_node: int) -> Layout:
    """The layout of a job spec (JobSpec) on `nnodes` nodes."""
    tr = job.train
    return Layout(nnodes, nproc_per_node, job.parallel.sequence_parallel_size, tr.micro_batch_size,
                  tr.gradient_accumulation_steps)


def replanner(run_spec: Any, config: dict[str, Any], patch_of: Callable[[Layout], dict[str, Any]]) -> \
        Callable[[Layout], Replan]:
    """The planner over the daemon's current job config patched for a layout (daemon/operator/ctl_plan.py's
    preflight: a CPU run is not planned; a GPU run is planned on this host's GPU, or on slurm.plan_gpu_mem_gib
    where the daemon's host has none)."""

    def replan(layout: Layout) -> Replan:
        from ulyssesd.daemon.job import config as jc
        from ulyssesd.daemon.operator import ctl_plan
        from ulyssesd.training.planner import Cluster
        from ulyssesd.training.spec import JobSpec

        cfg, _diff = jc.apply_patch(config, patch_of(layout))
        job = JobSpec.model_validate({k: v for k, v in cfg.items() if k != "launcher"})
        launcher = run_spec.launcher.model_copy(update={"nnodes": layout.nnodes})
        patched = run_spec.model_copy(update={"job": job, "launcher": launcher})
        gpu_mem = getattr(run_spec.slurm, "plan_gpu_mem_gib", None)
        cluster = Cluster(gpus_per_node=layout.nproc_per_node, nodes=layout.nnodes, gpu_mem_gib=gpu_mem,
                          origin="slurm.plan_gpu_mem_gib") if gpu_mem else None
        if cluster is None and job.train.device != "cpu":
            cluster = ctl_plan.this_host_cluster(layout.nnodes, layout.nproc_per_node)
            if cluster is None and job.train.device == "cuda":
                return Replan(False, "no GPU on the daemon's host to plan GPU memory with: set slurm.plan_gpu_mem_gib "
                                     "(GiB per GPU of the job's nodes)")
        ok, plan = ctl_plan.preflight(patched, cluster)
        if isinstance(plan, ctl_plan.SkippedPlan):
            text = "; ".join(plan.notes) or "not planned"
            if job.train.device == "auto":  # said, not assumed: the ranks' nodes may have GPUs the daemon cannot see
                text += ("; NOT planned for GPUs: if the job's nodes have GPUs, set slurm.plan_gpu_mem_gib (or "
                         "train.device = \"cuda\") so a shrink is planned")
            return Replan(bool(ok), text)
        gib = float(1 << 30)
        figures = {"gpu_required_gib": round(plan.gpu_required / gib, 2),
                   "gpu_capacity_gib": round(plan.cluster.gpu_mem_gib, 2),
                   "gpu_peak_allocated_gib": round(plan.gpu_peak_allocated / gib, 2),
                   "host_required_gib": round(plan.host_required / gib, 2)}
        text = (f"GPU {figures['gpu_required_gib']:.1f} of {figures['gpu_capacity_gib']:.1f} GiB per GPU (peak "
                f"allocated {figures['gpu_peak_allocated_gib']:.1f} GiB), host {figures['host_required_gib']:.1f} GiB "
                f"per node" + ("" if ok else f"; {'; '.join(plan.problems)}"))
        return Replan(bool(ok), text, figures)

    return replan
