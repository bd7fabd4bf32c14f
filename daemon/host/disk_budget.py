"""The daemon's side of the checkpoint-directory budget (training/checkpoint/budget.py): the run's policy, the
predicted tag size, retention after every save, and the preflight check of a plan's disk needs.

Order of making room, the categories and the settings: docs/CHECKPOINT_DISK.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.ports import JobConfig, Records, RunFiles
from ulyssesd.training.checkpoint import budget as bd
from ulyssesd.training.checkpoint.rollback_guard import read_pending

log = get_logger("ulyssesd.supervisor")

#: Bytes per parameter of a ZeRO-3 tag (training/checkpoint/budget.py, where the job's own prediction uses it too).
TAG_BYTES_PER_PARAM = bd.TAG_BYTES_PER_PARAM
#: The longest the save interval is stretched when the disk holds fewer tags than configured.
MAX_INTERVAL_FACTOR = 8
GIB = 1 << 30


class BudgetRun(RunFiles, JobConfig, Records, Protocol):
    """What the checkpoint budget uses of the run: its files, config, store and alerts."""


def policy_of(dcfg: Any, config: dict[str, Any]) -> bd.BudgetPolicy:
    """The budget a run's settings imply: `[checkpoint] keep_last` (job config) and the `[daemon]` budget keys."""
    cap = getattr(dcfg, "set_aside_max_gib", None)
    return bd.BudgetPolicy(
        keep_last=int(jc.get_dotted(config, "checkpoint.keep_last", 3)),
        max_anchors=int(getattr(dcfg, "checkpoint_anchors", 2)),
        anchor_spacing_steps=int(getattr(dcfg, "anchor_spacing_steps", 0)),
        set_aside_keep=int(getattr(dcfg, "set_aside_keep", 1)),
        set_aside_max_bytes=None if cap is None else int(cap * GIB),
        margin_bytes=int(float(getattr(dcfg, "min_free_gib", 0.0)) * GIB))


def known_good(sup: BudgetRun) -> list[str]:
    return [c.tag for c in sup.store.list_checkpoints(sup.run_id) if getattr(c, "known_good", False)]


def predicted_tag_bytes(job: Any) -> int:
    """One tag's bytes from the model (the planner's parameter count x TAG_BYTES_PER_PARAM); 0 when the job
    config has no model the planner knows (a command job)."""
    try:
        from ulyssesd.training.planner.cost_model import param_shapes

        return TAG_BYTES_PER_PARAM * sum(s.numel for s in param_shapes(job.resolved_model()))
    except Exception as exc:  # noqa: BLE001 - no model to count: the caller says the size is unknown
        log.debug("tag size not predicted", error=repr(exc))
        return 0


def predicted_from_config(config: dict[str, Any]) -> int:
    try:
        from ulyssesd.training.spec import JobSpec

        return predicted_tag_bytes(JobSpec.model_validate({k: v for k, v in config.items() if k != "launcher"}))
    except Exception:  # noqa: BLE001 - a command job's config is not a JobSpec
        return 0


def _command_job(sup: Any) -> Any:
    """The run's `[job]` section when it is a command job (its own checkpoint_dir and names), else None."""
    job = getattr(getattr(sup, "spec", None), "job_section", None)
    return job if getattr(job, "kind", None) == "command" else None


def checkpoint_root(sup: BudgetRun) -> Path:
    """Where the run's checkpoints are: a command job's `[job] checkpoint_dir` (job/command.py), else the
    built-in job's `checkpoint.dir` (`sup.ckpt_dir`)."""
    job = _command_job(sup)
    if job is None:
        return sup.ckpt_dir
    from ulyssesd.daemon.job.command import checkpoint_root as command_root

    return command_root(job, sup.run_dir)


def run_predicted_bytes(sup: BudgetRun) -> int:
    """The predicted tag size: the built-in model's figure; 0 (unknown: the run's own saves measure it) for a
    command job, whose model the daemon does not know."""
    return 0 if _command_job(sup) is not None else predicted_from_config(sup.config)


def classify_run(sup: BudgetRun, kg: list[str] | None = None) -> bd.DirBudget:
    root, job = checkpoint_root(sup), _command_job(sup)
    recognise = None
    if job is not None:  # its own names, files and folders (job/checkpoint_files.py), as the status counts them
        from ulyssesd.daemon.job.checkpoint_files import classify as recognise_one

        requires = tuple(job.resume_requires or ())

        def recognise(p: Path) -> tuple[int, bool] | None:
            f = recognise_one(p, root, requires)
            return None if f is None else (f.step, f.marker_ok)
    return bd.classify(root, policy_of(sup.dcfg, sup.config), known_good(sup) if kg is None else kg,
                       recognise=recognise,
                       pending=read_pending(sup.run_dir))   # a decided rollback: its target kept (rollback_guard.py)


