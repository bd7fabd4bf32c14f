"""Detector thresholds and remediation policy: the `[detectors]` and `[remediation]` sections of a run spec.

Owned by the remediation library (pure; no I/O). Every field keeps a one-line doc and a sensible default;
docs/REMEDIATION.md explains how to tune them with `ulyssesctl replay`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DetectorsConfig(_Section):
    # --- shared
    warmup_steps: int = Field(20, ge=0, description="Steps after each (re)start during which statistical detectors stay quiet.")
    window: int = Field(100, ge=5, description="Rolling window (steps) of the robust baselines.")
    refire_steps: int = Field(50, ge=1, description="While an anomaly persists, its finding is repeated every N steps.")
    clear_steps: int = Field(3, ge=1, description="Consecutive normal steps that end an anomaly episode.")
    # --- loss spike
    loss_spike_mad: float = Field(8.0, gt=0, description="Loss spike = loss above median + k·sigma (sigma = 1.4826·MAD of the window).")
    loss_spike_min_rel: float = Field(0.10, ge=0, description="...and at least this fraction above the window median (ignores tiny-noise baselines).")
    loss_spike_min_records: int = Field(2, ge=2, description="Records in the baseline before the loss-spike test runs (below 10: a 2x relative rule; a log every 10 steps has few).")
    loss_smooth_records: int = Field(1, ge=1, description="Loss spike tests the mean of the last N losses (1 = each raw loss; a preset whose per-step loss is multi-modal: more).")
    loss_spike_persist_steps: int = Field(1, ge=1, description="Steps a loss must stay above the threshold before it is a spike (1 = at once; noisy tiny presets: more).")
    loss_spike_severe_rel: float = Field(0.5, gt=0, description="A spike this fraction above the median is severe: the engine's shorter severe grace applies.")
    loss_source_smooth: int = Field(5, ge=1, description="Per-source loss (loss_by_source): each source's band judges the median of its last N losses (one outlier sample moves nothing).")
    loss_source_level_records: int = Field(25, ge=3, description="A source's level is the median of its last N healthy losses (short: a falling loss is not left behind).")
    loss_source_min_history: int = Field(20, ge=3, description="Observations of a source before its band judges it.")
    loss_source_persist: int = Field(3, ge=1, description="One source alone is a spike after this many of its observations in a row above its band (several sources at once: at once).")
    loss_mixture: StrictBool = Field(True, description="Without loss_by_source: once the run's loss is multi-modal (its own modes apart by 35 %+ and 4 sigma), judge each value within the mode it belongs to.")
    loss_zero_min_prev: float = Field(0.1, ge=0, description="A loss of exactly 0 right after a loss of at least this is a broken loss (nan_loss), not convergence.")
    # --- loss oscillation
    loss_osc_window: int = Field(20, ge=4, description="Short window (steps) over which the step-to-step loss swing is measured.")
    loss_osc_ratio: float = Field(4.0, gt=1, description="Oscillation = median absolute Δloss of the short window above ratio × the run's own baseline swing.")
    loss_osc_min_direction_changes: float = Field(0.75, ge=0, le=1, description="...and at least this fraction of steps reverse direction (iid noise: ~2/3).")
    # --- memory
    memory_spike_ratio: float = Field(1.5, gt=1, description="Memory spike = step max-allocated above ratio × baseline.")
    memory_min_delta_gib: float = Field(1.0, ge=0, description="...and at least this many GiB above the baseline (ignores tiny CPU runs).")
    device_memory_gib: float | None = Field(None, gt=0, description="Device capacity per GPU; None = unknown (capacity check off).")
    memory_capacity_frac: float = Field(0.95, gt=0, le=1, description="Memory spike when max-allocated reaches this fraction of capacity.")
    # --- fp16 overflow
    overflow_window: int = Field(100, ge=5, description="Window (steps) of the skipped-step rate.")
    overflow_max_rate: float = Field(0.2, gt=0, le=1, description="Overflow storm = skipped-step rate above this over the window.")
    overflow_startup_steps: int = Field(100, ge=0, description="Skipped steps this early after each start are healthy loss-scale calibration.")
    overflow_max_halvings: int = Field(4, ge=1, description="Overflow storm = at least this many loss-scale halvings within overflow_window steps (even with skipped false/absent).")
    overflow_floor_factor: float = Field(4.0, ge=1, description="...or a halving that leaves the fp16 loss scale within this factor of its minimum.")
    # --- speed
    slow_step_ratio: float = Field(2.0, gt=1, description="Slow step = step time above ratio × rolling median (seed: 2×).")
    slow_step_min_consecutive: int = Field(3, ge=1, description="Consecutive slow steps before a slow_step finding (one GC/save step is normal).")
    slow_step_period: int = Field(0, ge=0, description="Slow steps that recur every N steps (an unannounced eval/save) pass; 0 = none (the calibration learns it).")
    slow_step_period_phase: int = Field(0, ge=0, description="...their first step modulo the period.")
    slow_step_period_steps: int = Field(0, ge=0, description="...and how many steps each lasts (a slowdown that outlasts it is still found).")
    straggler_ratio: float = Field(1.25, gt=1, description="Straggler = slowest rank's step time above ratio × rank 0's.")
    straggler_persist_steps: int = Field(10, ge=1, description="...with the same slowest rank for this many consecutive steps.")
    throughput_drop_frac: float = Field(0.25, gt=0, lt=1, description="Throughput drop = tokens/s below (1 - frac) × baseline median.")
    throughput_persist_steps: int = Field(20, ge=1, description="...sustained for this many consecutive steps.")
    drift_enabled: StrictBool = Field(True, description="Run the step-time drift CUSUM (off for a shared CPU box, whose step time follows its neighbours).")
    drift_baseline_window: int = Field(500, ge=20, description="Records in the long robust (median) step-time baseline of the drift CUSUM.")
    drift_min_baseline: int = Field(200, ge=10, description="Records the drift baseline needs before (and after each alarm, again before) the CUSUM runs.")
    drift_min_effect: float = Field(0.10, gt=0, lt=1, description="Floor of the drift CUSUM's effect size (smallest sustained relative slowdown it reports); the run's own step-time history may raise it.")
    drift_effect_margin: float = Field(1.5, ge=1, description="The learned effect size is the smallest at which the CUSUM over the baseline's own history stays below h / this margin.")
    drift_detect_steps: int = Field(50, ge=5, description="A slowdown of twice the effect size or more is found after about this many steps (h = steps × effect / 4); one of the effect size later, one below 3/4 of it never.")
    drift_allowance: float = Field(0.015, gt=0, description="Floor of the CUSUM allowance k (k = 3/4 of the effect size): relative slowdown per step that never accumulates.")
    drift_threshold: float = Field(0.6, gt=0, description="Floor of the CUSUM alarm h (relative slowdown × steps).")
    drift_clip: float = Field(0.10, gt=0, description="One step counts at most this relative slowdown, or the effect size if larger (a checkpoint/eval/GC step is not a drift).")
    drift_noise_factor: float = Field(6.0, gt=0, description="h is at least this × per-step variance / allowance (noisier step times need a longer drift).")
    drift_rank_share: float = Field(0.6, gt=0, le=1, description="A drift is attributed to a rank that was the slowest on at least this share of its records.")
    # --- hang
    hang_timeout_floor_s: float = Field(20.0, gt=0, description="The hang timeout is never shorter than this.")
    hang_step_multiplier: float = Field(5.0, gt=1, description="Hang timeout in training = max(floor, multiplier × the median time between step records, the margin below).")
    hang_longest_gap_margin: float = Field(3.0, ge=1, description="...and at least this × the longest recent time between step records (a GC or a slow optimizer step).")
    hang_phase_margin: float = Field(2.0, ge=1, description="Announced work (save, load, evaluation, data wait) adds this × its own longest measured duration in the run to the timeout.")
    hang_checkpoint_timeout_s: float = Field(1800.0, gt=0, description="Timeout of a checkpoint save/load before the run has measured one (at least the step-based one).")
    hang_phase_timeout_s: float = Field(1800.0, gt=0, description="Timeout of an announced evaluation or data wait before the run has measured one (at least the step-based one).")
    hang_startup_timeout_s: float = Field(1800.0, gt=0, description="Timeout from start until the first step record (model build, load).")


    # --- calibration from the run's own healthy history (remediation/learned/fit.py)
    calibrate: StrictBool = Field(True, description="After calibrate_after_steps healthy steps, fit the step-time and timeout thresholds to the run's own history (bounded); off = the values above as set.")
    calibrate_after_steps: int = Field(100, ge=50, description="Healthy steps of history the fit reads (the first fit; `ulyssesctl tune` refits on demand).")
    step_time_warmup_steps: int | None = Field(None, ge=0, description="With calibrate on: steps before the step-time detectors (slow step, throughput drop, drift) judge the first time (None = `window`: a full baseline); their thresholds are fitted to these (a shared box's noise is learned, not flagged).")
    calibrate_false_alarm_rate: float = Field(1e-5, gt=0, lt=0.01, description="False alarms per step the fitted thresholds target.")


    # --- early warning (remediation/learned/early_warning.py)
    early_warning: StrictBool = Field(True, description="Alert when the grad norm leaves the run's own distribution (EMA z-score per source set) and stays there: a warning, no ladder action.")
    early_warning_z: float = Field(4.0, gt=1, description="A step's grad norm is out of distribution above this z (log scale, EMA mean/variance).")

    def step_time_warmup(self) -> int:
        """Warm-up of the step-time detectors: the longer `step_time_warmup_steps` until the first fit."""
        if not self.calibrate:
            return self.warmup_steps
        first = self.window if self.step_time_warmup_steps is None else self.step_time_warmup_steps
        return max(self.warmup_steps, first)


class RemediationConfig(_Section):
    mode: Literal["act", "observe"] = Field("act", description="observe = record what would be done, do nothing.")
    max_restarts_per_hour: int = Field(6, ge=0, description="Restart budget; beyond it the run ends FAILED.")
    no_progress_restarts: int = Field(3, ge=1, description="Restarts without checkpoint advance before FAILED.")
    grace_steps: int = Field(20, ge=0, description="A spike that recovers by itself within this many steps costs nothing.")
    severe_grace_steps: int = Field(10, ge=0, description="Grace for a severe finding (loss far above the band): it acts if still active this many steps later.")
    verify_steps: int = Field(200, ge=1, description="Steps after an action during which a recurrence escalates to the next ladder step.")
    revert_throughput_drop: float = Field(0.10, gt=0, lt=1, description="Revert an action whose verification window lost this fraction of tokens/s for no gain.")
    known_good_steps: int = Field(100, ge=1, description="A checkpoint becomes known-good after this many anomaly-free steps.")
    rollback_steps_back: int = Field(100, ge=0, description="Roll back to a known-good tag at least this many steps before the anomaly (PaLM: ~100).")
    skip_min_batches: int = Field(200, ge=1, description="Rollback-and-skip skips at least this many batches (steps) of data.")
    skip_max_batches: int = Field(500, ge=1, description="...and at most this many.")
    max_rollbacks: int = Field(3, ge=1, description="Rollbacks a ladder may take in a row (no verified window between) before it stops the run.")
    suspect_resume_steps: int = Field(3, ge=0, description="A NaN within this many steps of resuming a checkpoint makes that checkpoint suspect: the next rollback goes to a save before it (0: off).")
    max_crash_restarts: int = Field(3, ge=1, description="Plain restarts in a row per crash kind (NCCL, segfault, hang, ...) before stop + alert.")
    clip_floor: float = Field(0.1, gt=0, description="Gradient clipping is never lowered below this.")
    early_warning_clip: StrictBool = Field(False, description="Pre-emptive, off by default: on a grad-norm early warning lower gradient clipping (hot) to the run's own grad-norm threshold (ZClip: EMA of log grad norm, mean + 2.5 sigma), never below clip_floor; verified like a rung.")
    early_warning_clip_max: int = Field(3, ge=1, description="...at most this many pre-emptive clips per run.")
    lr_floor_frac: float = Field(0.5, gt=0, le=1, description="LR is never lowered below this fraction of the run's initial LR.")
    lr_step_frac: float = Field(0.10, gt=0, lt=1, description="Each LR step lowers the LR by this fraction.")
    fp32_layers: int = Field(10, ge=1, description="Loss ladder: run the first N blocks in fp32 (capped at the model's layers).")
    persistence_threshold_min: float = Field(1e6, gt=0, description="Memory ladder raises stage3_param_persistence_threshold to this if below.")
    max_live_parameters_floor: float = Field(1e7, gt=0, description="Halving stage3_max_live_parameters stops at this floor.")
    prefetch_bucket_floor: float = Field(1e6, gt=0, description="Halving stage3_prefetch_bucket_size stops at this floor.")
    reduce_bucket_ceiling: float = Field(1e8, gt=0, description="Comm-bound slow steps double reduce_bucket_size up to this ceiling (seed: 5e7 → 1e8).")
    bf16_supported: StrictBool = Field(True, description="The hardware runs bf16 (NaN ladder may switch fp16 → bf16).")
