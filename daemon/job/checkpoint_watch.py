"""The running command job's checkpoint dir, watched (the layouts and "complete": checkpoint_files.py).

- `Watch`: one look per `checkpoint_settle_s`; a checkpoint whose marker is there and whose size did not change
  between two looks is reported once as saved. `tick` turns that into a `checkpoint_saved` event through the
  ordinary record path (`on_record`: core/decisions.py's): the store, `status`, the no-progress rule and known-good
  (after `[remediation] known_good_steps` clean steps) see it as they see the job's own reports, which stay
  evidence too (a tag already reported is not reported again).
- A checkpoint dir that yields no checkpoint for `checkpoint_unknown_after_s` while the job runs is an
  incident (status, journal, webhook) naming the setting that fixes it; never a silent "from scratch".
- `launch_choice`: the checkpoint the next attempt is given as `{resume}` (and recorded as resumed from); on
  a rollback everything after it is set aside and the bound persisted (checkpoint_files.RollbackBounds).
- `poisoned_from`: a NaN at step N: a checkpoint at or after N already on disk is never resumed.
- `reported_resume`: what the job says it loaded (`checkpoint_loaded`) corrects the attempt's record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.job.checkpoint_files import (
    BEFORE_RUN,
    Found,
    RollbackBounds,
    WatchConfig,
    complete,
    look,
    resume_point,
    set_aside_after,
    step_of_name,
)
from ulyssesd.daemon.job.command import watch_config
from ulyssesd.daemon.ports import HostSide, Lifecycle, Records, RunFiles
from ulyssesd.daemon.store.enums import IncidentStatus, Severity, Symptom
from ulyssesd.remediation.records import EventRecord

log = get_logger("ulyssesd.supervisor")


class CheckpointWatchRun(RunFiles, Records, Lifecycle, HostSide, Protocol):
    """What watching a command job's checkpoint dir uses of the run."""

    engine: Any  # the remediation engine (primed with the checkpoints already known)
    known_good_marked: set[str]
    ckpt_watch: Any  # the command job's Watch (None until its first look)
    ckpt_watch_incident: int | None  # the open 'no checkpoint recognised' incident
    ckpt_watch_warned: bool


R = TypeVar("R", bound=CheckpointWatchRun)  # the run handed to `tick` and back to its `on_record`