def next_save_bytes(budget: bd.DirBudget, predicted: int) -> int:
    """What the next save writes: the newest valid tag's bytes (the run's own figure), else the prediction."""
    return budget.tag_bytes or predicted


@dataclass
class RetentionResult:
    """One retention pass: what went, and whether the next save fits."""

    removed: list[str] = field(default_factory=list)
    room: bd.RoomOutcome | None = None
    budget: bd.DirBudget | None = None


def run_retention(sup: BudgetRun) -> RetentionResult:
    """Routine retention (surplus tags, set-aside copies over their caps), then room for the next save while the
    job runs (not while a save is being written: the free space is then still falling, and the job makes room
    itself before its next save), the store told what went, and the budget published for the job."""
    out = RetentionResult()
    if not checkpoint_root(sup).is_dir():
        return out
    # The store's rows once per pass (known-good anchors, what to mark pruned): a pass is the daemon's most
    # frequent store read after the telemetry cursor (simulator profile, docs/SIMULATION.md).
    rows = sup.store.list_checkpoints(sup.run_id)
    kg = [c.tag for c in rows if getattr(c, "known_good", False)]
    budget = classify_run(sup, kg)
    out.removed = [e.name for e in bd.apply_retention(budget)]
    budget = classify_run(sup, kg) if out.removed else budget
    predicted = run_predicted_bytes(sup)
    need = next_save_bytes(budget, predicted) + budget.policy.margin_bytes
    writing = budget.by_category()["in_flight"]["count"] > 0  # its bytes are still arriving: the job checks itself
    if budget.free_bytes is not None and need > budget.policy.margin_bytes and budget.free_bytes < need \
            and not writing:
        out.room = bd.make_room(budget, need, include_in_flight=False, only_if_it_fits=True)
        out.removed += out.room.removed
        log.info("made room for the next save", removed=out.room.removed, freed=out.room.freed_bytes,
                 held=out.room.held_bytes, available=out.room.available_bytes, need=need)
        if not out.room.fits:
            warn_no_room(sup, out.room, budget)
        cut = [n for n in out.room.removed if budget.by_name()[n].category in ("keep_last", "anchor")]
        budget = classify_run(sup, kg)
        if cut:
            warn_window_cut(sup, budget, cut)
    out.budget = budget
    on_disk = set(budget.by_name())
    mark_pruned(sup, out.removed, rows, on_disk)
    try:  # the known-good tags still there (the rows marked pruned just now are not)
        bd.write_budget_file(sup.run_dir, budget.policy, [t for t in kg if t in on_disk and t not in out.removed],
                             predicted)
    except OSError as exc:  # a full disk fails this small write too: the job keeps the one written at launch
        log.warning("could not publish the checkpoint budget", error=repr(exc))
    return out


def publish_budget(sup: BudgetRun) -> None:
    """The budget file the job checks before every save, written before each attempt is launched, so that its
    first save is checked with the run's own settings (the margin, the predicted tag size) whatever the
    retention timer did. An OSError goes to the caller: the launch path retries the daemon's own failed writes."""
    bd.write_budget_file(sup.run_dir, policy_of(sup.dcfg, sup.config), known_good(sup), run_predicted_bytes(sup))


_warned: dict[str, str] = {}


def warn_no_room(sup: BudgetRun, room: bd.RoomOutcome, budget: bd.DirBudget) -> None:
    """The next save will not fit even with everything removable gone: said once per newest tag (the job skips
    that save and says so with its own event)."""
    key = f"{sup.run_id}:{budget.newest_valid}"
    if _warned.get(sup.run_id) == key:
        return
    _warned[sup.run_id] = key
    text = (f"checkpoint disk: the next save needs ~{bd.describe_bytes(room.need_bytes)} in {budget.root} but only "
            f"{bd.describe_bytes(room.available_bytes)} can be freed there (kept {budget.newest_valid} and "
            f"{budget.newest_known_good or 'no known-good tag'}); the save will be skipped")
    log.warning("checkpoint disk cannot hold the next save", need=room.need_bytes, available=room.available_bytes)
    sup.say(f"WARNING: {text}")
    sup.alert("incident", text, need_bytes=room.need_bytes, available_bytes=room.available_bytes)


