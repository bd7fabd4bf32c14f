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
import math
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import typer

from ulyssesd.remediation.goodput import HOUR, optimal_interval, scaled_inputs
from ulyssesd.remediation.memory_evidence import FixSearchView, FixView, PlanView
from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.planner import (
    ALLOCATOR_HEADROOM,
    CUDA_CONTEXT_GIB,
    EXPANDABLE_HEADROOM,
    GPU_PRESETS,
    NO_STANDBY,
    Cluster,
    Plan,
    PlanInputError,
    plan,
    search_fixes,
)
from ulyssesd.training.planner.inputs import gpu_memory_cap_gib
from ulyssesd.training.planner.rendering import is_advice
from ulyssesd.training.planner.step_cost import cost_table
from ulyssesd.training.spec import JobSpec, SpecError

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_GPU = "a100-80g"
NVIDIA_SMI_TIMEOUT_S = 10.0
DRIVER_RESERVED_GIB = 0.8   # nvidia-smi's memory.total minus what torch reports as total_memory
# The physical ranges of `plan`'s numeric flags (a number outside is a typo, never planned): GPUs per node and
# nodes as the spec's launcher bounds them (daemon/spec_bounds.py); memory per GPU / per node / NVMe in GiB.
GPUS_MAX, NODES_MAX = 1024, 100_000
GPU_MEM_MAX_GIB, HOST_MEM_MAX_GIB, NVME_MAX_GIB = 4096.0, 65536.0, float(1 << 20)


def _gib_flag(flag: str, high: float, zero_ok: bool = False) -> Any:
    """A typer callback refusing a non-finite or out-of-range GiB figure (exit 2, naming the flag and range)."""
    low = ">= 0" if zero_ok else "> 0"

    def check(value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value > high or value < 0
                                  or (value == 0 and not zero_ok)):
            raise typer.BadParameter(f"{value:g} GiB: must be {low} and <= {high:.0f} GiB (a finite number)",
                                     param_hint=flag)
        return value
    return check


@dataclass
class SkippedPlan:
    """Stands in for a Plan when none is computed (CPU runs, no GPU found); same reporting surface."""

    notes: list[str]
    fits: bool = True
    problems: list[str] = field(default_factory=list)
    suggestions: list[Any] = field(default_factory=list)
    unknown: bool = False   # a GPU run left unplanned (not a CPU run): said loudly before the launch

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
    return Cluster(gpus_per_node=nproc_per_node, nodes=nnodes, gpu_mem_gib=_capped(mib / 1024 - DRIVER_RESERVED_GIB),
                   host_mem_gib=host_gib or 1024.0, gpu_name=name)


def _capped(gpu_gib: float) -> float:
    """A GPU's memory as the jobs of this host may use it: ULYSSESD_GPU_MEMORY_CAP_GIB (benchmarks) caps it."""
    cap = gpu_memory_cap_gib()
    return min(gpu_gib, cap) if cap else gpu_gib


def host_ram_gib() -> float | None:
    """This host's RAM (/proc/meminfo MemTotal), GiB; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return None


def torch_gpu() -> tuple[str, float] | None:
    """(name, total_memory GiB) of the smallest visible GPU through torch.cuda, or None (no torch, no GPU).
    torch's total_memory is what the planner's GPU figures mean (no driver reserve to subtract)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
        props = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                    key=lambda p: p.total_memory)
        return str(props.name), props.total_memory / (1 << 30)
    except Exception:  # noqa: BLE001 - a broken driver is no GPU to plan for; the caller says what it assumed
        return None


