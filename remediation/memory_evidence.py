"""Evidence-driven memory remediation: read a CUDA OOM message, name its cause, and pick the memory-ladder
change predicted to fit instead of walking the ladder blind (issue 21).

Pure: the planner's view of a configuration comes in as plain data (`PlanView`) from a `Replan` callable the
daemon passes (daemon/operator/ctl_plan.py `memory_replanner`); nothing here imports the daemon or the training job.

Causes (`classify`, `CAUSE_RUNGS`): fragmentation, activations, model states. With a planner, the changes of
the cause (then the others) are applied cumulatively, each re-planned, until the patched config is predicted to
fit, calibrated by the OOM (allocated + requested bounds the failing config's peak from below). Nothing
predicted to fit: stop, with the planner's explanation. An OOM far above the attempt's own measured steady peak
is a transient spike, not the config (`Footprint`, `_transient`): relaunch unchanged first.

A memory spike in telemetry (no crash yet, `choose_spike`) goes the same way from the step's numbers: reserved
memory the allocator cannot reuse is fragmentation; the measured max_allocated calibrates the planner; a change
must bring the peak under the spike detector's threshold. Nothing predicted to fit is an alert, never a stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ulyssesd.remediation import playbook as pb
from ulyssesd.remediation.detectors.memory_spike import Footprint
from ulyssesd.remediation.diagnosis.oom_report import OomReport, parse_oom
from ulyssesd.remediation.playbook import K_ALLOC, LADDERS, STOP, Action, Context, Proposal

# Which memory-ladder rungs address which cause, cheapest first (rung kinds of playbook.LADDERS["memory"]).
CAUSE_RUNGS: dict[str, tuple[str, ...]] = {
    "fragmentation": ("expandable_segments",),
    "activations": ("halve_micro_batch", "checkpoint_every_layer"),
    "model_states": ("halve_live_parameters", "offload_optimizer"),
}
CAUSE_ORDER = ("fragmentation", "activations", "model_states")
MAX_CHANGES = 12   # cumulative changes tried per choice (micro-batch halvings included): bounded re-planning


@dataclass(frozen=True)
class PlanView:
    """The planner's view of one configuration, as plain data (GiB per GPU)."""

    fits: bool                 # the planner's verdict
    required_gib: float        # peak allocated + allocator headroom + CUDA context
    capacity_gib: float        # the GPU's usable memory
    peak_allocated_gib: float  # predicted torch.cuda.max_memory_allocated()
    model_states_gib: float    # parameter/gradient/optimizer shards, gathered params, buckets at the peak
    activations_gib: float     # saved activations, transients, logits at the peak
    problems: tuple[str, ...] = ()

    def sizes(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k.endswith("_gib")}


# Plan the current config with these dotted changes applied (the daemon's planner); raises ValueError when the
# patched config is not a valid one.
Replan = Callable[[dict[str, Any]], PlanView]


@dataclass(frozen=True)
class FixView:
    """One fitting combination of memory levers, as plain data: the patch the daemon applies, in words, its
    predicted extra step time (fraction) and the planner's view of the patched config."""

    patch: dict[str, Any]
    changes: tuple[str, ...]
    step_cost: float
    view: PlanView


@dataclass(frozen=True)
class FixSearchView:
    """What the planner's fix search found (training/planner/fixes.py): fits cheapest first, how it searched, and
    the hardware/experiment changes that would fit too (advice: never applied by the daemon)."""

    fixes: tuple[FixView, ...]
    searched: str
    advice: tuple[str, ...] = ()
    complete: bool = True      # False: the plan budget stopped the search (a fit may exist beyond it)


# The memory ladder's move when the planner can search: the cheapest fitting combination (not a rung of the
# ladder: the ladder's position is left alone, so the plain ladder still applies without a planner).
COMBINATION = Action("memory_combination", "restart_latest",
                     lambda c: Proposal(what="apply the cheapest memory-lever combination predicted to fit"))