def warn_window_cut(sup: BudgetRun, budget: bd.DirBudget, cut: list[str]) -> None:
    """The disk holds fewer tags than the settings keep: said (log, console, alert) once per run."""
    key = f"{sup.run_id}:window"
    if _warned.get(key):
        return
    _warned[key] = "said"
    tags = sum(1 for e in budget.entries if e.category in ("newest_valid", "keep_last", "anchor"))
    text = (f"checkpoint disk: {budget.root} holds {tags} tag(s) of {bd.describe_bytes(budget.tag_bytes)} with room "
            f"for the next save, fewer than keep_last {budget.policy.keep_last} + anchors: removed {', '.join(cut)} "
            f"to make room ({bd.describe_bytes(budget.free_bytes)} free now); a smaller [checkpoint] keep_last or "
            f"a larger checkpoint.dir keeps what is configured")
    log.warning("checkpoint window cut to what the disk holds", removed=cut, tags=tags, free=budget.free_bytes)
    sup.say(f"WARNING: {text}")
    sup.alert("incident", text, tags_held=tags, free_bytes=budget.free_bytes, removed=cut)


def mark_pruned(sup: BudgetRun, removed: list[str], rows: list[Any] | None = None,
                on_disk: set[str] | None = None) -> None:
    """Tell the store which tags are gone: those just removed and those another remover (the job's own room
    making) removed, so that `status` never names a tag that is not on disk. `rows` (the store's unpruned
    checkpoints) and `on_disk` (the directory's entries) when the caller has just read them."""
    if on_disk is None:
        on_disk = set(classify_run(sup).by_name()) if checkpoint_root(sup).is_dir() else set()
    gone = [c.tag for c in (sup.store.list_checkpoints(sup.run_id) if rows is None else rows)
            if c.tag in removed or c.tag not in on_disk]
    for tag in gone:
        if tag in removed:
            log.info("checkpoint pruned", tag=tag)
    sup.store.mark_checkpoints_pruned(sup.run_id, gone)  # one transaction for the pass


def interval_for(base_interval: int, tags_fit: int | None, keep_last: int) -> int | None:
    """A longer save interval when the disk holds fewer tags than `keep_last` + the save in flight, so that the
    tags kept still reach about as far back in steps; None when no change is needed."""
    want = keep_last + 1
    if tags_fit is None or tags_fit >= want or tags_fit < bd.MIN_TAGS:
        return None
    factor = min(MAX_INTERVAL_FACTOR, math.ceil(want / tags_fit))
    return base_interval * factor


# ----------------------------------------------------------------------------------------- preflight
def ckpt_dir_of(spec: Any) -> Path:
    """The checkpoint directory a new run of `spec` writes (the run dir is not known yet: its parent)."""
    d = spec.job.checkpoint.dir
    return Path(d) if d else Path(spec.daemon.state_dir) / "runs"


def preflight_disk(spec: Any, predict: bool = True, free: Any = bd.free_bytes) -> str | None:
    """None when the checkpoint directory's filesystem can hold what the settings imply (module doc of
    training/checkpoint/budget.py); else why not, with the numbers and the settings that would fit. The tag size
    is the newest tag's on disk, else (`predict`: the built-in job) the model's."""
    root = ckpt_dir_of(spec)
    policy = policy_of(spec.daemon, spec.job.model_dump())
    existing = bd.classify(root, policy) if spec.job.checkpoint.dir else None
    tag = (existing.tag_bytes if existing else 0) or (predicted_tag_bytes(spec.job) if predict else 0)
    if tag <= 0:
        return None  # no model to size a tag by and no tag on disk: checked at every save instead
    held = existing.total_bytes - existing.by_category()["other"]["bytes"] if existing else 0
    avail = free(root)
    if avail is None:
        return None
    room = avail + held
    need = policy.budget_bytes(tag)
    if room >= need:
        return None
    b = bd.describe_bytes
    head = (f"checkpoint disk: {root} has {b(avail)} free" + (f" (+{b(held)} in its checkpoints)" if held else "")
            + f"; the settings need {b(need)}: (keep_last {policy.keep_last} + {policy.max_anchors} known-good "
            f"anchor(s) + 1 save in flight) x {b(tag)} per tag + set-aside "
            f"{b(policy.set_aside_cap(tag))} + margin {b(policy.margin_bytes)} "
            f"(daemon.min_free_gib)")
    fits = fitting_settings(policy, tag, room)
    where = f"or another checkpoint.dir with at least {b(need)} free"
    if fits is None:
        return (f"{head}. This disk cannot hold even the newest tag plus one more and the save in flight "
                f"({b(3 * tag)}): free space there, {where}")
    return f"{head}. What fits: {fits}; {where}"