def this_host_cluster(nnodes: int, nproc_per_node: int) -> Cluster | None:
    """The cluster as this host measures it: GPU via torch.cuda (else nvidia-smi), host RAM from /proc/meminfo,
    with its `origin` saying so; None without a GPU."""
    gpu = torch_gpu()
    if gpu is not None:
        ram = host_ram_gib()
        return Cluster(gpus_per_node=nproc_per_node, nodes=nnodes, gpu_mem_gib=_capped(gpu[1]), host_mem_gib=ram or 1024.0,
                       gpu_name=gpu[0]).with_origin(
            f"measured on this host: GPU memory {gpu[1]:.2f} GiB (torch.cuda total_memory of {gpu[0]}), host RAM "
            + (f"{ram:.0f} GiB (/proc/meminfo)" if ram else "ASSUMED 1024 GiB (/proc/meminfo unreadable; --host-mem "
                                                          "sets it)"))
    smi = detect_local_cluster(nnodes, nproc_per_node)
    return None if smi is None else smi.with_origin(
        f"measured on this host: GPU memory {smi.gpu_mem_gib:.2f} GiB (nvidia-smi memory.total minus "
        f"{DRIVER_RESERVED_GIB} GiB driver reserve; torch not importable), host RAM {smi.host_mem_gib:.0f} GiB")


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
            return True, SkippedPlan([
                f"memory plan skipped: no GPU detected on this host (nvidia-smi failed or found none) although "
                f"train.device = {run_spec.job.train.device!r}; the run is launched UNPLANNED. Fix the driver, or plan "
                f"for the target hardware with `ulyssesctl plan --spec SPEC --gpu NAME`, or set train.device = "
                f"\"auto\" (or [daemon] preflight = false) to say no plan is wanted"], unknown=True)
    result = plan(run_spec.job, cluster, effective_ds_config(run_spec, cluster.world_size),
                  allocator_headroom=allocator_headroom(run_spec), restart=_restart(run_spec),
                  alloc_conf=(launcher.env or {}).get("PYTORCH_CUDA_ALLOC_CONF"))
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


class MemoryReplanner:
    """The planner over the daemon's current job config (`config`: dotted-patchable JobSpec dump, `launch_env`:
    the launcher env the daemon adds), for the memory ladder: `self(patch)` plans the config with a patch
    (remediation/memory_evidence.py `Replan`); `search(under_gib, peak_limit_gib)` runs the fix search
    (training/planner/fixes.py) over it and returns the fitting combinations, cheapest first, each re-planned
    through `self`, with the hardware/experiment advice that would fit too (never applied)."""

    def __init__(self, run_spec: Any, config: dict[str, Any], launch_env: dict[str, Any], cluster: Cluster) -> None:
        self.run_spec, self.config, self.cluster = run_spec, config, cluster
        self.env = {**(run_spec.launcher.env or {}), **{k: v for k, v in launch_env.items() if v is not None}}

    def _job(self, patch: dict[str, Any]) -> tuple[JobSpec, dict[str, Any], float, str]:
        cfg = copy.deepcopy(self.config)
        env = dict(self.env)
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
            ds, _warnings = build_ds_config(job, self.cluster.world_size)
        except (SpecError, PlanInputError, ValueError) as exc:   # pydantic's ValidationError is a ValueError
            raise ValueError(f"config with {patch} is invalid: {str(exc)[:300]}") from None
        conf = str(env.get("PYTORCH_CUDA_ALLOC_CONF") or "")
        headroom = EXPANDABLE_HEADROOM if "expandable_segments:true" in conf.replace(" ", "").lower() \
            else ALLOCATOR_HEADROOM
        return job, ds, headroom, conf

    def __call__(self, patch: dict[str, Any]) -> PlanView:
        job, ds, headroom, _conf = self._job(patch)
        # the run's [restart] as preflight plans it: a warm standby holds GPU memory beside every relaunch
        return plan_view(plan(job, self.cluster, ds, search=False, allocator_headroom=headroom,
                              restart=_restart(self.run_spec)))

    def search(self, under_gib: float = 0.0, peak_limit_gib: float | None = None) -> FixSearchView:
        job, ds, headroom, conf = self._job({})
        restart = _restart(self.run_spec)
        found = search_fixes(job, self.cluster, ds, allocator_headroom=headroom, cuda_context_gib=CUDA_CONTEXT_GIB,
                             restart=restart, alloc_conf=conf or None, under_gib=under_gib,
                             peak_limit_gib=peak_limit_gib, headroom_lever=headroom > EXPANDABLE_HEADROOM,
                             daemon_levers=False)   # its patches are the job's config: no [restart] keys
        fixes = []
        for fx in found.fixes:
            try:
                view = self(fx.overrides)   # the daemon's own path: what the relaunch will really run
            except ValueError:
                continue
            fixes.append(FixView(dict(fx.overrides), tuple(fx.changes), fx.step_cost, view))
        base = plan(job, self.cluster, ds, search=True, allocator_headroom=headroom, restart=restart)
        advice = tuple(" + ".join(sg.changes) + f" (GPU {sg.gpu_required_gib:.1f} GiB)"
                       for sg in base.suggestions if is_advice(sg.overrides))
        return FixSearchView(tuple(fixes), found.describe(), advice, found.complete)