MAX_ALTERNATIVES = 3   # fits named in the evidence besides the chosen one


def _searcher(replan: Any) -> Callable[[float, float | None], FixSearchView] | None:
    """The planner's fix search when `replan` offers one (ctl_plan.MemoryReplanner), else None."""
    fn = getattr(replan, "search", None)
    return fn if callable(fn) else None


def _search_choice(search: Callable[[float, float | None], FixSearchView], cause: str, said: str, under: float,
                   limit: float | None, evidence: dict[str, Any], problems: list[str], trusted: bool,
                   no_fit: Action, base: PlanView) -> MemoryChoice:
    """Apply the cheapest fitting combination (predicted step time, then fewest changes), or `no_fit` (a stop for
    an OOM, a note for a spike) with the advice; either way the combination, its cost and the advice in `evidence`."""
    try:
        found = search(under, limit)
    except Exception as exc:  # noqa: BLE001 - a failing search is said, and nothing is changed blind
        problems.append(f"fix search: {exc}")
        found = FixSearchView((), "the fix search failed")
    evidence.update(searched=found.searched, advice=list(found.advice),
                    alternatives=[{"changes": list(f.changes), "step_cost": round(f.step_cost, 4),
                                   "required_gib": round(f.view.required_gib, 2)}
                                  for f in found.fixes[1:1 + MAX_ALTERNATIVES]])
    advice = ("; advice (hardware or experiment changes, never applied automatically): " + "; ".join(found.advice)
              if found.advice else "; no hardware or experiment change found that fits either")
    if found.fixes:
        fx = found.fixes[0]
        evidence.update(combination=list(fx.changes), combination_patch=dict(fx.patch),
                        predicted_step_cost=round(fx.step_cost, 4), predicted_required_gib=fx.view.required_gib)
        what = (f"{' + '.join(fx.changes)}: the cheapest of the memory-lever combinations that keep the experiment and "
                f"the hardware predicted to fit, step time {fx.step_cost:+.1%} by the lever cost model ({said}; "
                f"{found.searched}; re-planned: {fx.view.required_gib:.1f} GiB needed of {fx.view.capacity_gib:.1f} GiB"
                + (f", +{under:.1f} GiB the planner missed" if under else "") + ")")
        if not trusted:
            what += "; the planner predicted the failing config to fit, so this is not a prediction"
        return MemoryChoice(cause, COMBINATION, Proposal(dict(fx.patch), what=what), True if trusted else None,
                            evidence)
    expl = f"{found.searched}; planner: " + ("; ".join([*base.problems, *problems]) or (
        f"needs {base.required_gib + under:.1f} GiB of {base.capacity_gib:.1f} GiB"))
    verb = "stop: " if no_fit is STOP else "no blind change: "
    evidence["search_complete"] = found.complete
    claim = ("no combination of memory levers that keeps the experiment and the hardware is predicted to fit"
             if found.complete else "SEARCH INCOMPLETE: the fix search ran out of plans before finding a fit (one "
             "may exist; `ulyssesctl plan` shows the search)")
    return MemoryChoice(cause, no_fit, Proposal(what=(
        f"{verb}{claim} "
        f"({said}; {expl}){advice}" + ("" if no_fit is STOP else "; the run continues unchanged"))), False, evidence)


@dataclass
class MemoryChoice:
    """What the evidence says to do: one decision's rung, patch and explanation."""

    cause: str                     # fragmentation | activations | model_states | unknown
    action: Action                 # the last rung whose change is part of the patch (STOP: cannot converge)
    proposal: Proposal             # the combined patch; `what` names the changes, the evidence, the prediction
    predicted_fit: bool | None     # None: no planner, the rung follows from the OOM message alone
    evidence: dict[str, Any] = field(default_factory=dict)


def _rung(kind: str) -> Action:
    return next(a for a in LADDERS["memory"] if a.kind == kind)


def _expandable_on(values: dict[str, Any]) -> bool:
    return "expandable_segments:true" in str(values.get(K_ALLOC) or "").replace(" ", "").lower()