def fitting_settings(policy: bd.BudgetPolicy, tag: int, room: int) -> str | None:
    """The largest settings that fit `room` bytes: no set-aside copies, then fewer anchors, then a smaller
    keep_last, then a smaller margin. None when even keep_last 1 with one anchor and no margin does not."""
    tries = [bd.BudgetPolicy(**{**policy.__dict__, "set_aside_keep": 0, "max_anchors": a, "keep_last": k})
             for a in range(policy.max_anchors, 0, -1) for k in range(policy.keep_last, 0, -1)]
    tries.sort(key=lambda p: (-(p.keep_last + p.max_anchors), -p.keep_last))
    for p in tries:
        spare = room - (p.budget_bytes(tag) - p.margin_bytes)  # what is left for the margin
        if spare < 0:
            continue
        parts = []
        if p.keep_last != policy.keep_last:
            parts.append(f"[checkpoint] keep_last = {p.keep_last}")
        if p.max_anchors != policy.max_anchors:
            parts.append(f"[daemon] checkpoint_anchors = {p.max_anchors}")
        if policy.set_aside_keep:
            parts.append("[daemon] set_aside_keep = 0")
        margin = p.margin_bytes
        if spare < p.margin_bytes:
            gib = math.floor(spare / GIB * 100) / 100
            margin = int(gib * GIB)
            parts.append(f"[daemon] min_free_gib = {gib:g}")
        tags = p.budget_bytes(tag) - p.margin_bytes
        return ", ".join(parts) + f" ({bd.describe_bytes(tags)} for the tags + {bd.describe_bytes(margin)} margin)"
    return None


# ------------------------------------------------------------------------------------ status / report
def command_checkpoint_dir(run: Any) -> str | None:
    """A command job's `[job] checkpoint_dir` (where it saves; relative paths are the spec file's, as at
    launch); None for the built-in job or without one (then `{run_dir}/checkpoints`)."""
    job = (run.spec or {}).get("job") or {}
    d = job.get("checkpoint_dir") if isinstance(job, dict) and job.get("kind") == "command" else None
    if not isinstance(d, str) or not d:
        return None
    spec_path = getattr(run, "spec_path", None)
    if not Path(d).is_absolute() and spec_path:
        return str((Path(spec_path).parent / d).resolve())
    return d


def command_recogniser(run: Any, root: Path) -> bd.Recogniser | None:
    """A command job's checkpoints as the daemon recognises them while it runs (job/checkpoint_files.py:
    its own names, files and folders, complete or not); None for the built-in job (its tags)."""
    job = (run.spec or {}).get("job") or {}
    if not isinstance(job, dict) or job.get("kind") != "command":
        return None
    from ulyssesd.daemon.job.checkpoint_files import classify as recognise_one

    requires = tuple(job.get("resume_requires") or ())

    def recognise(p: Path) -> tuple[int, bool] | None:
        f = recognise_one(p, root, requires)
        return None if f is None else (f.step, f.marker_ok)
    return recognise


def disk_status(store: Any, run: Any) -> dict[str, Any] | None:
    """The run's checkpoint directory by category with bytes and the free space left (`ulyssesctl status` and
    `report`); None when the run has no directory to look at."""
    from ulyssesd.daemon.spec import DaemonSection

    versions = store.list_config_versions(run.id)
    config = next((v.config for v in versions if v.version == run.config_version),
                  versions[-1].config if versions else {})
    raw = (run.spec or {}).get("daemon") or {}
    try:
        dcfg: Any = DaemonSection.model_validate(raw)
    except ValueError:  # an older schema's keys: the defaults still describe the directory
        dcfg = DaemonSection()
    d = command_checkpoint_dir(run) or jc.get_dotted(config, "checkpoint.dir")
    root = Path(d) if d else (Path(run.run_dir) / "checkpoints" if run.run_dir else None)
    if root is None:
        return None
    kg = [c.tag for c in store.list_checkpoints(run.id) if getattr(c, "known_good", False)]
    try:
        return bd.classify(root, policy_of(dcfg, config), kg, recognise=command_recogniser(run, root),
                           pending=read_pending(run.run_dir)).to_dict()
    except (OSError, ValueError) as exc:
        return {"dir": str(root), "error": str(exc)}


def render_disk(d: dict[str, Any] | None) -> str:
    """One line: free space, the budget, then each non-empty category's count and bytes."""
    if not d:
        return "—"
    if "error" in d:
        return f"{d['dir']}: {d['error']}"
    b = bd.describe_bytes
    cats = ", ".join(f"{name.replace('_', ' ')} {c['count']} ({b(c['bytes'])})"
                     for name, c in d["categories"].items() if c["count"])
    return (f"{b(d['free_bytes'])} free; {b(d['total_bytes'])} used of a {b(d['budget_bytes'])} budget"
            + (f"; {cats}" if cats else "; empty"))