@dataclass
class Watch:
    """The running attempt's view of its checkpoint dir (one look per `settle_s`)."""

    cfg: WatchConfig
    started: float                                   # when the watch began (wall s): for `unknown_after_s`
    reported: set[str] = field(default_factory=set)  # names already reported saved (this run)
    last: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    last_look: float | None = None
    announced: set[str] = field(default_factory=set)   # seen being written, told as `checkpoint_saving`
    unrecognised: list[str] = field(default_factory=list)   # entries of the last look that are no checkpoint
    incomplete: list[Found] = field(default_factory=list)   # checkpoints of the last look not (yet) complete

    def due(self, now: float) -> bool:
        return self.last_look is None or now - self.last_look >= self.cfg.settle_s

    def look(self, now: float, bounds: RollbackBounds | None = None,
             final: bool = False) -> tuple[list[Found], list[Found]]:
        """(the checkpoints first seen being written, the ones that became complete), each reported once,
        oldest first. Complete: the format's marker and a stable size, by two equal looks or, on first sight,
        by files untouched for `settle_s` (a save written between two looks is fed at once, not a look later:
        a NaN read meanwhile needs it as its rollback target). `final`: the job has exited, nothing is being
        written any more: the marker alone makes a checkpoint complete."""
        found, other = look(self.cfg.root, self.cfg.pattern, self.cfg.requires, skip=self.reported)
        fresh = [f for f in found if f.name not in self.reported and not (bounds and bounds.poisoned(f))]
        new = [f for f in fresh if f.marker_ok
               and (final or self.last.get(f.name) == f.signature or now - f.mtime >= self.cfg.settle_s)]
        done = {f.name for f in new}
        saving = [f for f in fresh if f.name not in done and f.name not in self.announced]
        self.last = {f.name: f.signature for f in found}
        self.last_look = now
        self.unrecognised = other
        self.incomplete = [f for f in found if not f.marker_ok]
        self.reported.update(done)
        self.announced.update(f.name for f in saving)
        self.announced &= {f.name for f in found}   # bounded: names gone (set aside, pruned) are forgotten
        return sorted(saving, key=lambda f: f.step), sorted(new, key=lambda f: f.step)

    def problem(self, now: float) -> str | None:
        """Why this checkpoint dir yields no checkpoint after `unknown_after_s` of watching (None: it does,
        or it is too early to say, or it is empty: a job that has not saved yet)."""
        if self.reported or now - self.started < self.cfg.unknown_after_s:
            return None
        where = f"{self.cfg.root}" + (f" (pattern {self.cfg.pattern!r})" if self.cfg.pattern else "")
        if self.incomplete:
            f = self.incomplete[-1]
            return (f"no complete checkpoint in {where} after {int(now - self.started)} s: {f.name} ({f.layout}) "
                    f"is not complete: {f.why_not}. Give [job] resume_requires the files a finished save has, or "
                    f"[job] checkpoint_pattern the checkpoints' names (docs/CLIENT.md, 'Checkpoints')")
        if self.unrecognised:
            shown = ", ".join(self.unrecognised[:5]) + (" ..." if len(self.unrecognised) > 5 else "")
            return (f"no checkpoint recognised in {where} after {int(now - self.started)} s; it holds {shown}. "
                    f"Give [job] checkpoint_pattern (a glob of the checkpoints, relative to checkpoint_dir; "
                    f"each name must carry its step) or point [job] checkpoint_dir at the folder the job saves to "
                    f"(docs/CLIENT.md, 'Checkpoints')")
        return None


# ------------------------------------------------------------------------------------ the supervisor's side
def launch_choice(sup: CheckpointWatchRun, rollback_to_step: int | None) -> tuple[Found | None, list[str]]:
    """The command job's checkpoint for the attempt about to start (None: from the start) and notes. On a
    rollback every checkpoint after the chosen one is set aside and the bound persisted (`RollbackBounds`)."""
    job = sup.spec.job_section
    cfg = watch_config(job, sup.run_dir)
    bounds = RollbackBounds(sup.run_dir)
    if sup.attempt == 0 and not job.resume_first:
        earlier_runs(sup, cfg, bounds)
        return None, []
    chosen, notes = resume_point(cfg, bounds, rollback_to_step)
    if rollback_to_step is None:
        return chosen, notes
    if chosen is None and rollback_to_step > 0:
        # The rollback target is gone (deleted, pruned): as for the built-in job, the closest complete one
        # after it beats starting the run over; everything after that one is still set aside.
        later = [f for f in complete(cfg)[0] if f.step > rollback_to_step and not bounds.poisoned(f)]
        chosen = min(later, key=lambda f: f.step) if later else None
        notes.append(f"no complete checkpoint at or before step {rollback_to_step}; "
                     + (f"rolled back to the oldest complete one after it, {chosen.name}" if chosen
                        else "resuming from the start"))
    limit = chosen.step if chosen else 0
    forget_after(sup.engine, limit)
    w: Watch | None = sup.ckpt_watch
    for old, new in set_aside_after(cfg, limit):
        if w is not None:
            w.reported.discard(old)
            w.announced.discard(old)   # the new trajectory may save under the same name: a new checkpoint
        sup.known_good_marked.discard(old)
        log.info("checkpoint set aside", tag=old, to=new)
        sup.say(f"  {old} set aside as {new} (after the rollback point, step {limit})")
        sup.store.upsert_checkpoint(sup.run_id, old, step=step_of_name(old) or 0, valid=False,
                                    invalid_reason=f"rolled back past it (to step {limit}); kept as {new}")
    bounds.add(limit, SYSTEM.time())
    sup.latest_ckpt = (chosen.name, chosen.step) if chosen else None
    return chosen, notes