def classify(oom: OomReport | None, base: PlanView | None, values: dict[str, Any]) -> tuple[str, str]:
    """(cause, why) from the OOM numbers and the planner's breakdown of the failing config."""
    if oom is not None and oom.reserved_unallocated_gib is not None \
            and oom.reserved_unallocated_gib >= oom.requested_gib and not _expandable_on(values):
        return "fragmentation", (f"{oom.reserved_unallocated_gib:.2f} GiB reserved but unallocated >= the "
                                 f"{oom.requested_gib:.2f} GiB requested")
    if base is not None and base.activations_gib + base.model_states_gib > 0:
        if base.activations_gib >= base.model_states_gib:
            return "activations", (f"planner: activations {base.activations_gib:.1f} GiB vs model states "
                                   f"{base.model_states_gib:.1f} GiB of the {base.peak_allocated_gib:.1f} GiB peak")
        return "model_states", (f"planner: model states {base.model_states_gib:.1f} GiB vs activations "
                                f"{base.activations_gib:.1f} GiB of the {base.peak_allocated_gib:.1f} GiB peak")
    return "unknown", "no planner breakdown and no sign of fragmentation"


def _calibrated_fit(view: PlanView, under_gib: float, peak_limit_gib: float | None = None) -> bool:
    """Fits with the measured shortfall added; with `peak_limit_gib` (a spike's threshold) the calibrated peak
    must also stay below it, or the spike detector would fire again on the changed config."""
    return (view.fits and view.required_gib + under_gib <= view.capacity_gib
            and (peak_limit_gib is None or view.peak_allocated_gib + under_gib < peak_limit_gib))


def _drop_unneeded(steps: list[tuple[str, dict[str, Any]]], patch: dict[str, Any], view: PlanView, under: float,
                   replan: Replan, limit: float | None = None) -> tuple[dict[str, Any], list[str], PlanView]:
    """Leave out earlier changes the fitting config does not need (a later rung alone may fit), re-planned."""
    kept = list(steps)
    for i in range(len(steps) - 2, -1, -1):
        what, own = steps[i]
        later = {k for _, p in kept[kept.index(steps[i]) + 1:] for k in p}
        mine = [k for k in own if k not in later]   # keys a later change overwrites are not this change's
        if not mine:
            continue
        trial_patch = {k: v for k, v in patch.items() if k not in mine}
        try:
            trial = replan(trial_patch)
        except Exception:  # noqa: BLE001 - keep the change when the smaller config cannot be planned
            continue
        if _calibrated_fit(trial, under, limit):
            patch, view = trial_patch, trial
            kept.remove(steps[i])
    return patch, [w for w, p in kept if any(k in patch for k in p)], view


@dataclass
class _Found:
    """The outcome of the cumulative search: the fitting patch (action None: nothing fitted) and its plan."""

    action: Action | None
    patch: dict[str, Any]
    changes: list[str]
    view: PlanView

    def what(self, said: str, under: float) -> str:
        return (f"{'; '.join(self.changes)} ({said}; re-planned: {self.view.required_gib:.1f} GiB needed of "
                f"{self.view.capacity_gib:.1f} GiB" + (f", +{under:.1f} GiB the planner missed" if under else "")
                + ")")


