"""The remediation engine: detectors → findings → ladder decisions, with grace, verification, revert,
restart budget, no-progress rule, known-good tracking and observe-only mode.

Pure: every call takes the clock value `now`; nothing here reads files or the system clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ulyssesd.remediation import memory_evidence
from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding, HangDetector, build_detectors
from ulyssesd.remediation.detectors.throughput_drop import tokens_per_s
from ulyssesd.remediation.job import BUILTIN, JobReach, job_values
from ulyssesd.remediation.learned.engine_parts import LearnedParts, exact_onset
from ulyssesd.remediation.memory_evidence import Replan
from ulyssesd.remediation.playbook import (
    DEFAULTS,
    K_CLIP,
    K_LR,
    K_SKIP,
    LADDERS,
    NON_FATAL,
    RESTARTING,
    ROLLBACK,
    STOP,
    SYMPTOM_LADDER,
    WEIGHT_SYMPTOMS,
    Action,
    Apply,
    Context,
    Proposal,
    ladder_for_crash,
)
from ulyssesd.remediation.records import EventRecord, Record, StepRecord

# Symptoms that may recover by themselves: act only if they persist or recur past the grace window.
GRACE_SYMPTOMS = frozenset({"loss_spike", "loss_oscillation", "memory_spike", "slow_step", "straggler",
                            "throughput_drop"})
# A consequence is not reported while its cause is active (a straggler slows steps and throughput).
EXPLAINED_BY = {"throughput_drop": ("slow_step", "straggler"), "slow_step": ("straggler",)}
# The drift CUSUM also sees big jumps; while the detector made for one is active, the drift adds nothing.
DRIFT_EXPLAINED_BY = ("slow_step", "straggler", "throughput_drop")


@dataclass(slots=True)
class Decision:
    action_kind: str
    symptom: str
    apply: Apply
    reason: str
    ladder: str
    ladder_step: int
    step: int | None = None
    time: float | None = None
    config_patch: dict[str, Any] = field(default_factory=dict)
    previous: dict[str, Any] = field(default_factory=dict)
    hot_control: dict[str, Any] = field(default_factory=dict)
    rollback_to_step: int | None = None
    rollback_tag: str | None = None
    rollback_onset: int | None = None   # the onset the rollback handles: tags saved at or after it are never used
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)
    procedure: tuple[str, ...] = ()
    would_apply: Apply | None = None   # observe-only: what would have been applied
    reverted: dict[str, Any] = field(default_factory=dict)

    def diff(self) -> str:
        return ", ".join(f"{k}: {self.previous.get(k)!r} -> {v!r}" for k, v in self.config_patch.items())


@dataclass
class LadderState:
    position: int = 0
    uses: int = 0
    verify_left: int = 0
    last: Decision | None = None
    tps_before: float | None = None
    tps_after: list[float] = field(default_factory=list)
    exhausted: bool = False
    await_left: int = 0   # steps to wait for the restart a decision asked for; findings meanwhile are expected


@dataclass
class _Pending:
    finding: Finding
    steps: int = 0          # training steps since the finding (not records)
    severe: bool = False    # a severe finding of this episode arrived: the shorter severe grace applies


def _same_episode(a: Finding, b: Finding) -> bool:
    """Two findings of one detector episode (same symptom and onset step)."""
    return (a.symptom == b.symptom and a.evidence.get("since_step") is not None
            and a.evidence.get("since_step") == b.evidence.get("since_step"))


class RemediationEngine(LearnedParts):
    def __init__(self, config: DetectorsConfig | None = None, policy: RemediationConfig | None = None,
                 job: Mapping[str, Any] | None = None, *, start_time: float | None = None, attempt: int | None = None,
                 reach: JobReach = BUILTIN):
        # A copy: calibration sets fitted thresholds on it, never on the caller's spec.
        self.config = (config or DetectorsConfig()).model_copy()
        self.policy = policy or RemediationConfig()
        self.reach = reach   # what of a rung's change reaches the job (a command job: not every key)
        vals = job_values(job)
        self.values: dict[str, Any] = {k: (vals[k] if vals.get(k) is not None else v) for k, v in DEFAULTS.items()}
        self.values.update({k: v for k, v in vals.items() if v is not None})
        self.initial = dict(self.values)
        self.launched = dict(self.values)
        min_scale = vals.get("precision.loss_scale.min_loss_scale")
        self.detectors = build_detectors(self.config, min_loss_scale=min_scale
                                         if vals.get("precision.dtype") == "fp16" else None)
        self._by_symptom = {d.symptom: d for d in reversed(self.detectors)}   # the first detector of each symptom
        # Every detector whose findings may carry a symptom (the drift detector's are throughput_drop/straggler).
        self._emitters: dict[str, tuple[Any, ...]] = {}
        for d in self.detectors:
            for sym in getattr(d, "symptoms", (d.symptom,)):
                self._emitters[sym] = (*self._emitters.get(sym, ()), d)
        # Bound once: observe() calls each of them for every step record.
        self._step_observers = tuple(d.observe for d in self.detectors)
        self.hang = HangDetector(self.config, start_time)
        self.ladders: dict[str, LadderState] = {}
        self.pending: dict[str, _Pending] = {}
        self.suppressed = 0
        self.restart_times: deque[float] = deque()   # restart budget / progress
        self.restarts_without_progress = 0
        self._ckpt_step_at_restart: int | None = None
        self.max_ckpt_step: int | None = None
        self.attempt: int | None = attempt
        self._init_learned()   # known-good tracking, saved tags, calibration, early warning
        self._samples: deque[tuple[int, tuple[int, int]]] = deque(   # recent sample ranges, for rollback-and-skip
            maxlen=4 * self.policy.skip_max_batches + self.policy.rollback_steps_back)
        self.last_step: int | None = None
        self.failed = False
        self.memory_evidence: dict[str, Any] | None = None   # of the last decision (memory_evidence.choose)
        self.footprint = memory_evidence.Footprint()   # the attempt's measured memory: a transient OOM is no config's
        self.replanner: Callable[[], Replan | None] | None = None   # for spikes; lazy: it may probe the GPUs

    def _active(self, symptom: str) -> bool:
        """Whether an episode of `symptom` persists in any detector that reports it."""
        return any(d.active for d in self._emitters.get(symptom, ()))

    # ------------------------------------------------------------------------------------ inputs
    def observe(self, record: Record, now: float) -> list[Finding | Decision]:
        """Feed one telemetry record; returns the findings it raised and the decisions they led to."""
        out: list[Finding | Decision] = []
        if isinstance(record, EventRecord) and record.event == "started":  # before the hang clock sees it (sim seed 0)
            self.on_restart(now, attempt=record.attempt)  # its reset would drop the step the attempt resumed from
        self.hang.observe(record, now)
        self.footprint.observe(record)
        if self._history is not None and isinstance(record, EventRecord):
            self._history.append(record)
        if isinstance(record, EventRecord):
            if record.event in ("checkpoint_saving", "checkpoint_saved") and record.step is not None:
                tag = str(record.fields.get("tag") or f"step-{record.step:08d}")
                (self.saving_started if record.event == "checkpoint_saving" else self.checkpoint_saved)(tag, record.step)
            for det in self.detectors:
                det.observe(record, now)
            return out
        prev = self.last_step
        # Training steps this record stands for (windows are in steps, not records; see StepSpan).
        span = 1 if prev is None or record.step < prev else record.step - prev
        self.last_step = record.step
        loss = record.loss
        self._last_loss_finite = loss - loss == 0.0
        if record.samples is not None:  # recent sample ranges, for rollback-and-skip
            self._samples.append((record.step, record.samples))
        findings: list[Finding] | None = None
        for observe in self._step_observers:
            found = observe(record, now)
            if found:
                if findings is None:
                    findings = list(found)
                else:
                    findings.extend(found)
        weight_anomaly = False
        if findings:  # rare: the quiet path stays cheap for replaying millions of records
            weight_anomaly = any(f.symptom in WEIGHT_SYMPTOMS for f in findings)
            for f in findings:
                causes = EXPLAINED_BY.get(f.symptom)
                if f.evidence.get("detector") == "cusum":
                    causes = DRIFT_EXPLAINED_BY   # a drift finding is a consequence of a jump the others saw
                # The jump detectors' own episodes explain; the drift detector's never explains another finding.
                if causes and any(self._by_symptom[c].active for c in causes):
                    self.suppressed += 1
                    continue
                out.append(self._with_fit(f))
                out.extend(self._on_finding(f, record.step, now))
        self._note_clean(record.step, weight_anomaly)
        if self._history is not None:
            self._count_healthy(record, findings, now)
        if self.grad_watch is not None:   # early warning: grad norm, logits, update ratios, loss scale
            self._watch_grad(record)
        # Bookkeeping has nothing to do without a finding, a checkpoint candidate, a ladder or a pending symptom.
        if weight_anomaly or self.candidates or self.ladders or self.pending:
            self._step_bookkeeping(record, now, weight_anomaly, out, span)
        return out

    def on_finding(self, finding: Finding, now: float) -> list[Decision]:
        """Feed a finding from elsewhere (e.g. the daemon's own probes) through grace and the ladders."""
        return self._on_finding(finding, finding.step if finding.step is not None else (self.last_step or 0), now)

    def tick(self, now: float) -> list[Finding | Decision]:
        """Clock-driven checks (hang)."""
        h = self.hang
        # HangDetector.check's own first test, inlined: replay ticks before every record and this is the answer.
        if h._last_progress is None or h._fired or now - h._last_progress <= h.cfg.hang_timeout_floor_s:
            return []
        f = h.check(now)
        if f is None:
            return []
        return [self._with_fit(f), *self._decide("hang", f.symptom, f, f.step, now, f"{f.message}")]

    def on_crash(self, label: str, evidence: list[str] | dict[str, Any] | None, now: float, *,
                 replan: Replan | None = None) -> list[Decision]:
        """The job exited abnormally; `label` is the log diagnosis (the fixed set of docs/DIAGNOSIS.md).
        For a CUDA OOM, `replan` (the daemon's planner over the current config, remediation/memory_evidence.py)
        lets the memory ladder jump to the change predicted to fit."""
        ladder, symptom = ladder_for_crash(label)
        first = next(iter(evidence.values()), "") if isinstance(evidence, dict) else (evidence or [""])[0]
        ev = f" ({str(first).strip()[:160]!r})" if first else ""
        st = self.ladders.get(ladder)
        if st is not None and st.verify_left <= 0 and st.position < len(LADDERS[ladder]) \
                and LADDERS[ladder][st.position].max_uses(self.policy) > 1:
            st.uses = 0  # a crash long after the last one starts the restart count afresh
        ctx = Context(self.values, self.initial, self.launched, self.policy)
        choice = memory_evidence.choose(evidence, ctx, replan, self.footprint) if ladder == "memory" and not (
            st and st.exhausted) else None
        return self._decide(ladder, symptom, None, self.last_step, now, f"the job crashed with {label}{ev}",
                            memory=choice)

    def on_restart(self, now: float, attempt: int | None = None, resumed: tuple[str, int] | None = None) -> None:
        """A new attempt started (from `resumed`: tag, step): all patches are now launched, detectors rewarm."""
        self.resumed = resumed or (self.resumed if attempt is not None and attempt == self.attempt else None)
        if attempt is not None and attempt == self.attempt:
            return  # the daemon's call and the telemetry `started` event describe the same restart
        # The run's very first start is not a restart (a re-adopting daemon passes `attempt` to the constructor).
        first = (self.attempt is None and self.last_step is None and not self.restart_times
                 and (attempt is None or attempt <= 1))
        self.attempt = attempt if attempt is not None else (self.attempt or 0) + 1
        self.footprint.restart(self.attempt)
        self.launched = dict(self.values)
        for det in self.detectors:
            det.reset()
        if self.grad_watch is not None:
            self._reset_watches()
        self.hang.reset(now)
        self.pending.clear()
        for st in self.ladders.values():
            st.await_left = 0
        if first:
            return
        self.restart_times.append(now)
        if self.max_ckpt_step is not None and (self._ckpt_step_at_restart is None
                                               or self.max_ckpt_step > self._ckpt_step_at_restart):
            self.restarts_without_progress = 1
        else:
            self.restarts_without_progress += 1
        self._ckpt_step_at_restart = self.max_ckpt_step

    def checkpoint_saved(self, tag: str, step: int) -> None:
        # A save while a weight symptom is active (or right after a non-finite loss) holds suspect weights:
        # it is never a rollback target (the known-good rule needs a clean window after it anyway).
        self.saving.pop(tag, None)
        if self._is_tainted(step):
            self.tainted.add(tag)
        self.saved.append((tag, step))
        self.saved = self.saved[-64:]
        if self.max_ckpt_step is None or step > self.max_ckpt_step:
            self.max_ckpt_step = step
            if self._ckpt_step_at_restart is None or step > self._ckpt_step_at_restart:
                self.restarts_without_progress = 0
        self.candidates.append([tag, step, 0])

    @property
    def known_good_tag(self) -> tuple[str, int] | None:
        return self.known_good[-1] if self.known_good else None

    # ------------------------------------------------------------------------------- bookkeeping
    def _step_bookkeeping(self, rec: StepRecord, now: float, weight_anomaly: bool,
                          out: list[Finding | Decision], span: int = 1) -> None:
        if weight_anomaly:
            self.candidates.clear()
        elif self.candidates:
            for cand in self.candidates:
                if rec.step > cand[1]:
                    cand[2] = rec.step - cand[1]   # clean training steps after the tag
            while self.candidates and self.candidates[0][2] >= self.policy.known_good_steps:
                tag, step, _ = self.candidates.pop(0)
                self.known_good.append((tag, step))
                self.known_good = self.known_good[-16:]
        tps = tokens_per_s(rec) if self.ladders else None
        for name, st in self.ladders.items():
            if st.await_left > 0:
                st.await_left = max(0, st.await_left - span)
            if st.verify_left > 0:
                st.verify_left = max(0, st.verify_left - span)
                if tps is not None and len(st.tps_after) < 1000:
                    st.tps_after.append(tps)
                if st.verify_left == 0 and st.position < len(LADDERS[name]) \
                        and LADDERS[name][st.position].max_uses(self.policy) > 1:
                    st.uses = 0  # verified: a repeatable rung (restart, rollback) is fresh again
        if not self.pending:
            return
        for ladder, p in list(self.pending.items()):
            if p.finding.step == rec.step:
                continue  # the grace window starts after the finding's own step
            p.steps += span
            severe = p.severe or p.finding.severity == "critical"
            # Severe and still there after the short severe grace: act now. Otherwise wait the full grace (the
            # entry also stays pending that long so a recurrence inside it still counts).
            severe_grace = min(self.policy.severe_grace_steps, self.policy.grace_steps)   # never longer than grace
            act_early = severe and p.steps >= severe_grace and self._active(p.finding.symptom)
            if act_early or p.steps >= self.policy.grace_steps:
                del self.pending[ladder]
                if self._active(p.finding.symptom):
                    why = (f"{p.finding.symptom} persisted for {p.steps} steps since step {p.finding.step}"
                           f"{' (severe: shorter grace)' if act_early else ''}: {p.finding.message}")
                    out.extend(self._decide(ladder, p.finding.symptom, p.finding, rec.step, now, why))

    # ---------------------------------------------------------------------------------- deciding
    def _on_finding(self, f: Finding, step: int, now: float) -> list[Decision]:
        ladder = SYMPTOM_LADDER.get(f.symptom)
        if ladder is None:
            raise ValueError(f"unknown symptom {f.symptom!r}; expected one of {sorted(SYMPTOM_LADDER)}")
        st = self.ladders.get(ladder)
        if st is not None and st.await_left > 0:
            return []  # the job is about to restart/roll back for this ladder: the symptom is still expected
        if st is not None and st.verify_left > 0:
            return self._decide(ladder, f.symptom, f, step, now,
                                f"{f.symptom} recurred within the verification window of "
                                f"{st.last.action_kind if st.last else 'the last action'}: {f.message}")
        if f.symptom in GRACE_SYMPTOMS and self.policy.grace_steps > 0:
            p = self.pending.get(ladder)
            if p is not None and _same_episode(p.finding, f):
                # A repeat of the pending episode (a refire) is persistence, which the grace window measures.
                p.severe = p.severe or f.severity == "critical"
                return []
            if p is not None:
                del self.pending[ladder]
                return self._decide(ladder, f.symptom, f, step, now,
                                    f"{f.symptom} recurred within the {self.policy.grace_steps}-step grace window: "
                                    f"{f.message}")
            self.pending[ladder] = _Pending(f)
            return []
        return self._decide(ladder, f.symptom, f, step, now, f.message)

    def _budget_stop(self, now: float, no_progress: bool = True) -> tuple[str, str] | None:
        while self.restart_times and self.restart_times[0] < now - 3600.0:
            self.restart_times.popleft()
        pol = self.policy
        if len(self.restart_times) >= pol.max_restarts_per_hour:
            return "crash_loop", (f"{len(self.restart_times)} restarts in the last hour reached the budget of "
                                  f"{pol.max_restarts_per_hour} (remediation.max_restarts_per_hour)")
        if no_progress and self.restarts_without_progress >= pol.no_progress_restarts:
            past = "the start (no checkpoint yet)" if self.max_ckpt_step is None else f"step {self.max_ckpt_step}"
            return "no_progress", (f"{self.restarts_without_progress} restarts without a checkpoint advancing past "
                                   f"{past} (remediation.no_progress_restarts="
                                   f"{pol.no_progress_restarts})")
        return None

    def _decide(self, ladder: str, symptom: str, finding: Finding | None, step: int | None, now: float,
                why: str, memory: memory_evidence.MemoryChoice | None = None) -> list[Decision]:
        if self.failed:
            return []
        rungs = LADDERS[ladder]
        st = self.ladders.setdefault(ladder, LadderState())
        if st.exhausted:
            return []
        in_verify = st.verify_left > 0
        reverted, revert_note = self._maybe_revert(st) if in_verify else ({}, "")
        anomaly_step = finding.evidence.get("since_step", finding.step) if finding else step
        exact = finding is not None and exact_onset(finding)
        precise = exact or (finding is not None and "sources" in finding.evidence)
        n_sources = int(finding.evidence.get("window") or 1) if precise and finding is not None else 1
        ctx = Context(self.values, self.initial, self.launched, self.policy,
                      self._rollback_plan(anomaly_step, precise, n_sources, exact), finding.evidence if finding else {},
                      self._skip_unreached())
        if memory is None and finding is not None and finding.symptom == "memory_spike":
            memory = memory_evidence.choose_spike(finding.evidence, ctx, self.replanner,
                                                  self.config.memory_capacity_frac)
            if memory is not None and memory.action is memory_evidence.SPIKE_NOTE and in_verify and st.last \
                    and st.last.action_kind == memory.action.kind:
                return []   # the same "nothing to change" note again within its window: said once
        skipped: list[str] = []
        action: Action  # both set on the iteration that breaks
        built: Proposal | str
        memory = self._reachable(memory, skipped)   # the evidence's choice too must reach the job
        if memory is not None:   # the evidence chose the rung (or to stop, or a spike's note): no walk
            action, built = memory.action, memory.proposal
            if action in rungs and action is not STOP:   # a spike's note leaves the ladder where it is
                st.position, st.uses = rungs.index(action), 0
        while memory is None:
            action = rungs[st.position] if st.position < len(rungs) else STOP
            if st.uses >= action.max_uses(self.policy) and action is not STOP:
                st.position += 1
                st.uses = 0
                continue
            if action.apply == "rollback_skip" and ctx.rollback is None:
                built = self.no_rollback_why or "no rollback target"
            else:
                try:
                    built = action.build(ctx)
                except Exception as exc:  # noqa: BLE001 - a rung that cannot be built is skipped, with why
                    built = f"could not be built ({type(exc).__name__}: {exc})"
                if not isinstance(built, str):
                    built = self.reach.why_not(built.apply or action.apply, built.patch, built.hot_control) or built
            if isinstance(built, str):
                skipped.append(f"{action.kind} skipped: {built}")
                st.position += 1
                st.uses = 0
                continue
            break
        assert not isinstance(built, str)  # both loops leave with a Proposal (a str rung is skipped)
        apply: Apply = built.apply or action.apply
        patch = dict(built.patch)
        plan = built.rollback
        if apply == "rollback_skip" and plan is None and ctx.rollback is None:
            # A rung that restarts with a rollback (the NaN ladder's) has no target: stop instead.
            action, apply, patch = STOP, "stop", {}
            built = Proposal(what="stop the run and alert (keep everything)")
            skipped.append(f"no rollback: {self.no_rollback_why}")
        if apply == "rollback_skip" and plan is None:
            plan = ctx.rollback
            extra = ROLLBACK.build(ctx)  # the skip-range patch of a plain rollback
            if isinstance(extra, Proposal):
                patch.update(extra.patch)
        if action.kind == "alert" and ladder in NON_FATAL:
            st.exhausted = True
        # A memory change predicted to fit is converging: the no-progress rule (OOMs never save) does not apply.
        converging = memory is not None and memory.predicted_fit is True
        stop_why = self._budget_stop(now, not converging) if apply in RESTARTING else None
        if stop_why is not None:
            symptom, budget = stop_why
            action, apply, patch, plan = STOP, "stop", {}, None
            built = Proposal(what="stop the run and alert (keep everything)")
            why = f"{why}; but {budget}"
        previous = {k: self.values.get(k) for k in patch}
        reason = f"{built.what} because {why[0].lower() + why[1:] if why else 'of ' + symptom}"
        if revert_note:
            reason += f"; reverting the last action: {revert_note}"
        if finding is not None and finding.evidence.get("implicates"):
            reason += f"; the evidence implicates {finding.evidence['implicates']}"
        if skipped:
            reason += f" ({'; '.join(skipped)})"
        if apply == "rollback_skip" and plan is not None and plan.note and plan.note not in reason:
            reason += f"; {plan.note}"   # why the rollback goes further back than the onset suggests
        hot = dict(built.hot_control)
        if action.procedure:
            hot["dump_stacks"] = True
        if apply == "rollback_skip":
            hot["suspect"] = True  # the weights are bad: a SIGTERM must not save them
        if reverted and apply == "hot":
            if K_CLIP in reverted and "gradient_clipping" not in hot:
                hot["gradient_clipping"] = reverted[K_CLIP]
            if K_LR in reverted and "lr_scale" not in hot:
                hot["lr_scale"] = reverted[K_LR] / float(self.launched.get(K_LR) or reverted[K_LR])
        d = Decision(action_kind=action.kind, symptom=symptom, apply=apply, reason=reason, ladder=ladder,
                     ladder_step=min(st.position, len(rungs) - 1), step=step, time=now, config_patch=patch,
                     previous=previous, hot_control=hot, procedure=action.procedure, reverted=reverted)
        # What an evidence-driven memory decision rests on (the OOM numbers, the plans), for the daemon's store.
        self.memory_evidence = dict(memory.evidence) if memory is not None else None
        if reverted:
            d.config_patch = {**reverted, **patch}
            d.previous = {**{k: self.values.get(k) for k in reverted}, **previous}
        if plan is not None and apply == "rollback_skip":
            self._rollback_decided(d, plan)   # its target, skip and onset; tags after the onset tainted
        self.values.update(d.config_patch)   # bookkeeping in both modes: observe-only shows the whole escalation
        st.uses += 1
        st.last = d
        st.verify_left = self.policy.verify_steps
        st.tps_before = self._by_symptom["throughput_drop"].baseline()  # type: ignore[attr-defined]  # the tokens/s one
        st.tps_after = []
        if apply == "stop":
            self.failed = True
        if apply in RESTARTING:
            st.await_left = self.policy.verify_steps
        self.pending.pop(ladder, None)
        if self.policy.mode == "observe":
            d.would_apply, d.apply = apply, "none"
            d.reason = f"observe-only: would have {action.kind} ({apply}): {reason}"
        return [d]

    def _maybe_revert(self, st: LadderState) -> tuple[dict[str, Any], str]:
        last = st.last
        if last is None or not last.config_patch or st.tps_before is None or len(st.tps_after) < 10:
            return {}, ""
        after = sorted(st.tps_after)[len(st.tps_after) // 2]
        if after >= (1 - self.policy.revert_throughput_drop) * st.tps_before:
            return {}, ""
        revert = {k: v for k, v in last.previous.items() if k != K_SKIP}
        if not revert:
            return {}, ""
        note = (f"{last.action_kind} cost {1 - after / st.tps_before:.0%} throughput "
                f"({after:.4g} vs {st.tps_before:.4g} tokens/s) and the symptom came back")
        return revert, note