def earlier_runs(sup: CheckpointWatchRun, cfg: WatchConfig, bounds: RollbackBounds) -> None:
    """The run's first launch without `[job] resume_first`: checkpoints already in checkpoint_dir belong to
    another run (a spec re-run in place, a shared folder). They are never this run's resume point, also not a
    later relaunch's (a bound `before_run` in rollback-bounds.json: their files are older than this launch),
    and the launch says so, with the setting that continues from them instead. Nothing is moved or deleted."""
    if any(b.get("why") == BEFORE_RUN for b in bounds.read()):
        return   # said at this run's first launch already (a daemon restarted before attempt 1 was stored)
    found, _ = look(cfg.root, cfg.pattern, cfg.requires)
    bounds.add(-1, SYSTEM.time(), why=BEFORE_RUN)
    if not found:
        return
    found.sort(key=lambda f: f.step)
    names = ", ".join(f.name for f in found[:3]) + (f" ... {found[-1].name}" if len(found) > 3 else "")
    msg = (f"checkpoint_dir {cfg.root} already holds {len(found)} checkpoint(s) from before this run ({names}; "
           f"newest step {found[-1].step}): not this run's, starting from the start and never resuming them "
           f"(they stay on disk, untouched). To continue from them, set [job] resume_first = true")
    log.warning("checkpoints from before this run", run_id=sup.run_id, checkpoint_dir=str(cfg.root),
                count=len(found), newest=found[-1].name)
    sup.say(msg)


def poisoned_from(sup: CheckpointWatchRun, bad_step: int) -> None:
    """The job's loss went NaN at `bad_step`: a checkpoint at or after that step already on disk (saved
    before the NaN was read: the race between a save and detection) holds the bad weights and is never a
    resume point, whatever the next launch is (a rollback, or a restart after a crash the NaN caused). The
    job's later saves (files newer than now) are not affected."""
    bounds = RollbackBounds(sup.run_dir)
    now = SYSTEM.time()
    if any(b["to_step"] == bad_step - 1 and now - b["since"] < 5 and b.get("why") != BEFORE_RUN
           for b in bounds.read()):
        return   # just noted (a finding repeated within its episode)
    bounds.add(bad_step - 1, now)
    log.info("checkpoints from the NaN step on are not resumed", first_bad_step=bad_step)


def gives_resume(job: Any) -> bool:
    """Whether the job is handed `{resume}` (else what it resumes from is only what it reports)."""
    return any("{resume}" in arg for arg in job.command)


def tick(sup: R, on_record: Callable[[R, EventRecord, float], None], final: bool = False) -> None:
    """Look at a running command job's checkpoint dir: a checkpoint that became complete is a `checkpoint_saved`
    event (progress for the no-progress rule, known-good after a clean window, `status`); a dir that yields
    none for `checkpoint_unknown_after_s` is an incident (status, journal, webhook) naming the setting."""
    job = sup.spec.job_section
    if job.kind != "command" or (sup.job is None and not final):
        return
    now = SYSTEM.time()
    w: Watch | None = getattr(sup, "ckpt_watch", None)
    if w is None:
        known = sup.store.list_checkpoints(sup.run_id, include_pruned=True)
        w = Watch(watch_config(job, sup.run_dir), started=now, reported={c.tag for c in known if c.valid})
        sup.ckpt_watch = w
        _prime_engine(sup, known)
    if not w.due(now) and not final:
        return
    saving, done = w.look(now, RollbackBounds(sup.run_dir), final)
    for f in saving:
        # First sight of a save (its step is in its name): the engine counts a snapshot of a step before an
        # onset as a rollback target while it is written, so a NaN read before the next look has its target.
        on_record(sup, EventRecord("checkpoint_saving", step=f.step, time=now, attempt=sup.attempt,
                                   fields={"tag": f.name, "source": "files", "layout": f.layout}), now)
    seen = None
    for f in done:
        seen = seen if seen is not None else {c.tag for c in sup.store.list_checkpoints(sup.run_id)
                                              if c.valid and c.attempt == sup.attempt}
        if f.name in seen:
            continue  # a log line or the job's client reported it already (this attempt)
        rec = EventRecord("checkpoint_saved", step=f.step, time=now, attempt=sup.attempt,
                          fields={"tag": f.name, "source": "files", "layout": f.layout, "path": str(f.path)})
        on_record(sup, rec, now)
    _report_problem(sup, w, now)