def _first_fit(ctx: Context, replan: Replan, base: PlanView, cause: str, under: float,
               limit: float | None, problems: list[str]) -> _Found:
    """Apply the rungs of `cause`, then the others', cumulatively, each re-planned, until the patched config is predicted to fit
    (calibrated by `under`, the peak below `limit` when given); then leave out the changes it does not need."""
    order = [*CAUSE_RUNGS.get(cause, ()), *(k for c in CAUSE_ORDER if c != cause for k in CAUSE_RUNGS[c])]
    values = dict(ctx.values)
    patch: dict[str, Any] = {}
    changes: list[str] = []
    view = base
    steps: list[tuple[str, dict[str, Any]]] = []   # (what, patch) of each change, in order
    for kind in order:
        action = _rung(kind)
        while len(changes) < MAX_CHANGES:
            built = action.build(replace(ctx, values=values))
            if isinstance(built, str):
                break
            try:
                trial = replan({**patch, **built.patch})
            except Exception as exc:  # noqa: BLE001 - e.g. a config the spec rejects: try the next rung
                problems.append(f"{action.kind}: {exc}")
                break
            patch.update(built.patch)
            values.update(built.patch)
            changes.append(built.what)
            steps.append((built.what, dict(built.patch)))
            view = trial
            if _calibrated_fit(view, under, limit):
                patch, changes, view = _drop_unneeded(steps, patch, view, under, replan, limit)
                return _Found(action, patch, changes, view)
            if kind != "halve_micro_batch":
                break   # one use per rung; only the micro-batch halves again
    return _Found(None, patch, changes, view)


def choose(lines: Iterable[str] | str | dict[str, Any] | None, ctx: Context,
           replan: Replan | None = None, footprint: Footprint | None = None) -> MemoryChoice | None:
    """The evidence-driven memory decision for a CUDA OOM (`lines`: the crash diagnosis' evidence lines, or its
    dict of them), or None when there is no evidence to go on (no parsable OOM and no planner): the plain ladder
    applies then. `footprint`: the failing attempt's own measured memory (a transient spike is no config change)."""
    if not isinstance(lines, str):
        lines = [str(x) for x in (lines.values() if isinstance(lines, dict) else lines or [])]
    oom = parse_oom(lines)
    base: PlanView | None = None
    problems: list[str] = []
    if replan is not None:
        try:
            base = replan({})
        except Exception as exc:  # noqa: BLE001 - a planner that fails leaves the message alone to go on
            problems.append(f"planner: {exc}")
    steady = _transient(oom, base, footprint, ctx) if footprint is not None and oom is not None else None
    if isinstance(steady, MemoryChoice):
        return steady
    cause, why = classify(oom, base, ctx.values)
    evidence: dict[str, Any] = {"cause": cause, "why": why, "oom": oom.to_dict() if oom else None}
    if base is not None:
        evidence["plan"] = base.sizes()
    if oom is None and base is None:
        return None
    said = (oom.describe() if oom else "CUDA OOM (no sizes in the message)") + f"; cause: {cause} ({why})"
    if base is None:
        # No planner: the cause's first applicable rung, from the message alone (fragmentation only).
        if cause == "unknown":
            return None
        for kind in CAUSE_RUNGS[cause]:
            built = _rung(kind).build(ctx)
            if isinstance(built, Proposal):
                return MemoryChoice(cause, _rung(kind), replace(built, what=f"{built.what} ({said})"), None, evidence)
        return None
    assert replan is not None  # `base` came from it
    # The OOM is a lower bound on the failing config's peak: a planner that predicted less is short by that much.
    under = 0.0
    if steady is not None:   # a recurring spike: its total is not the config's; the measured steady peak is
        under = max(0.0, steady - base.peak_allocated_gib)
        said += (f"; it recurred after relaunching unchanged: calibrated by the measured steady peak "
                 f"{steady:.1f} GiB, not the OOM's total")
        evidence["steady_peak_gib"] = steady
    elif oom is not None and oom.allocated_gib is not None:
        under = max(0.0, oom.allocated_gib + oom.requested_gib - base.peak_allocated_gib)
    evidence["planner_shortfall_gib"] = under
    trusted = not _calibrated_fit(base, under)   # the planner explains the OOM (with the OOM's own correction)
    # The search when the planner explains the OOM and it is no fragmentation (measured waste: expandable segments
    # first); a planner that thought the failing config fits predicts nothing: the cause's rungs, as before.
    search = _searcher(replan) if cause != "fragmentation" and trusted else None
    if search is not None:
        return _search_choice(search, cause, said, under, None, evidence, problems, trusted, STOP, base)
    found = _first_fit(ctx, replan, base, cause, under, None, problems)
    view, changes = found.view, found.changes
    if found.action is not None:
        what = found.what(said, under)
        evidence["predicted_required_gib"] = view.required_gib
        if trusted:
            return MemoryChoice(cause, found.action, Proposal(found.patch, what=what), True, evidence)
        # The planner said the config that just failed fits and the message gives no allocated bytes
        # to correct it: its "fits" now is no prediction (the no-progress rule keeps applying).
        what += "; the planner predicted the failing config to fit, so this is not a prediction"
        return MemoryChoice(cause, found.action, Proposal(found.patch, what=what), None, evidence)
    expl = "; ".join([*view.problems, *problems]) or (
        f"needs {view.required_gib + under:.1f} GiB of {view.capacity_gib:.1f} GiB")
    tried = ", ".join(changes) or "nothing applicable"
    return MemoryChoice(cause, STOP, Proposal(what=f"stop: no memory change is predicted to fit ({said}; tried "
                                                   f"{tried}; planner: {expl})"), False, evidence)


