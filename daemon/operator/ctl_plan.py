"""`ulyssesctl plan` and the daemon's launch preflight, both on top of `ulyssesd.training.planner`.

- `register_plan(app)` adds `plan --spec run.toml [--gpu PRESET] [--gpus N] [--nodes N] [--gpu-mem GiB]
  [--host-mem GiB] [--nvme GiB] [--json]`; exit 0 = fits, 1 = does not fit, 2 = bad input.
- `preflight(run_spec, cluster=None) -> (ok, plan)`: the supervisor calls it before launching and refuses
  the run when `ok` is False (unless the operator overrides). CPU runs are not planned. Raises SpecError
  or PlanInputError for input the job itself would reject.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from ulyssesd.remediation.goodput import HOUR, optimal_interval, scaled_inputs
from ulyssesd.remediation.memory_evidence import PlanView, Replan
from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.planner import (
    ALLOCATOR_HEADROOM,
    GPU_PRESETS,
    NO_STANDBY,
    Cluster,
    Plan,
    PlanInputError,
    plan,
)
from ulyssesd.training.spec import JobSpec, SpecError

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_GPU = "a100-80g"
NVIDIA_SMI_TIMEOUT_S = 10.0
DRIVER_RESERVED_GIB = 0.8   # nvidia-smi's memory.total minus what torch reports as total_memory
EXPANDABLE_HEADROOM = 0.03  # fragmentation allowance with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True


@dataclass
class SkippedPlan:
    """Stands in for a Plan when none is computed (CPU runs, no GPU found); same reporting surface."""

    notes: list[str]
    fits: bool = True
    problems: list[str] = field(default_factory=list)
    suggestions: list[Any] = field(default_factory=list)

    def render(self) -> str:
        return "VERDICT: not planned\n" + "\n".join(f"  - {n}" for n in self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {"fits": True, "verdict": "not planned", "notes": self.notes, "problems": [], "suggestions": []}


def effective_ds_config(run_spec: Any, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config the job will actually run with (the training job's own builder)."""
    cfg, _warnings = build_ds_config(run_spec.job, world_size)
    return cfg