def forget_after(eng: Any, step: int) -> None:
    """A rollback to `step` abandoned every later checkpoint: none may become (or stay) known-good or count
    as the engine's checkpoint progress, also once the new trajectory's steps pass their step numbers."""
    if eng is None or not all(hasattr(eng, a) for a in ("candidates", "known_good", "saved", "max_ckpt_step")):
        return   # not the remediation engine (a test's stand-in): nothing to forget
    eng.candidates = [c for c in eng.candidates if c[1] <= step]
    eng.known_good = [(t, s) for t, s in eng.known_good if s <= step]
    eng.saved = [(t, s) for t, s in eng.saved if s <= step]
    if isinstance(getattr(eng, "saving", None), dict):
        eng.saving = {t: s for t, s in eng.saving.items() if s <= step}
    if eng.max_ckpt_step is not None and eng.max_ckpt_step > step:
        eng.max_ckpt_step = step


def _prime_engine(sup: CheckpointWatchRun, known: list[Any]) -> None:
    """A re-adopting daemon's engine is rebuilt from telemetry, which has no file-system finds: give it the
    stored known-good checkpoints (rollback targets) and the newest step (progress)."""
    eng = sup.engine
    if eng is None:
        return
    have = {t for t, _ in getattr(eng, "known_good", [])}
    good = sorted((c.step, c.tag) for c in known if c.known_good and c.valid and c.tag not in have)
    if good:
        eng.known_good = sorted([*eng.known_good, *((t, s) for s, t in good)], key=lambda ts: ts[1])[-16:]
    steps = [c.step for c in known if c.valid]
    if steps and (eng.max_ckpt_step is None or max(steps) > eng.max_ckpt_step):
        eng.max_ckpt_step = max(steps)


def _report_problem(sup: CheckpointWatchRun, w: Watch, now: float) -> None:
    iid = getattr(sup, "ckpt_watch_incident", None)
    if iid is not None and w.reported:
        sup.store.update_incident_status(iid, IncidentStatus.resolved, "checkpoints recognised since")
        sup.ckpt_watch_incident = None
        return
    if iid is not None or getattr(sup, "ckpt_watch_warned", False):
        return
    problem = w.problem(now)
    if problem is None:
        return
    sup.ckpt_watch_warned = True   # once per daemon: the incident stays open until a checkpoint is seen
    sup.ckpt_watch_incident = sup.incidents.incident(
        Symptom.checkpoint_corrupt, sup.last_step or 0, Severity.warning, problem[:300],
        {"checkpoint_dir": str(w.cfg.root), "pattern": w.cfg.pattern, "problem": problem,
         "unrecognised": w.unrecognised[:20], "incomplete": [f"{f.name}: {f.why_not}" for f in w.incomplete[:20]]})


def reported_resume(sup: CheckpointWatchRun, tag: str, step: int | None) -> None:
    """The job said what it loaded (`checkpoint_loaded`): the attempt's record follows the job's word; a
    disagreement with what it was given is logged (the job's own choice wins: it is what it runs from)."""
    try:
        given = sup.store.get_attempt(sup.run_id, sup.attempt).resumed_from
    except Exception:  # noqa: BLE001 - no attempt row (re-adoption race): nothing to correct
        return
    name = tag.rstrip("/").rsplit("/", 1)[-1]
    if given is not None and (given == tag or given.rsplit("/", 1)[-1] == name):
        return
    if given is not None:
        log.warning("the job resumed from another checkpoint than it was given", given=given, reported=tag)
        sup.say(f"attempt {sup.attempt} reports it resumed from {tag} (it was given {given})")
    sup.store.update_attempt(sup.run_id, sup.attempt, resumed_from=tag[-64:])