# ------------------------------------------------------------------------------------------ transient OOMs
# An OOM whose allocated bytes exceed the attempt's measured steady peak by more than this share of the GPU (or
# the planner's allocator headroom, when larger) is a spike outside the config's own footprint.
TRANSIENT_FRAC = 0.15
SAME_STEP_TOLERANCE = 1   # steps: "the same step" of a recurrence
RELAUNCH = Action("relaunch_unchanged", "restart_latest", lambda c: Proposal(what="relaunch unchanged"))


def _transient(oom: OomReport, base: PlanView | None, fp: Footprint, ctx: Context) -> MemoryChoice | float | None:
    """The transient reading of an OOM: a choice (relaunch unchanged; the batches of a recurrence at the same
    step skipped), the measured steady peak to calibrate the ladder by (a recurrence elsewhere or after the
    skip), or None (no steady peak or no wide margin: the OOM is the config's, today's path)."""
    step, ep = fp.oom_step(), fp.episode
    evidence: dict[str, Any] = {"oom": oom.to_dict(), "steady": {k: getattr(fp, k) for k in (
        "peak_gib", "steps", "first_step", "last_step", "config_version")}}
    if ep is not None and fp.restarts == ep["restarts"] + 1 and (
            step is None or step <= ep["oom_step"] + ctx.policy.verify_steps):
        # The attempt right after a transient decision ran out of memory again before it got past the window.
        fp.episode = None
        peak = max(p for p in (ep["peak_gib"], fp.steady_peak()) if p is not None)
        last = fp.last_record
        if step is None or abs(step - ep["oom_step"]) > SAME_STEP_TOLERANCE or ep["skipped"] or last is None \
                or last.samples is None:
            return peak   # elsewhere, or again after the skip: not that batch (or no sample range to skip)
        fp.episode = {**ep, "restarts": fp.restarts, "skipped": True}
        lo, hi = min(step, ep["oom_step"]), max(step, ep["oom_step"]) + 1   # the steps that ran out of memory
        at, (a, b) = last.step, last.samples
        skip = (a + (lo - at) * (b - a), a + (hi - at) * (b - a))   # their samples, from the last step's range
        tag, to_step = fp.checkpoint or (None, 0)
        plan = pb.RollbackPlan(to_step, tag, [skip], (lo, hi), lo != at + 1)
        why = (f"the OOM recurred in step {step} after relaunching unchanged (the first in step {ep['oom_step']}; "
               f"steady peak {peak:.1f} GiB): step- or data-driven; the weights are sound, so from the latest "
               f"checkpoint ({tag or 'none: from the start'})")
        evidence.update(cause="step_driven", why=why, first_oom_step=ep["oom_step"], steady_peak_gib=peak)
        patch = {pb.K_SKIP: pb.merge_ranges([(int(x), int(y)) for x, y in (ctx.get(pb.K_SKIP) or [])] + [skip])}
        return MemoryChoice("step_driven", pb.ROLLBACK, Proposal(patch, what=(
            f"skip the batches of steps {lo}-{hi - 1} (samples {[skip]}) ({why})"), apply="rollback_skip",
            rollback=plan), None, evidence)
    steady = fp.steady_peak()
    capacity = oom.total_gib if oom.total_gib is not None else (base.capacity_gib if base else None)
    if steady is None or oom.allocated_gib is None or capacity is None:
        return None
    headroom = base.required_gib - base.peak_allocated_gib if base is not None else 0.0
    margin, excess = max(TRANSIENT_FRAC * capacity, headroom), oom.allocated_gib - steady
    if excess <= margin:
        return None
    fp.episode = {"restarts": fp.restarts, "oom_step": step, "peak_gib": steady, "skipped": False}
    why = (f"steps {fp.first_step}-{fp.last_step} peaked at {steady:.1f} GiB under this config"
           + (f" v{fp.config_version}" if fp.config_version is not None else "")
           + (f" (planner {base.peak_allocated_gib:.1f})" if base is not None else "") + "; "
           f"the OOM had {oom.allocated_gib:.1f} GiB allocated, +{excess:.1f} GiB beyond it (margin {margin:.1f} "
           f"GiB: {TRANSIENT_FRAC:.0%} of {capacity:.1f} GiB or the planner's headroom): transient; "
           "relaunching unchanged")
    evidence.update(cause="transient", why=why, excess_gib=excess, margin_gib=margin, oom_step=step,
                    plan=base.sizes() if base is not None else None)
    return MemoryChoice("transient", RELAUNCH, Proposal(what=f"relaunch unchanged from the latest checkpoint "
                                                              f"({why})"), None, evidence)


