"""The engine's parts that learn from the run itself (issue 39), as a mixin of `RemediationEngine`: the
calibration schedule over its healthy records, the rollback target from its own checkpoints (never step 0
once the run has made progress), and forgetting a decision the daemon could not apply."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.job import K_SKIP, JobReach
from ulyssesd.remediation.learned.early_signals import SignalWatch
from ulyssesd.remediation.learned.early_warning import GradNormWatch
from ulyssesd.remediation.learned.preempt import PreemptiveClip
from ulyssesd.remediation.playbook import K_CLIP, K_GA, K_MB, WEIGHT_SYMPTOMS, RollbackPlan
from ulyssesd.remediation.records import Record, StepRecord

# Findings whose onset step is exact (the first non-finite loss), not a smoothed test's estimate: their
# rollback goes to the newest clean save before it (`_rollback_plan`'s precise path), not ~100 steps back.
EXACT_ONSET_SYMPTOMS = frozenset({"nan_loss"})


def exact_onset(finding: Finding) -> bool:
    """Whether `finding` dates its onset exactly (by its symptom, or its evidence's `onset = "exact"`)."""
    return finding.symptom in EXACT_ONSET_SYMPTOMS or finding.evidence.get("onset") == "exact"


# The fitted thresholds each symptom is judged by (shown with its finding's evidence).
FITTED_FOR: dict[str, tuple[str, ...]] = {
    "slow_step": ("slow_step_ratio", "slow_step_period", "slow_step_period_phase", "slow_step_period_steps"),
    "throughput_drop": ("throughput_drop_frac",),
    "memory_spike": ("memory_spike_ratio",),
    "hang": ("hang_timeout_floor_s", "hang_checkpoint_timeout_s", "hang_startup_timeout_s"),
}

# Healthy records kept for the calibration refits (references to records already parsed).
CALIBRATION_HISTORY = 5000


class NotApplied(Protocol):
    """What `not_applied` reads of the engine's Decision (engine.py imports this module, not the reverse)."""

    @property
    def action_kind(self) -> str: ...
    @property
    def symptom(self) -> str: ...
    @property
    def apply(self) -> str: ...
    @property
    def ladder(self) -> str: ...
    @property
    def config_patch(self) -> dict[str, Any]: ...
    @property
    def previous(self) -> dict[str, Any]: ...


class LearnedParts:
    # Set by RemediationEngine.__init__ (declared for the type checker).
    config: DetectorsConfig
    policy: RemediationConfig
    values: dict[str, Any]
    detectors: list[Any]
    ladders: dict[str, Any]  # ladder -> engine.LadderState (typed there: this module is imported by engine.py)
    pending: dict[str, Any]
    known_good: list[tuple[str, int]]
    saved: list[tuple[str, int]]
    max_ckpt_step: int | None
    last_step: int | None
    attempt: int | None
    failed: bool
    _samples: deque[tuple[int, tuple[int, int]]]
    _by_symptom: dict[str, Any]
    _active: Callable[[str], bool]
    reach: JobReach

    def _init_learned(self) -> None:
        # Known-good tracking: candidates (tag, step, clean steps seen after it).
        self.candidates: list[list[Any]] = []
        self.known_good = []
        self.saved = []
        self.tainted: set[str] = set()   # saved while the loss was out of its band or non-finite
        # Snapshots being written (checkpoint_saving seen, checkpoint_saved not yet): an async save of a step
        # before the onset holds that step's weights however late its write ends (the job makes it durable
        # before it exits, suspect or not), so it is a rollback target too.
        self.saving: dict[str, int] = {}
        # (onset, attempt) of the last rollback decided: that attempt's later saves at or after the onset are tainted.
        self.taint_from: tuple[int, int | None] | None = None
        self._clean_through = -1   # the last step with a finite loss and no weight symptom active
        self._last_loss_finite = True
        self.no_rollback_why = ""   # why the last rollback plan found no target
        # (tag, step) the current attempt resumed from (the daemon's launch says), None: from the start/unknown.
        self.resumed: tuple[str, int] | None = None
        self.failures: list[str] = []   # decisions the daemon could not apply (newest last)
        # The run's healthy records (step records without a finding, and events), bounded; refits read them.
        self._history: deque[Record] | None = deque(maxlen=CALIBRATION_HISTORY) if self.config.calibrate else None
        self._configured = self.config.model_copy()   # what the fits start from (their floors and ceilings)
        self._healthy_steps = 0
        self._next_fit = self.config.calibrate_after_steps
        self.calibration: dict[str, Any] | None = None
        self.calibration_new = False
        # Early warning (grad norm out of its own distribution): alerts, drained by the daemon.
        self.grad_watch = GradNormWatch(z=self.config.early_warning_z) if self.config.early_warning else None
        self.signal_watch = SignalWatch(z=self.config.early_warning_z)   # logits, update ratios, loss scale
        self.preempt = PreemptiveClip(self.policy)   # the optional clip on a grad-norm warning (off by default)
        self.new_warnings: list[dict[str, Any]] = []

    def _reachable(self, memory: Any, skipped: list[str]) -> Any:
        """The memory evidence's choice, or None (the ladder is walked) when its change cannot reach the job."""
        if memory is None:
            return None
        p = memory.proposal
        unreachable = self.reach.why_not(p.apply or memory.action.apply, p.patch, p.hot_control)
        if unreachable:
            skipped.append(f"{memory.action.kind} skipped: {unreachable}")
            return None
        return memory

    def saving_started(self, tag: str, step: int) -> None:
        self.saving[tag] = step
        if len(self.saving) > 8:   # a lost checkpoint_saved: forget the oldest
            self.saving.pop(next(iter(self.saving)))

    def _note_clean(self, step: int, weight_anomaly: bool) -> None:
        if self.preempt.pending is not None:
            self.preempt.observe(step, weight_anomaly)
        if weight_anomaly or not self._last_loss_finite:
            return
        # An episode lives on after its finding only with a ladder or a pending grace: the quiet path is cheap.
        if (self.pending or self.ladders) and self._weight_symptom_active():
            return
        self._clean_through = step

    def _weight_symptom_active(self) -> bool:
        return any(self._active(s) for s in WEIGHT_SYMPTOMS)

    def _is_tainted(self, step: int) -> bool:
        """A tag holds suspect weights when its snapshot was taken after the last clean step while a weight
        symptom is active or the loss is non-finite: by the tag's step, not by when its (async) write ended."""
        if (self._weight_symptom_active() or not self._last_loss_finite) and step > self._clean_through:
            return True
        # A rollback decided in this attempt and its restart still awaited: a save at or after its onset holds
        # weights past it (the next attempt redoes those steps from the target; an unapplied decision expires).
        t = self.taint_from
        return (t is not None and step >= t[0] and t[1] == self.attempt
                and any(st.await_left > 0 for st in self.ladders.values()))

    def _watch_grad(self, record: StepRecord) -> None:
        assert self.grad_watch is not None
        warnings = []
        if record.grad_norm is not None:
            w = self.grad_watch.observe(record)
            if w is not None:
                act = self.preempt.propose(w, self.values.get(K_CLIP))
                if act is not None and "patch" in act:
                    self.values[K_CLIP] = act["to"]   # later rungs start from the lowered clip
                warnings.append({"signal": "grad_norm", **w, **({"action": act} if act else {})})
        if record.logit_max is not None or record.update_ratio:
            warnings.extend(self.signal_watch.observe(record))
        if record.loss_scale is not None:
            w = self.signal_watch.observe_scale(record)
            if w is not None:
                warnings.append(w)
        if warnings:
            self.new_warnings.extend(warnings)
            del self.new_warnings[:-16]

    def _reset_watches(self) -> None:
        """A restart: the early-warning watches keep the run's history, not their recent flags."""
        assert self.grad_watch is not None
        self.grad_watch.reset()
        self.signal_watch.reset()

    def _count_healthy(self, record: StepRecord, findings: list[Finding] | None, now: float) -> None:
        """Keep healthy step records (no finding, no ladder at work); fit after `calibrate_after_steps` of
        them, then refit at 10x and 100x that, and every 100x after (the box may get busier later)."""
        if findings or self.ladders or self.pending or any(d.active for d in self.detectors):
            return
        assert self._history is not None
        self._history.append(record)
        self._healthy_steps += 1
        if self._healthy_steps >= self._next_fit:
            first = self.config.calibrate_after_steps
            self._next_fit = (10 * first if self._healthy_steps < 10 * first else
                              100 * first if self._healthy_steps < 100 * first else self._healthy_steps + 100 * first)
            self.calibrate(now)


    def calibrate(self, now: float | None = None, records: list[Record] | None = None) -> dict[str, Any] | None:
        """Fit the thresholds to the run's healthy history (learned/fit.py) and use them;
        `records` defaults to the engine's own buffer. Returns the fit (also in `self.calibration`)."""
        from ulyssesd.remediation.learned import fit as calibration

        recs = records if records is not None else list(self._history or ())
        spike = self._by_symptom.get("loss_spike")
        bands = spike.source_summary() if spike is not None and hasattr(spike, "source_summary") else None
        f = calibration.fit(recs, self._configured, self.config.calibrate_false_alarm_rate, bands)
        for k in (self.calibration or {}).get("values") or {}:   # an earlier fit's value this one does not set
            if k not in f.values:
                setattr(self.config, k, getattr(self._configured, k))
        before = {k: getattr(self._configured, k) for k in f.values}
        calibration.apply(self.config, f)
        changed = {k: (before[k], v) for k, v in f.values.items() if before[k] != v}
        self.config.step_time_warmup_steps = 0   # fitted: later (re)starts warm up as the other detectors
        self.calibration = {**f.as_dict(), "changed": {k: list(v) for k, v in changed.items()},
                            "at_step": self.last_step, "time": now}
        self.calibration_new = True
        return self.calibration


    def _with_fit(self, finding: Finding) -> Finding:
        """The thresholds that judged `finding`, fitted or configured, in its evidence: which are fitted and from
        what (sample size, fitted value, the rate targeted) - what `ulyssesctl incident` shows."""
        keys = FITTED_FOR.get(finding.symptom, ())
        cal = self.calibration
        if not keys or "thresholds" in finding.evidence:
            return finding
        vals, ev = (cal.get("values") or {}, cal.get("evidence") or {}) if cal else ({}, {})
        th: dict[str, Any] = {}
        for k in keys:
            if k in vals:
                e = ev.get("slow_step_period" if k.startswith("slow_step_period") else k) or {}
                th[k] = {"value": getattr(self.config, k), "configured": getattr(self._configured, k),
                         "fitted": True, "n": e.get("n"), "statistic": e.get("statistic")}
            else:
                th[k] = {"value": getattr(self.config, k), "fitted": False}
        if cal:
            th["fit"] = {"at_step": cal.get("at_step"), "healthy_steps": cal.get("steps"),
                         "false_alarm_rate_per_step": cal.get("false_alarm_rate_per_step"),
                         "config_version": cal.get("config_version")}
        else:
            th["fit"] = (f"not fitted yet: {self._healthy_steps} healthy steps of {self.config.calibrate_after_steps}"
                         if self.config.calibrate else "calibrate = false: the configured values")
        finding.evidence["thresholds"] = th
        return finding

    def _rollback_plan(self, anomaly_step: int | None, precise: bool = False, sources: int = 1,
                       exact: bool = False) -> RollbackPlan | None:
        """Where a rollback goes. With a `precise` onset (a per-source band's, or an `exact` one: the first
        non-finite loss): the newest checkpoint saved before it (less a margin for a band's smoothing; none for
        an exact onset) whose loss at save was finite and in band (not tainted).
        Otherwise a known-good tag at least `rollback_steps_back` before the onset (PaLM: ~100; a detector's
        onset may lag the true one), else the newest known-good before it, else the newest clean save. None (with `no_rollback_why`) when there is none and the run has made real progress:
        step 0 is never chosen automatically then."""
        pol = self.policy
        a = anomaly_step if anomaly_step is not None else (self.last_step or 0)
        a, note = self._suspect_resume(a) if exact else (a, "")
        target: tuple[str | None, int] | None = None
        tag: str | None
        # The detector's onset may trail the true one by its smoothing (each source is seen about every
        # `sources` steps): keep a margin before it.
        margin = 0 if exact else 2 * self.config.loss_source_smooth * max(1, sources)
        clean = [(t, s) for t, s in self.saved if s < a - margin and t not in self.tainted]
        clean = sorted(clean + [(t, s) for t, s in self.saving.items()  # writes still in flight, by their step
                                if s < a - margin and s <= self._clean_through and (t, s) not in clean],
                       key=lambda ts: ts[1])
        if precise and clean:
            # A per-source band dates its onset to the first value out of band: the newest checkpoint saved
            # before it with finite, in-band loss costs the least work (less than one save interval).
            target = clean[-1]
        for tag, s in reversed(self.known_good):
            if target is None and s <= a - pol.rollback_steps_back:
                target = (tag, s)
                break
        if target is None:
            earlier = [(t, s) for t, s in self.known_good if s < a]
            if earlier:
                target = earlier[-1]
        if target is None and clean:
            target = clean[-1]
        if target is None:
            progress = self.max_ckpt_step is not None or (self.last_step or 0) >= pol.known_good_steps
            if progress:
                self.no_rollback_why = (
                    f"no checkpoint saved before the onset at step {a} with finite, in-band loss "
                    f"({len(self.saved)} saved, {len(self.tainted)} during the anomaly); a run at step "
                    f"{self.last_step} is never rolled back to step 0 automatically")
                return None
            target = (None, 0)
        tag, to_step = target
        if precise and not exact and target in clean:
            # A band's dated onset: skip the batches from the checkpoint through the detection (they hold the
            # onset's), plus the margin after it - not a fixed few hundred (bounded by skip_max_batches).
            first = to_step + 1
            last = min(first + pol.skip_max_batches, max(a, self.last_step or a) + margin + 1)  # exclusive
        else:
            n = max(pol.skip_min_batches, min(pol.skip_max_batches, 2 * (a - to_step)))
            first = max(to_step + 1, a - n // 2)
            last = first + n  # exclusive
        start, est1 = self._sample_start(first)
        end, est2 = self._sample_start(last)
        # A job the skip cannot reach (a command job) is claimed none: the rollback alone applies.
        skips = [] if self._skip_unreached() else [(start, end)]
        return RollbackPlan(to_step=to_step, tag=tag, skip_ranges=skips, skip_steps=(first, last),
                            estimated=est1 or est2, note=note, onset=a)

    def _rollback_decided(self, d: Any, plan: RollbackPlan) -> None:
        """A rollback to `plan` was decided (engine.Decision `d`): its fields, and every tag of this attempt saved at
        or after the onset is tainted from now on - also one whose `checkpoint_saved` comes later (the job's exit
        save after the SIGTERM: H100 r3, step-00000121 after a NaN at 120, whose own loss was finite again)."""
        d.rollback_to_step, d.rollback_tag, d.skip_ranges = plan.to_step, plan.tag, list(plan.skip_ranges)
        d.rollback_onset = plan.onset
        if plan.onset is None:
            return
        self.taint_from = (plan.onset, self.attempt)
        self.tainted.update(t for t, s in [*self.saved, *self.saving.items()] if s >= plan.onset)


    def _skip_unreached(self) -> str:
        """Why a rollback's data skip cannot reach the job ("" when it does: the built-in job)."""
        return "" if self.reach.takes_key(K_SKIP) else f"{K_SKIP} does not reach the job ({self.reach.why_limited})"

    def _suspect_resume(self, onset: int) -> tuple[int, str]:
        """An exact onset within `suspect_resume_steps` of the attempt's resume point: the resumed checkpoint
        already held the bad weights (its save followed the update that poisoned them, its own loss still
        finite), so resuming it again changes nothing. The onset moves to its step: the rollback goes to a
        save before it (and the daemon sets it aside with every later one)."""
        r = self.resumed
        if r is None or not (r[1] < onset <= r[1] + self.policy.suspect_resume_steps):
            return onset, ""
        tag, step = r
        self.tainted.add(tag)
        return step, (f"{tag} is suspect: the loss went non-finite at step {onset}, {onset - step} step(s) after "
                      f"resuming it; remediation.suspect_resume_steps={self.policy.suspect_resume_steps}")

    def _sample_start(self, step: int) -> tuple[int, bool]:
        """First global sample index of `step`: recorded when seen recently, else extrapolated."""
        known = dict(self._samples)
        if step in known:
            return known[step][0], False
        last = self._samples[-1][1] if self._samples else None
        sps = (last[1] - last[0]) if last else float(int(self.values.get(K_MB) or 1) * int(self.values.get(K_GA) or 1)
                                 * max(1, int(self.values.get("parallel.world_size") or 1)
                                       // int(self.values.get("parallel.sequence_parallel_size") or 1)))
        if known:
            k = min(known, key=lambda s: abs(s - step))
            return int(known[k][0] + (step - k) * sps), True
        return int((step - 1) * sps) if step > 0 else 0, True


    def not_applied(self, d: NotApplied, why: str) -> None:
        """The daemon could not apply decision `d` (building its config or writing it failed): undo the
        bookkeeping `_decide` did, so no later decision claims a verification window of a rung that never
        ran, and move past that rung (it is skipped next time, with `why`)."""
        st = self.ladders.get(d.ladder)
        for k in d.config_patch:
            self.values[k] = d.previous.get(k)
        self.failed = False if d.apply != "stop" else self.failed
        if st is None or st.last is not d:
            return
        st.last, st.verify_left, st.await_left = None, 0, 0
        st.uses = 0
        st.position += 1
        self.failures.append(f"{d.action_kind} for {d.symptom} was not applied: {why}")
        self.failures = self.failures[-16:]

