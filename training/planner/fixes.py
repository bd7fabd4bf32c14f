"""The fix search: combinations of experiment- and hardware-preserving memory levers, each planned with the cost
model, the fitting ones ranked by predicted step-time cost (`step_cost.py`), then by distance from the user's config.

A lever is one knob with its settings (the user's own among them): micro-batch / accumulation (global batch
kept), recompute (none, every k = 1, 2, 4, 8, the first N blocks, each with or without keep-attention), tiled loss, TiledMLP,
checkpointed inputs offloaded to host RAM, expandable segments, the persistence threshold, live parameters +
prefetch, optimizer / parameter offload to CPU; and the host switches the spec has on (`[restart]
standby_preload` / `standby`, `[checkpoint] async_save`), tried per planned combination where host RAM (or the
standby's GPU share) is what is missing (`host_levers`). Model, sequence length, global batch, SP degree and the hardware
never change here: those are advice (`search.py`), listed after every fix.

Exhaustive when the space is small (`EXHAUSTIVE_MAX` combinations); otherwise best-first over the lattice of
settings sorted by cost: a combination's cost is a sum of its settings' costs, so every combination reached by
raising one setting costs at least as much, and combinations leave the frontier in non-decreasing cost order.
The cost of a frontier entry is thus a lower bound of every combination not yet planned; the search stops once
that bound exceeds the k-th fit's cost, so the fits it returns are the cheapest by the model (the same as the
exhaustive search's: tests/planner/test_planner_fixes.py). A plan budget (`MAX_PLANS`) bounds the work; hitting
it is said (`FixSearch.complete` False).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from ..spec import JobSpec
from .cost_model import compute_plan
from .host_extras import NO_STANDBY, Restart, RestartLike
from .inputs import EXPANDABLE_HEADROOM, Cluster, GiB, PlanInputError, ZeroSettings
from .overrides import apply_overrides
from .rendering import Plan
from .step_cost import (
    LIVE_PARAMS_HALVED,
    OFFLOAD_CHECKPOINTS,
    OFFLOAD_OPTIMIZER,
    OFFLOAD_PARAMS,
    PERSISTENCE_LOWER,
    STANDBY_OFF,
    SYNC_SAVES,
    micro_batch_cost,
    recompute_cost,
    tiled_loss_cost,
    tiled_mlp_cost,
)

ALLOC_KEY = "launcher.env.PYTORCH_CUDA_ALLOC_CONF"
ZERO = "deepspeed.config.zero_optimization."
TILED_LOSS_TOKENS = 4096     # train.loss_chunk_tokens the search sets (the shipped configs' chunk)
TILED_MLP_TOKENS = 16384     # model.mlp_chunk_tokens the search sets (ALST's TiledMLP; docs/TRAINING.md)
RECOMPUTE_EVERY = (1, 2, 4, 8)   # train.activation_checkpoint_every the search tries (the user's own too)
LIVE_FLOOR, PREFETCH_FLOOR = 10_000_000, 1_000_000   # the memory ladder's floors (remediation config defaults)
EXHAUSTIVE_MAX = 4096        # combinations: plan them all
MAX_PLANS = 20_000           # best-first: at most this many plans per search
MAX_FIXES = 5


@dataclass(frozen=True)
class Setting:
    """One setting of one lever: what it changes against the user's config and what it costs."""

    what: str                    # in words ("" = the user's own setting)
    overrides: dict[str, Any]    # dotted keys (train.*, model.*, deepspeed.config.*, launcher.env.*)
    cost: float                  # absolute step-time fraction of this setting (the user's own included)
    distance: int = 0            # how far from the user's setting (0 = unchanged)


@dataclass(frozen=True)
class Lever:
    name: str
    settings: tuple[Setting, ...]   # sorted by cost; the user's own is among them (distance 0)


@dataclass
class Fix:
    """A fitting combination: its changes, predicted extra step time and its plan's figures."""

    changes: list[str]
    overrides: dict[str, Any]
    step_cost: float          # predicted extra step time over the user's config (fraction; may be < 0)
    distance: int             # levers changed (micro-batch halvings count each)
    gpu_required_gib: float
    gpu_margin_gib: float     # after the calibration (`under_gib`)
    peak_allocated_gib: float
    host_required_gib: float

    def describe(self) -> str:
        return (f"{' + '.join(self.changes)} (predicted step time {self.step_cost:+.1%}; GPU "
                f"{self.gpu_required_gib:.1f} GiB, margin {self.gpu_margin_gib:+.1f})")

    def to_dict(self) -> dict[str, Any]:
        return {"changes": self.changes, "overrides": self.overrides, "step_cost": round(self.step_cost, 4),
                "distance": self.distance, "gpu_required_gib": round(self.gpu_required_gib, 2),
                "gpu_margin_gib": round(self.gpu_margin_gib, 2), "peak_allocated_gib": round(self.peak_allocated_gib, 2),
                "host_required_gib": round(self.host_required_gib, 1)}