# ------------------------------------------------------------------------------------------ memory spikes
# The planner budgets 8 % of the allocated peak for normal caching-allocator slack (5-10 % is seen); a
# reserved-but-unallocated share above this is more than normal slack: fragmentation.
FRAGMENTATION_FRAC = 0.10
# A spike is not a crash: when nothing is predicted to fit (or nothing is needed) the run goes on unchanged
# and the operator gets an incident that says so (apply "none": no restart, no stop).
SPIKE_NOTE = Action("alert", "none", lambda c: Proposal(what="record and alert the operator"))


def _num(ev: dict[str, Any], key: str) -> float | None:
    v = ev.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def spike_fragmentation(peak: float, reserved: float | None, capacity: float | None,
                        values: dict[str, Any]) -> str | None:
    """Why a step's numbers show fragmentation (None: they do not): the allocator holds reserved-but-unallocated
    memory beyond normal slack AND at least as much as the device has left (expandable segments would give it
    back), with expandable segments off. reserved - max_allocated, not - allocated: after the step the
    activations are freed but stay cached for the next step's peak, which is not fragmentation."""
    if reserved is None or capacity is None or _expandable_on(values):
        return None
    unalloc, headroom = reserved - peak, max(0.0, capacity - reserved)
    if unalloc > FRAGMENTATION_FRAC * peak and unalloc >= headroom:
        return (f"{unalloc:.2f} GiB reserved but unallocated (> {FRAGMENTATION_FRAC:.0%} of the peak) >= the "
                f"{headroom:.2f} GiB the device has left")
    return None