def memory_replanner(run_spec: Any, config: dict[str, Any], launch_env: dict[str, Any],
                     cluster: Cluster | None) -> MemoryReplanner | None:
    """The daemon's planner for the memory ladder (`MemoryReplanner`); None without a cluster to plan for."""
    return None if cluster is None else MemoryReplanner(run_spec, config, launch_env, cluster)


def _cluster_from_flags(run_spec: Any, gpu: str | None, gpus: int | None, nodes: int | None, gpu_mem: float | None,
                        host_mem: float | None, nvme: float | None,
                        detect: Any = None) -> Cluster:
    """The cluster to plan for, its `origin` naming each figure's source: without --gpu/--gpu-mem this host's
    GPU and RAM (`detect`, default `this_host_cluster`); with them (another machine) the GPU from the flag or
    preset, host RAM from --host-mem or ASSUMED from the preset. No GPU here and no flag: the DEFAULT_GPU
    preset, every figure assumed, said loudly."""
    launcher = run_spec.launcher
    gpn = launcher.nproc_per_node if gpus is None else gpus
    nn = launcher.nnodes if nodes is None else nodes
    if gpu is None and gpu_mem is None:
        here = (detect or this_host_cluster)(nn, gpn)
        if here is not None:
            origin = here.origin
            if host_mem is not None:
                here = replace(here, host_mem_gib=host_mem)
                origin = origin.split(", host RAM")[0] + f", host RAM {host_mem:g} GiB (--host-mem)"
            return replace(here, nvme_gib=nvme or 0.0).with_origin(origin)
        preset = GPU_PRESETS[DEFAULT_GPU]
        cl = Cluster.preset(DEFAULT_GPU, gpus_per_node=gpn, nodes=nn, host_mem_gib=host_mem, nvme_gib=nvme)
        return cl.with_origin(
            f"ASSUMED: no GPU on this host (torch.cuda, nvidia-smi), so the {DEFAULT_GPU} preset's "
            f"{preset['gpu_mem_gib']} GiB GPU and "
            + (f"--host-mem {host_mem:g} GiB" if host_mem is not None else f"{preset['host_mem_gib']:.0f} GiB host RAM")
            + "; pass --gpu (or --gpu-mem) and --host-mem for the machine the run is for")
    name = None if gpu_mem is None else f"{gpu_mem:g} GiB GPU"
    preset_name = DEFAULT_GPU if gpu is None else gpu   # `--gpu ""` is an unknown preset, not the default
    cl = Cluster.preset(preset_name, gpus_per_node=gpn, nodes=nn, gpu_mem_gib=gpu_mem, host_mem_gib=host_mem,
                        nvme_gib=nvme, gpu_name=name)
    gpu_src = (f"GPU memory {gpu_mem:g} GiB (--gpu-mem)" if gpu_mem is not None
               else f"GPU memory {cl.gpu_mem_gib:g} GiB (the {preset_name} preset: torch's total_memory of that GPU)")
    host_src = (f"host RAM {host_mem:g} GiB (--host-mem)" if host_mem is not None
                else f"host RAM ASSUMED {cl.host_mem_gib:.0f} GiB (the {preset_name} preset's usual; --host-mem sets it)")
    return cl.with_origin(f"for another machine: {gpu_src}, {host_src}")


def _load_for_layout(load: Any, spec: Path, gpus: int | None, nodes: int | None) -> Any:
    """The run spec with `--gpus`/`--nodes` replacing launcher.nproc_per_node/nnodes *before* the parallel
    layout is checked (SP must divide the world the plan is for, not the spec file's)."""
    if gpus is None and nodes is None:
        return load(spec)
    from ulyssesd.daemon.spec import read_toml

    launcher = read_toml(spec).get("launcher") or {}
    try:
        gpn = gpus if gpus is not None else int(launcher.get("nproc_per_node", 1))
        nn = nodes if nodes is not None else int(launcher.get("nnodes", 1))
    except (TypeError, ValueError):
        return load(spec)   # the spec's own launcher value is wrong: its loader names it
    said = (f"{'--nodes' if nodes is not None else 'launcher.nnodes'} × "
            f"{'--gpus' if gpus is not None else 'launcher.nproc_per_node'}")
    run_spec = load(spec, layout=(nn, gpn, said))
    run_spec.launcher = run_spec.launcher.model_copy(update={"nproc_per_node": gpn, "nnodes": nn})
    from ulyssesd.daemon.spec import standby_problems

    # The same checks as the spec's own launcher values: a warm standby never runs on more than one node.
    problems = [f"{p} (with {said} = {nn} x {gpn})"
                for p in standby_problems(run_spec.restart, run_spec.launcher, run_spec.job_section)]
    if problems:
        raise SpecError(str(spec), problems)
    return run_spec


