"""The memory planner's suggestion search: candidate changes (checkpointing, micro-batch, SP degree,
sequence length, offload, bigger GPUs, more host RAM, more nodes), each re-planned with the cost model;
those that fit are returned cheapest first, dominated ones dropped.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..ds_config import ZERO_STAGE, deep_merge
from ..spec import JobSpec
from .cost_model import compute_plan
from .host_extras import NO_STANDBY, Restart, RestartLike
from .inputs import (
    ALLOCATOR_HEADROOM,
    CUDA_CONTEXT_GIB,
    GPU_PRESETS,
    HOST_OS_RESERVE,
    Cluster,
    GiB,
    PlanInputError,
    ZeroSettings,
)
from .rendering import Plan, Suggestion


# ------------------------------------------------------------------------- suggestion search
@dataclass(frozen=True)
class _Scenario:
    job: JobSpec
    ds: dict[str, Any]
    cluster: Cluster
    restart: RestartLike = NO_STANDBY   # the daemon's [restart] (the warm standby holds host RAM)


# Relative costs: slowdown or hardware spend, roughly "how much would an operator mind". Documented in PLANNER.md.
MOVE_COSTS = {"no_offload": 0.0, "ckpt_every_layer": 1.0, "halve_micro_batch": 1.0, "double_sp": 1.5, "offload_optimizer_cpu": 3.0,
              "more_host_ram": 3.0, "offload_param_cpu": 4.0, "bigger_gpu": 5.0, "nvme_offload": 6.0,
              "more_nodes_per_doubling": 3.0, "halve_seq": 8.0, "tiled_mlp": 1.0, "offload_checkpoints": 2.0,
              "no_standby_preload": 0.5, "no_standby": 1.0, "sync_saves": 2.0}
# model.mlp_chunk_tokens the long-sequence move sets (ALST's TiledMLP; docs/TRAINING.md).
TILED_MLP_TOKENS = 16384


def _set_zero(ds: dict[str, Any], **kv: Any) -> dict[str, Any]:
    out = copy.deepcopy(ds)
    zo = out.setdefault("zero_optimization", {})
    zo.setdefault("stage", ZERO_STAGE)
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
    # Megatron chunk semantics (training/model/gpt.py): k=1 is not always the smallest (it keeps L inputs).
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
            trial = compute_plan(sc.job, replace(cluster, nvme_gib=1e9), ds,
                             allocator_headroom=ALLOCATOR_HEADROOM, cuda_context_gib=CUDA_CONTEXT_GIB)
            need = math.ceil(trial.nvme_required / GiB / 512) * 512
            if need > cluster.nvme_gib:
                changes.append(f"NVMe >= {need} GiB per node")
                ov["cluster.nvme_gib"] = need
                cluster = replace(cluster, nvme_gib=float(need))
        return replace(sc, ds=ds, cluster=cluster), changes, ov, cost
    return mv


def _mv_long_seq(tiled_mlp: bool, offload_ckpt: bool) -> Move:
    # ALST's long-sequence pieces: TiledMLP and checkpointed inputs offloaded to host RAM (both need recompute,
    # so they combine with the checkpointing group, which is applied first).
    def mv(sc: _Scenario, base: Plan):
        m = sc.job.model
        ch: dict[str, Any] = {}
        if tiled_mlp and not m.mlp_chunk_tokens and sc.job.train.seq_len // sc.job.parallel.sequence_parallel_size \
                > TILED_MLP_TOKENS:
            ch["model.mlp_chunk_tokens"] = TILED_MLP_TOKENS
        if offload_ckpt and not m.offload_checkpoints:
            ch["model.offload_checkpoints"] = True
        if len(ch) != tiled_mlp + offload_ckpt:
            return None
        j = _job_with(sc.job, **ch)
        what = {"model.mlp_chunk_tokens": f"TiledMLP (MLP over chunks of {TILED_MLP_TOKENS} tokens)",
                "model.offload_checkpoints": "checkpointed block inputs offloaded to pinned host RAM"}
        cost = MOVE_COSTS["tiled_mlp"] * tiled_mlp + MOVE_COSTS["offload_checkpoints"] * offload_ckpt
        return j and (replace(sc, job=j), [what[k] for k in ch], ch, cost)
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
    # Only the GPU changes: the host keeps the RAM planned for (the user's --host-mem or this host's); where host
    # RAM is what is short, the search's "host" step adds it as its own change.
    cl = replace(sc.cluster, gpu_mem_gib=big["gpu_mem_gib"], gpu_name=big["gpu_name"])
    return (replace(sc, cluster=cl), ["H200-141GB GPUs"], {"cluster.gpu": "h200-141g"}, MOVE_COSTS["bigger_gpu"])


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


def _mv_no_preload(sc: _Scenario, base: Plan):
    # A restart then loads the tag from disk (slower only when it is not in the page cache).
    r = sc.restart
    if not (r.standby and r.standby_preload):
        return None
    return (replace(sc, restart=Restart(standby=True, standby_preload=False)),
            ["[restart] standby_preload = false (the standby stays warm; restarts load the tag from disk)"],
            {"restart.standby_preload": False}, MOVE_COSTS["no_standby_preload"])


def _mv_no_standby(sc: _Scenario, base: Plan):
    # Every relaunch is cold (on 1x H200 gpt-1b: 27.8 s instead of 17.9 s, docs/DAEMON.md "Warm standby").
    if not sc.restart.standby:
        return None
    return (replace(sc, restart=Restart(standby=False, standby_preload=sc.restart.standby_preload)),
            ["[restart] standby = false (relaunches are cold)"], {"restart.standby": False}, MOVE_COSTS["no_standby"])


def _mv_sync_saves(sc: _Scenario, base: Plan):
    # Saves then block training for the whole write (gpt-1b on 1x H200: ~44 s instead of 0.33 s).
    if not sc.job.checkpoint.async_save:
        return None
    j = _job_with(sc.job, **{"checkpoint.async_save": False})
    return j and (replace(sc, job=j), ["[checkpoint] async_save = false (saves block training while they write)"],
                  {"checkpoint.async_save": False}, MOVE_COSTS["sync_saves"])


_MOVE_GROUPS: list[list[Move]] = [
    [_mv_ckpt(1), _mv_ckpt(2)],
    [_mv_halve_mb],
    [_mv_sp(2), _mv_sp(4), _mv_sp(8)],
    [_mv_no_offload, _mv_offload("cpu", "none"), _mv_offload("cpu", "cpu"), _mv_offload("nvme", "none"), _mv_offload("nvme", "cpu"),
     _mv_offload("nvme", "nvme")],
    [_mv_bigger_gpu],
    [_mv_seq(2), _mv_seq(4)],
    [_mv_long_seq(True, False), _mv_long_seq(False, True), _mv_long_seq(True, True)],
    [_mv_no_preload, _mv_no_standby, _mv_sync_saves],
]
MAX_NODES = 64
MAX_SUGGESTIONS = 8


def search_suggestions(job: JobSpec, cluster: Cluster, ds: dict[str, Any], base: Plan, *,
                       restart: RestartLike = NO_STANDBY, **kw: float) -> list[Suggestion]:
    found: list[tuple[float, frozenset[tuple[str, str]], Suggestion]] = []
    start = _Scenario(job, ds, cluster, restart)
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
            return compute_plan(s.job, s.cluster, s.ds, restart=s.restart, **kw)
        except PlanInputError:
            return None

    changes, ov = list(changes), dict(ov)
    if extra in ("nodes", "nodes+host"):
        if sc.restart.standby:
            return None   # the daemon refuses a warm standby on more than one node (docs/DAEMON.md)
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