def choose_spike(ev: dict[str, Any], ctx: Context, replanner: Callable[[], Replan | None] | None,
                 capacity_frac: float) -> MemoryChoice | None:
    """The evidence-driven decision for a memory_spike finding (no crash yet), from its numbers (evidence of
    detectors/memory_spike.py: mem_max_allocated_gib, mem_reserved_gib, capacity_gib) and the planner's view of
    the running config. None: no evidence to go on (no planner and no fragmentation), the plain ladder applies.
    A change must bring the calibrated peak below `capacity_frac` x capacity (the detector's own threshold).
    `replanner` gives the planner (or None) and is only called here: building one may probe the GPUs."""
    peak = _num(ev, "mem_max_allocated_gib")
    if peak is None:
        return None
    reserved, capacity = _num(ev, "mem_reserved_gib"), _num(ev, "capacity_gib")
    base: PlanView | None = None
    problems: list[str] = []
    replan: Replan | None = None
    try:
        replan = replanner() if replanner is not None else None
        base = replan({}) if replan is not None else None
    except Exception as exc:  # noqa: BLE001 - a planner that fails leaves the step's numbers alone
        problems.append(f"planner: {exc}")
    if capacity is None and base is not None:
        capacity = base.capacity_gib
    frag = spike_fragmentation(peak, reserved, capacity, ctx.values)
    cause, why = ("fragmentation", frag) if frag else classify(None, base, ctx.values)
    said = (f"memory spike: peak {peak:.2f} GiB allocated, "
            + ("?" if reserved is None else f"{reserved:.2f}") + " GiB reserved, of "
            + ("?" if capacity is None else f"{capacity:.2f}") + f" GiB; cause: {cause} ({why})")
    evidence: dict[str, Any] = {"cause": cause, "why": why, "spike": {
        "max_allocated_gib": peak, "reserved_gib": reserved, "capacity_gib": capacity, "step": ev.get("since_step")}}
    if base is None:
        if frag is None:
            return None
        built = _rung("expandable_segments").build(ctx)
        assert isinstance(built, Proposal)   # spike_fragmentation checked that expandable segments are off
        return MemoryChoice(cause, _rung("expandable_segments"), replace(built, what=f"{built.what} ({said})"),
                            None, evidence)
    assert replan is not None and capacity is not None  # `base` came from it (and carries a capacity)
    evidence["plan"] = base.sizes()
    # max_allocated is a measured lower bound on the running config's peak (as an OOM's numbers are).
    under = max(0.0, peak - base.peak_allocated_gib)
    limit = capacity_frac * capacity
    evidence.update(planner_shortfall_gib=under, limit_gib=limit)
    if frag is None and _calibrated_fit(base, under, limit):
        return MemoryChoice(cause, SPIKE_NOTE, Proposal(what=(
            f"no memory change: the running config is predicted to stay below {limit:.1f} GiB ({said}; planner: "
            f"{base.required_gib + under:.1f} GiB needed of {base.capacity_gib:.1f} GiB with the measured peak)")),
            None, evidence)
    search = _searcher(replan) if frag is None else None   # measured fragmentation: expandable segments below
    if search is not None:
        return _search_choice(search, cause, said, under, limit, evidence, problems, True, SPIKE_NOTE, base)
    found = _first_fit(ctx, replan, base, cause, under, limit, problems)
    if found.action is not None:
        evidence["predicted_required_gib"] = found.view.required_gib
        return MemoryChoice(cause, found.action, Proposal(found.patch, what=found.what(said, under)), True, evidence)
    view = found.view
    expl = "; ".join([*view.problems, *problems]) or (
        f"needs {view.required_gib + under:.1f} GiB of {view.capacity_gib:.1f} GiB, peak "
        f"{view.peak_allocated_gib + under:.1f} GiB vs the {limit:.1f} GiB limit")
    tried = ", ".join(found.changes) or "nothing applicable"
    if frag is not None:
        # The allocator's waste is measured, not predicted: give it back even though the planner sees no fit
        # (as without a planner); this is no prediction, so the no-progress rule applies.
        built = _rung("expandable_segments").build(ctx)
        assert isinstance(built, Proposal)   # spike_fragmentation checked that expandable segments are off
        return MemoryChoice(cause, _rung("expandable_segments"), replace(built, what=(
            f"{built.what} ({said}; no change is predicted to fit, tried {tried}; planner: {expl})")), None, evidence)
    return MemoryChoice(cause, SPIKE_NOTE, Proposal(what=(
        f"no blind change: no memory change is predicted to fit ({said}; tried {tried}; planner: {expl}); "
        "the run continues unchanged")), False, evidence)