def detect_local_cluster(nnodes: int, nproc_per_node: int) -> Cluster | None:
    """GPU memory from nvidia-smi and host RAM from /proc/meminfo of this machine; None without a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [r.rsplit(",", 1) for r in out.strip().splitlines() if "," in r]
    if not rows:
        return None
    name, mib = rows[0][0].strip(), min(float(r[1]) for r in rows)
    host_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                host_gib = int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return Cluster(gpus_per_node=nproc_per_node, nodes=nnodes, gpu_mem_gib=mib / 1024 - DRIVER_RESERVED_GIB,
                   host_mem_gib=host_gib or 1024.0, gpu_name=name)


def allocator_headroom(run_spec: Any) -> float:
    """Fragmentation allowance: smaller when the launcher sets expandable_segments (the memory ladder's 2nd step)."""
    conf = (run_spec.launcher.env or {}).get("PYTORCH_CUDA_ALLOC_CONF", "")
    return EXPANDABLE_HEADROOM if "expandable_segments:true" in conf.replace(" ", "").lower() else ALLOCATOR_HEADROOM


def _is_cpu_run(run_spec: Any) -> bool:
    return run_spec.job.train.device == "cpu"


def preflight(run_spec: Any, cluster: Cluster | None = None) -> tuple[bool, Plan | SkippedPlan]:
    """Plan the run before launch. ok=False only when the planner says it does not fit."""
    if _is_cpu_run(run_spec):
        return True, SkippedPlan(["CPU run: no GPU memory plan"])
    launcher = run_spec.launcher
    if cluster is None:
        cluster = detect_local_cluster(launcher.nnodes, launcher.nproc_per_node)
        if cluster is None:
            if run_spec.job.train.device == "auto":
                return True, SkippedPlan(["CPU run: no GPU memory plan (device=auto and no GPU found)"])
            return True, SkippedPlan(["no GPU detected on this host (nvidia-smi): memory plan skipped; "
                                      "pass a cluster to plan for other hardware"])
    result = plan(run_spec.job, cluster, effective_ds_config(run_spec, cluster.world_size),
                  allocator_headroom=allocator_headroom(run_spec), restart=_restart(run_spec))
    return result.fits, result


def _restart(run_spec: Any) -> Any:
    """The run's `[restart]` (a warm standby holds host RAM the planner counts); none on a bare job spec."""
    return getattr(run_spec, "restart", None) or NO_STANDBY


def checkpoint_interval_suggestion(result: Plan, async_save: bool = False) -> dict[str, Any]:
    """The checkpoint interval that maximises expected ETTR (remediation/goodput.py) for this plan's model and
    cluster: saves (blocking, or `[checkpoint] async_save`) and restarts scaled from the 1x H200 measurements,
    the Llama 3 interruption rate."""
    x = scaled_inputs(float(result.summary["params"]), result.cluster.nodes, result.cluster.world_size,
                      async_save=async_save)
    best, best_ettr = optimal_interval(x)
    return {"interval_h": best / HOUR, "ettr": best_ettr, "async_save": async_save, "save_block_s": x.block_s,
            "save_write_s": x.write_s, "restart_s": x.restart_s, "mtbf_h": x.mtbf_s / HOUR}


def _render_interval(sug: dict[str, Any]) -> str:
    save = (f"an async save blocks ~{sug['save_block_s']:.1f} s and writes ~{sug['save_write_s']:.0f} s in the "
            "background" if sug["async_save"] else f"a save blocks ~{sug['save_block_s']:.0f} s")
    return (f"Suggested checkpoint interval: every {sug['interval_h']:.2f} h of training -> expected ETTR "
            f"{sug['ettr']:.2%} (goodput model: Llama 3 failure rate, MTBF {sug['mtbf_h']:.0f} h for these GPUs; "
            f"{save} and a restart takes ~{sug['restart_s']:.0f} s, scaled "
            f"from 1x H200 by checkpoint bytes per node; docs/REMEDIATION.md 'Goodput model')")


# Planner items that are model states (parameter/gradient/optimizer shards, gathered params, buckets); every
# other GPU item is activations, transients or logits.
MODEL_STATE_ITEMS = ("parameter shard", "gradient partition", "fp32 master", "fp32 grad", "persistent params",
                     "gathered params", "full grad of module", "reduce bucket")


def plan_view(result: Plan) -> PlanView:
    """The plain-data view of a plan the memory remediation reads (remediation/memory_evidence.py)."""
    peak = result.peak_phase
    # the job's own allocations: another process on the GPU (warm standby) is neither states nor activations
    gpu = [it for it in result.items if it.where == "gpu" and peak in it.phases and not it.outside_allocator]
    states = sum(it.bytes for it in gpu if any(k in it.name for k in MODEL_STATE_ITEMS))
    gib = float(1 << 30)
    return PlanView(fits=result.fits, required_gib=result.gpu_required / gib, capacity_gib=result.cluster.gpu_mem_gib,
                    peak_allocated_gib=result.gpu_peak_allocated / gib, model_states_gib=states / gib,
                    activations_gib=(sum(it.bytes for it in gpu) - states) / gib, problems=tuple(result.problems))


def memory_replanner(run_spec: Any, config: dict[str, Any], launch_env: dict[str, Any],
                     cluster: Cluster | None) -> Replan | None:
    """The planner over the daemon's current job config (`config`: dotted-patchable JobSpec dump, `launch_env`:
    the launcher env the daemon adds), for the memory ladder's re-planning; None without a cluster to plan for."""
    if cluster is None:
        return None

    def replan(patch: dict[str, Any]) -> PlanView:
        cfg = copy.deepcopy(config)
        env = {**(run_spec.launcher.env or {}), **{k: v for k, v in launch_env.items() if v is not None}}
        for key, val in patch.items():
            if key.startswith("launcher.env."):
                env[key.removeprefix("launcher.env.")] = val
                continue
            node = cfg
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = val
        try:
            job = JobSpec.model_validate(cfg)
            ds, _warnings = build_ds_config(job, cluster.world_size)
        except (SpecError, PlanInputError, ValueError) as exc:   # pydantic's ValidationError is a ValueError
            raise ValueError(f"config with {patch} is invalid: {str(exc)[:300]}") from None
        conf = str(env.get("PYTORCH_CUDA_ALLOC_CONF") or "").replace(" ", "").lower()
        headroom = EXPANDABLE_HEADROOM if "expandable_segments:true" in conf else ALLOCATOR_HEADROOM
        # the run's [restart] as preflight plans it: a warm standby holds GPU memory beside every relaunch
        return plan_view(plan(job, cluster, ds, search=False, allocator_headroom=headroom, restart=_restart(run_spec)))

    return replan


def _cluster_from_flags(run_spec: Any, gpu: str, gpus: int | None, nodes: int | None, gpu_mem: float | None,
                        host_mem: float | None, nvme: float | None) -> Cluster:
    launcher = run_spec.launcher
    name = None if gpu_mem is None else f"{gpu_mem:g} GiB GPU"
    return Cluster.preset(gpu, gpus_per_node=gpus or launcher.nproc_per_node, nodes=nodes or launcher.nnodes,
                          gpu_mem_gib=gpu_mem, host_mem_gib=host_mem, nvme_gib=nvme, gpu_name=name)


def register_plan(app: typer.Typer) -> None:
    """Add the `plan` command to an ulyssesctl Typer app."""

    @app.command("plan")
    def plan_cmd(
        spec: Path = typer.Option(..., "--spec", help="Run spec TOML."),
        gpu: str = typer.Option(DEFAULT_GPU, "--gpu", help=f"GPU preset: {', '.join(sorted(GPU_PRESETS))} "
                                "(sets GPU memory and the usual host RAM)."),
        gpus: int | None = typer.Option(None, "--gpus", help="GPUs per node (default launcher.nproc_per_node)."),
        nodes: int | None = typer.Option(None, "--nodes", help="Nodes (default launcher.nnodes)."),
        gpu_mem: float | None = typer.Option(None, "--gpu-mem", help="GPU memory per GPU, GiB (overrides --gpu)."),
        host_mem: float | None = typer.Option(None, "--host-mem", help="Host RAM per node, GiB."),
        nvme: float | None = typer.Option(None, "--nvme", help="NVMe per node for ZeRO-Infinity swap, GiB."),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    ) -> None:
        """Plan a run's memory. Will it fit? Per-GPU/per-host memory, verdict, and the cheapest changes that would fit.
        Exit 0 fits, 1 does not fit, 2 bad input."""
        from ulyssesd.daemon.spec import load_run_spec

        try:
            run_spec = load_run_spec(spec)
            cluster = _cluster_from_flags(run_spec, gpu, gpus, nodes, gpu_mem, host_mem, nvme)
            result = plan(run_spec.job, cluster, effective_ds_config(run_spec, cluster.world_size),
                          allocator_headroom=allocator_headroom(run_spec), restart=_restart(run_spec))
        except SpecError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except (PlanInputError, ValueError) as exc:
            typer.echo(f"cannot plan {spec}: {exc}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        interval = checkpoint_interval_suggestion(result, run_spec.job.checkpoint.async_save)
        typer.echo(json.dumps({**result.to_dict(), "checkpoint_interval": interval}, indent=2) if as_json
                   else result.render() + "\n" + _render_interval(interval))
        raise typer.Exit(EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT)