@dataclass
class FixSearch:
    fixes: list[Fix]
    plans: int                 # combinations planned
    space: int                 # combinations in the lever space
    exhaustive: bool           # every combination was planned
    complete: bool             # the fixes are provably the cheapest by the model (False: MAX_PLANS hit first)
    levers: list[str] = field(default_factory=list)
    pruned: int = 0            # lever settings removed before the search (cannot fit with every other lever saving)
    proven_none: bool = False  # the most memory-saving combination does not fit the GPU: no combination does

    def describe(self) -> str:
        if self.proven_none:
            return (f"{self.plans} of {self.space} lever combinations planned: even every lever at its most "
                    "memory-saving setting does not fit the GPU, so none does")
        how = "exhaustive" if self.exhaustive else ("best-first, provably cheapest by the cost model"
                                                     if self.complete else f"SEARCH INCOMPLETE: stopped after "
                                                     f"{self.plans} plans, a fit may exist beyond them")
        cut = f", {self.pruned} lever settings pruned as unable to fit" if self.pruned else ""
        return f"{self.plans} of {self.space} lever combinations planned ({how}{cut})"


# ------------------------------------------------------------------------------------------------ levers
def _micro_batch(job: JobSpec) -> Lever:
    b, ga = job.train.micro_batch_size, job.train.gradient_accumulation_steps
    local = job.train.seq_len // job.parallel.sequence_parallel_size
    out = []
    for d in sorted((d for d in range(1, b + 1) if b % d == 0), reverse=True):
        halvings = round(math.log2(b / d))
        if d == b:
            out.append(Setting("", {}, 0.0))
            continue
        out.append(Setting(f"micro-batch {b} -> {d} x accumulation {ga} -> {ga * b // d} (global batch kept)",
                           {"train.micro_batch_size": d, "train.gradient_accumulation_steps": ga * b // d},
                           micro_batch_cost(d * local, halvings), max(1, halvings)))
    return Lever("micro-batch", tuple(sorted(out, key=lambda s: s.cost)))


def _recompute(job: JobSpec) -> Lever:
    m = job.resolved_model()
    L = m.num_layers
    cur = (job.train.activation_checkpoint_every, job.train.activation_checkpoint_layers,
           bool(m.checkpoint_keep_attention))

    def blocks(every: int, layers: int | None) -> int:
        return min(layers, L) if layers is not None else (L if every else 0)

    def words(every: int, layers: int | None, keep: bool) -> str:
        if layers is not None:
            base = f"recompute the first {layers} of {L} blocks"
        elif every == 0:
            return "no recompute"
        else:
            base = "recompute every layer" if every == 1 else f"recompute in chunks of {every} blocks"
        return base + (" (keep attention)" if keep else "")

    cands: set[tuple[int, int | None, bool]] = {cur, (0, None, False)}
    for keep in (False, True):
        for every in RECOMPUTE_EVERY:   # chunk size: fewer saved inputs vs a larger recomputed chunk
            if every <= L:
                cands.add((every, None, keep))
        for n in range(1, L):
            cands.add((0, n, keep))
    out = []
    for every, layers, keep in cands:
        n = blocks(every, layers)
        if n == 0 and keep != cur[2] and cur != (every, layers, keep):
            keep = cur[2]   # keep-attention means nothing without recompute: leave the user's flag alone
        ov: dict[str, Any] = {}
        if every != cur[0]:
            ov["train.activation_checkpoint_every"] = every
        if layers != cur[1]:
            ov["train.activation_checkpoint_layers"] = layers
        if keep != cur[2]:
            ov["model.checkpoint_keep_attention"] = keep
        same = (every, layers, keep) == cur
        out.append(Setting("" if same else words(every, layers, keep), ov, recompute_cost(m, n, keep and n > 0),
                           0 if same else 1))
    uniq = {tuple(sorted(s.overrides.items())): s for s in out}
    return Lever("recompute", tuple(sorted(uniq.values(), key=lambda s: (s.cost, s.distance, s.what))))


def _toggle(name: str, current_cost: float, what: str, overrides: dict[str, Any], cost: float) -> Lever:
    return Lever(name, tuple(sorted((Setting("", {}, current_cost), Setting(what, overrides, cost, 1)),
                                    key=lambda s: (s.cost, s.distance))))


def levers(job: JobSpec, ds: dict[str, Any], alloc_conf: str | None, headroom_lever: bool = True) -> list[Lever]:
    """The experiment- and hardware-preserving levers of this job, each with the user's setting and the others."""
    m = job.resolved_model()
    seq, local = job.train.seq_len, job.train.seq_len // job.parallel.sequence_parallel_size
    out = [_micro_batch(job), _recompute(job)]
    chunk = job.train.loss_chunk_tokens
    tl = tiled_loss_cost(m, seq).fraction
    if chunk == 0 or chunk > TILED_LOSS_TOKENS:
        out.append(_toggle("tiled loss", tl if chunk else 0.0, f"tiled loss (train.loss_chunk_tokens = "
                           f"{TILED_LOSS_TOKENS})", {"train.loss_chunk_tokens": TILED_LOSS_TOKENS}, tl))
    tm = tiled_mlp_cost(m, seq).fraction
    if not m.mlp_chunk_tokens and job.train.micro_batch_size * local > TILED_MLP_TOKENS:
        out.append(_toggle("TiledMLP", 0.0, f"TiledMLP (model.mlp_chunk_tokens = {TILED_MLP_TOKENS})",
                           {"model.mlp_chunk_tokens": TILED_MLP_TOKENS}, tm))
    if not m.offload_checkpoints:
        out.append(_toggle("activation offload", 0.0, "checkpointed block inputs offloaded to pinned host RAM "
                           "(model.offload_checkpoints)", {"model.offload_checkpoints": True},
                           OFFLOAD_CHECKPOINTS.fraction))
    if headroom_lever and "expandable_segments:true" not in (alloc_conf or "").replace(" ", "").lower():
        new = f"{alloc_conf},expandable_segments:True" if alloc_conf else "expandable_segments:True"
        out.append(_toggle("allocator", 0.0, f"PYTORCH_CUDA_ALLOC_CONF={new}", {ALLOC_KEY: new}, 0.0))
    z = ZeroSettings.from_ds_config(ds)
    if z.param_persistence_threshold > 0:
        out.append(_toggle("persistence", 0.0, f"stage3_param_persistence_threshold {z.param_persistence_threshold:g}"
                           " -> 0 (no resident parameters)", {ZERO + "stage3_param_persistence_threshold": 0},
                           PERSISTENCE_LOWER.fraction))
    live = [Setting("", {}, 0.0)]
    lv, pf = z.max_live_parameters, z.prefetch_bucket_size
    for i in (1, 2):
        nl, npf = max(LIVE_FLOOR, lv >> i), max(PREFETCH_FLOOR, pf >> i)
        if (nl, npf) != (lv, pf) and (nl, npf) != (max(LIVE_FLOOR, lv >> (i - 1)), max(PREFETCH_FLOOR, pf >> (i - 1))):
            live.append(Setting(f"stage3_max_live_parameters {lv:g} -> {nl:g}, stage3_prefetch_bucket_size "
                                f"{pf:g} -> {npf:g}", {ZERO + "stage3_max_live_parameters": nl,
                                                       ZERO + "stage3_prefetch_bucket_size": npf},
                                LIVE_PARAMS_HALVED.fraction * i, 1))
    if len(live) > 1:
        out.append(Lever("live parameters", tuple(live)))
    if z.offload_optimizer == "none":
        off = [Setting("", {}, 0.0), Setting("offload the optimizer to CPU", {ZERO + "offload_optimizer.device": "cpu"},
                                             OFFLOAD_OPTIMIZER.fraction, 1)]
        if z.offload_param == "none":
            off.append(Setting("offload the optimizer and the parameters to CPU",
                               {ZERO + "offload_optimizer.device": "cpu", ZERO + "offload_param.device": "cpu"},
                               OFFLOAD_OPTIMIZER.fraction + OFFLOAD_PARAMS.fraction, 2))
        out.append(Lever("offload", tuple(off)))
    return out


def host_levers(job: JobSpec, restart: RestartLike) -> list[Lever]:
    """The daemon's host-memory switches the spec has on: the warm standby (its preloaded tag, or the standby
    itself) and async saves (their snapshot pool). They keep the experiment and the hardware; they free host
    RAM (and the standby's CUDA context on the GPU)."""
    out = []
    if restart.standby:
        settings = [Setting("", {}, 0.0)]
        if restart.standby_preload:
            settings.append(Setting("[restart] standby_preload = false (the standby stays warm; restarts load the "
                                    "tag from disk)", {"restart.standby_preload": False}, STANDBY_OFF.fraction, 1))
        settings.append(Setting("[restart] standby = false (relaunches are cold)", {"restart.standby": False},
                                STANDBY_OFF.fraction, 1 + int(restart.standby_preload)))
        out.append(Lever("warm standby", tuple(settings)))
    if job.checkpoint.async_save:
        out.append(_toggle("async saves", 0.0, "[checkpoint] async_save = false (saves block training while they "
                           "write)", {"checkpoint.async_save": False}, SYNC_SAVES.fraction))
    return out


# ------------------------------------------------------------------------------------------------ search
def search_fixes(job: JobSpec, cluster: Cluster, ds: dict[str, Any], *, allocator_headroom: float,
                 cuda_context_gib: float, restart: RestartLike = NO_STANDBY, alloc_conf: str | None = None,
                 under_gib: float = 0.0, peak_limit_gib: float | None = None, k: int = MAX_FIXES,
                 max_plans: int = MAX_PLANS, exhaustive_max: int = EXHAUSTIVE_MAX,
                 headroom_lever: bool = True, daemon_levers: bool = True, prune: bool = True) -> FixSearch:
    """The `k` cheapest fitting lever combinations (by predicted step time, then distance), none dominated by a
    cheaper one that changes a subset of its levers. `under_gib`: what the planner is known to miss (an OOM's
    allocated + requested, or a measured peak, above its prediction), added to every candidate; `peak_limit_gib`:
    the calibrated peak must also stay below it (a memory spike's threshold). `alloc_conf`: the run's
    PYTORCH_CUDA_ALLOC_CONF (the allocator lever); `allocator_headroom` is the user's current one.
    `daemon_levers`: also the host-memory switches `host_levers` (`restart.*`, `checkpoint.async_save`).
    `prune`: remove the settings that cannot fit first (`_prune`; off only to check it against the full space)."""
    lv = levers(job, ds, alloc_conf, headroom_lever)
    hv = host_levers(job, restart) if daemon_levers else []
    # The host switches are tried per planned combination (only where they can help), not multiplied into the
    # lattice: they cost no or little step time, so a lattice with them would hold many near-equal combinations.
    host_options = sorted(itertools.product(*(range(len(x.settings)) for x in hv)),
                          key=lambda o: (sum(x.settings[i].cost for x, i in zip(hv, o, strict=True)),
                                         sum(x.settings[i].distance for x, i in zip(hv, o, strict=True))))
    base_cost = sum(s.cost for lever in lv + hv for s in lever.settings if s.distance == 0)
    space = math.prod(len(lever.settings) for lever in lv) * max(1, len(host_options))
    plans = visited = 0   # plans made; lattice combinations planned (each may add host-switch plans)
    found: list[tuple[float, int, tuple[int, ...], Fix]] = []

    def plan_of(ov: dict[str, Any]) -> Plan | None:
        nonlocal plans
        plans += 1
        headroom = EXPANDABLE_HEADROOM if ALLOC_KEY in ov else allocator_headroom
        try:
            j, cl, d = _apply(job, cluster, ds, {k_: v for k_, v in ov.items() if k_ != ALLOC_KEY})
            return compute_plan(j, cl, d, allocator_headroom=headroom, cuda_context_gib=cuda_context_gib,
                                restart=_restart_with(restart, ov))
        except (PlanInputError, ValueError):
            return None   # a combination the job rejects (e.g. activation offload without recompute)

    # Memory-monotone pruning before the search: a setting that does not fit the GPU even with every other
    # lever at its most memory-saving setting can fit in no combination; when the all-saving combination
    # itself does not fit, no combination does (proven without planning them).
    lv, pruned, none_fit = _prune(lv, hv, plan_of, under_gib, peak_limit_gib) if prune else (lv, 0, False)
    all_levers = lv + hv
    sizes = [len(lever.settings) for lever in lv]
    if none_fit:
        return FixSearch([], plans, space, False, True, [x.name for x in all_levers], pruned, proven_none=True)

    def cost(idx: tuple[int, ...]) -> float:
        return sum(lever.settings[i].cost for lever, i in zip(lv, idx, strict=True))

    def evaluate(idx: tuple[int, ...]) -> tuple[tuple[int, ...], Fix] | None:
        nonlocal visited
        visited += 1
        chosen = [lever.settings[i] for lever, i in zip(lv, idx, strict=True)]
        ov: dict[str, Any] = {}
        for s in chosen:
            ov.update(s.overrides)
        p = plan_of(ov)
        if p is None:
            return None
        opt = host_options[0] if host_options else ()
        if not fits(p, under_gib, peak_limit_gib):
            host_short = p.host_margin_gib < 0
            standby_gpu = sum(it.bytes for it in p.items if it.where == "gpu" and it.outside_allocator) / GiB
            gpu_short = -min(0.0, p.gpu_margin_gib - under_gib)
            p = None
            for o in host_options[1:]:
                hs = [x.settings[i] for x, i in zip(hv, o, strict=True)]
                frees_gpu = any(st.overrides.get("restart.standby") is False for st in hs)
                if not host_short and not (frees_gpu and gpu_short <= standby_gpu):
                    continue   # this switch cannot make up what is missing
                hov = dict(ov)
                for st in hs:
                    hov.update(st.overrides)
                q = plan_of(hov)
                if q is not None and fits(q, under_gib, peak_limit_gib):
                    p, opt, ov = q, o, hov
                    break
            if p is None:
                return None
        chosen += [x.settings[i] for x, i in zip(hv, opt, strict=True)]
        return idx + tuple(opt), Fix([s.what for s in chosen if s.distance], ov, sum(s.cost for s in chosen) - base_cost,
                                     sum(s.distance for s in chosen), p.gpu_required / GiB, p.gpu_margin_gib - under_gib,
                                     p.gpu_peak_allocated / GiB + under_gib, p.host_required / GiB)

    def changed(idx: tuple[int, ...]) -> frozenset[tuple[int, int]]:
        return frozenset((i, v) for i, v in enumerate(idx[:len(lv)]) if lv[i].settings[v].distance)

    fit_parts: list[tuple[frozenset[tuple[int, int]], float]] = []   # a fit's lattice changes and lattice cost

    def adds_to_a_fit(idx: tuple[int, ...], c: float) -> bool:
        """Whether `idx` makes a found fit's lattice changes and more, at no lower cost: at best it adds changes
        to that fit (the lattice levers never lower host memory), so it is not planned."""
        mine = changed(idx)
        return any(part <= mine and c >= pc - 1e-12 for part, pc in fit_parts)

    def keep(idx: tuple[int, ...], fx: Fix) -> None:
        if fx.changes:
            found.append((fx.step_cost, fx.distance, idx, fx))
            fit_parts.append((changed(idx), cost(idx[:len(lv)])))

    lattice = math.prod(sizes)
    exhaustive = lattice <= exhaustive_max
    complete = True
    if exhaustive:
        for idx in itertools.product(*(range(n) for n in sizes)):
            if hv and adds_to_a_fit(idx, cost(idx)):
                visited += 1
                continue
            got = evaluate(idx)
            if got is not None:
                keep(*got)
    else:
        start = tuple(0 for _ in sizes)
        frontier: list[tuple[float, tuple[int, ...]]] = [(cost(start), start)]
        seen = {start}
        kept: list[Fix] = []
        while frontier:
            c, idx = heapq.heappop(frontier)
            if len(kept) >= k and c - base_cost > kept[k - 1].step_cost + 1e-12:
                break   # every combination left costs at least c: the k cheapest are found
            if plans >= max_plans:
                complete = False
                break
            got = None if hv and adds_to_a_fit(idx, c) else evaluate(idx)
            if got is not None and got[1].changes:
                keep(*got)
                kept = _undominated(found, all_levers)
            for i in range(len(sizes)):
                if idx[i] + 1 < sizes[i]:
                    nxt = idx[:i] + (idx[i] + 1,) + idx[i + 1:]
                    if nxt not in seen:
                        seen.add(nxt)
                        heapq.heappush(frontier, (cost(nxt), nxt))
    # A best-first search that planned every combination (nothing fitted early) was exhaustive too.
    return FixSearch(_undominated(found, all_levers)[:k], plans, space, exhaustive or visited == lattice,
                     complete, [x.name for x in all_levers], pruned)


def gpu_fits(p: Plan, under_gib: float = 0.0, peak_limit_gib: float | None = None) -> bool:
    """The GPU half of `fits` (the quantity every lever lowers or leaves alone; host RAM is not monotone)."""
    return (p.gpu_required / GiB + under_gib <= p.cluster.gpu_mem_gib
            and (peak_limit_gib is None or p.gpu_peak_allocated / GiB + under_gib < peak_limit_gib))


def _prune(lv: list[Lever], hv: list[Lever], plan_of: Any, under_gib: float,
           peak_limit_gib: float | None) -> tuple[list[Lever], int, bool]:
    """(levers with the settings that cannot fit removed, settings removed, no combination can fit).

    The floor is each lever's most GPU-saving setting (two rounds of coordinate descent, the host switches at
    their most saving); a setting is removed when it does not fit the GPU with every other lever at the floor.
    This relies on the model being monotone per lever (another lever moved off its floor never lowers the GPU's
    need), which tests/planner/test_planner_fixes.py checks against the exhaustive search."""
    host_floor: dict[str, Any] = {}
    for x in hv:
        host_floor.update(x.settings[-1].overrides)
    floor = [next(i for i, s in enumerate(x.settings) if s.distance == 0) for x in lv]

    def need(choice: list[int]) -> tuple[float, Plan | None]:
        ov = dict(host_floor)
        for x, i in zip(lv, choice, strict=True):
            ov.update(x.settings[i].overrides)
        p = plan_of(ov)
        return (math.inf, None) if p is None else (p.gpu_required / GiB, p)

    for _round in range(2):
        for li, x in enumerate(lv):
            floor[li] = min(range(len(x.settings)), key=lambda i: need(floor[:li] + [i] + floor[li + 1:])[0])
    _n, p = need(floor)
    if p is not None and not gpu_fits(p, under_gib, peak_limit_gib):
        return lv, 0, True
    out, removed = [], 0
    for li, x in enumerate(lv):
        keep = []
        for i, st in enumerate(x.settings):
            _n, q = need(floor[:li] + [i] + floor[li + 1:])
            if q is None or gpu_fits(q, under_gib, peak_limit_gib):
                keep.append(st)   # an invalid combination proves nothing: kept
        removed += len(x.settings) - len(keep)
        out.append(Lever(x.name, tuple(keep)) if keep else x)
    return out, removed, False


def fits(p: Plan, under_gib: float = 0.0, peak_limit_gib: float | None = None) -> bool:
    """The plan's verdict with the calibration: what the planner is known to miss added to the GPU's need."""
    return (p.fits and p.gpu_required / GiB + under_gib <= p.cluster.gpu_mem_gib
            and (peak_limit_gib is None or p.gpu_peak_allocated / GiB + under_gib < peak_limit_gib))


def _undominated(found: list[tuple[float, int, tuple[int, ...], Fix]], lv: list[Lever]) -> list[Fix]:
    """Sorted by (cost, distance); a fit is dropped when a cheaper-or-equal one changes a subset of its levers
    with the same settings (it adds changes that buy nothing)."""
    out: list[tuple[tuple[int, ...], Fix]] = []
    for _c, _d, idx, fx in sorted(found, key=lambda t: (t[0], t[1], t[3].changes)):
        changed = {(i, v) for i, v in enumerate(idx) if lv[i].settings[v].distance}
        if any({(i, v) for i, v in enumerate(o) if lv[i].settings[v].distance} <= changed for o, _ in out):
            continue
        out.append((idx, fx))
    return [fx for _, fx in out]


def _restart_with(restart: RestartLike, overrides: dict[str, Any]) -> RestartLike:
    """`[restart]` after a combination's `restart.*` settings (standby off takes its preload with it)."""
    if not any(k.startswith("restart.") for k in overrides):
        return restart
    return Restart(standby=bool(overrides.get("restart.standby", restart.standby)),
                   standby_preload=bool(overrides.get("restart.standby_preload", restart.standby_preload)))


def _apply(job: JobSpec, cluster: Cluster, ds: dict[str, Any],
           overrides: dict[str, Any]) -> tuple[JobSpec, Cluster, dict[str, Any]]:

    return apply_overrides(job, cluster, ds, overrides)