def _model_unknown(run_spec: Any) -> str | None:
    """Why the planner cannot plan a `[job] kind = "command"` spec (the script's model is not in the spec), else
    None. A command spec that gives `[model]` (and `[train]`) is planned with them."""
    if run_spec.job_section.kind == "builtin" or "model" in (run_spec.raw or {}):
        return None
    return (f"[job] kind = {run_spec.job_section.kind!r}: the planner does not know your script's model, sequence "
            "length or batch, so it cannot say whether it fits; describe them in the spec's [model] and [train] "
            "sections (as for the built-in job) to plan them")


def register_plan(app: typer.Typer) -> None:
    """Add the `plan` command to an ulyssesctl Typer app."""

    @app.command("plan")
    def plan_cmd(
        spec: Path = typer.Option(..., "--spec", help="Run spec TOML."),
        gpu: str | None = typer.Option(None, "--gpu", help=f"GPU preset: {', '.join(sorted(GPU_PRESETS))} "
                                       "(plan for another machine: sets GPU memory and assumes the preset's usual host "
                                       "RAM unless --host-mem). Default: this host's GPU (torch.cuda) and RAM; "
                                       f"{DEFAULT_GPU}, said as assumed, when this host has no GPU."),
        gpus: int | None = typer.Option(None, "--gpus", min=1, max=GPUS_MAX,
                                        help="GPUs per node: replaces launcher.nproc_per_node (default it)."),
        nodes: int | None = typer.Option(None, "--nodes", min=1, max=NODES_MAX,
                                         help="Nodes: replaces launcher.nnodes (default it)."),
        gpu_mem: float | None = typer.Option(None, "--gpu-mem", callback=_gib_flag("--gpu-mem", GPU_MEM_MAX_GIB),
                                             help="GPU memory per GPU, GiB (overrides --gpu)."),
        host_mem: float | None = typer.Option(None, "--host-mem", callback=_gib_flag("--host-mem", HOST_MEM_MAX_GIB),
                                              help="Host RAM per node, GiB."),
        nvme: float | None = typer.Option(None, "--nvme", callback=_gib_flag("--nvme", NVME_MAX_GIB, zero_ok=True),
                                          help="NVMe per node for ZeRO-Infinity swap, GiB."),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    ) -> None:
        """Plan a run's memory. Will it fit? Per-GPU/per-host memory, verdict, and the cheapest changes that would fit.
        Exit 0 fits, 1 does not fit, 2 bad input."""
        from ulyssesd.daemon.spec import load_run_spec

        try:
            run_spec = _load_for_layout(load_run_spec, spec, gpus, nodes)
            unknown = _model_unknown(run_spec)
            if unknown:
                raise PlanInputError(unknown)
            cluster = _cluster_from_flags(run_spec, gpu, gpus, nodes, gpu_mem, host_mem, nvme)
            result = plan(run_spec.job, cluster, effective_ds_config(run_spec, cluster.world_size),
                          allocator_headroom=allocator_headroom(run_spec), restart=_restart(run_spec),
                          alloc_conf=(run_spec.launcher.env or {}).get("PYTORCH_CUDA_ALLOC_CONF"))
        except SpecError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except (PlanInputError, ValueError) as exc:
            typer.echo(f"cannot plan {spec}: {exc}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        interval = checkpoint_interval_suggestion(result, run_spec.job.checkpoint.async_save)
        costs = [{"lever": name, "step_time_fraction": round(c.fraction, 4), "source": c.source}
                 for name, c in cost_table(run_spec.job.resolved_model(), run_spec.job.train.seq_len)]
        typer.echo(json.dumps({**result.to_dict(), "lever_costs": costs, "checkpoint_interval": interval}, indent=2)
                   if as_json
                   else result.render() + "\n" + _render_interval(interval))
        raise typer.Exit(EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT)
