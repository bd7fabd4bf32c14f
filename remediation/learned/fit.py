"""Detector thresholds fitted to the run's own healthy history, at a stated false-alarm rate, bounded.

`fit(records, cfg)` reads the healthy records of a run (telemetry up to now, or the engine's own buffer after
warm-up) and returns the thresholds it would set, each with its evidence (sample size, the statistic, the
rate it targets) and clamped between a floor (never trigger-happy) and a ceiling (never blind):

- slow_step_ratio: the slow-step test needs `slow_step_min_consecutive` steps in a row above ratio x median,
  so the statistic is the minimum ratio over each such run of steps; its tail above the 90th percentile is
  fitted with an exponential (mean excess) and extrapolated to the target rate per step. A box whose step
  time follows its neighbours gets a higher ratio; a quiet GPU keeps the configured one (its floor).
- throughput_drop_frac: the same for the tokens/s drop below its median over `throughput_persist_steps`.
- hang_timeout_floor_s: from the longest healthy silence between two records that no announced work explains
  (a save, load, evaluation or data wait between its begin and end events has its own allowance, hang.py).
- hang_checkpoint_timeout_s: from the longest save (checkpoint_saving -> checkpoint_saved).
- hang_startup_timeout_s: from the run's own start-ups (process start -> first step record).
- slow_step_period / _phase / _steps: slow runs that come back every N steps (an evaluation or save the job
  does not announce) are the run's rhythm (learned/periodic.py): learned, passed over by the slow-step
  detector, and left out of the slow-step ratio's statistic.
- memory_spike_ratio: the peak memory's ratio to its rolling baseline, the same tail fit; the baseline itself
  (median, p99, max of the healthy peaks) is the evidence.
- the loss bands fit themselves per source (loss_band.py); their fitted relative sigma is reported here.

Pure: no I/O (the daemon writes the fit to the run directory; `ulyssesctl tune` computes it offline).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.hang import ANNOUNCED_BEGIN, ANNOUNCED_END
from ulyssesd.remediation.learned.periodic import find_period, in_window
from ulyssesd.remediation.records import EventRecord, Record, StepRecord

# Bounds of the fitted values: a fit can make a detector neither blind nor trigger-happy.
SLOW_RATIO_BOUNDS = (1.5, 10.0)
HANG_FLOOR_CEILING_S = 3600.0   # the floor's lower bound is the configured floor
CKPT_TIMEOUT_BOUNDS_S = (300.0, 3600.0)
STARTUP_TIMEOUT_BOUNDS_S = (120.0, 7200.0)
THROUGHPUT_DROP_CEILING = 0.9   # a throughput drop of 90 % is always found
MEMORY_RATIO_CEILING = 3.0      # a peak 3x its baseline is always a spike
MARGIN = 3.0          # a timeout is this many times the longest healthy duration seen
MIN_STEPS = 100       # fewer healthy steps fit nothing


@dataclass
class Fit:
    """What a calibration sets, and why."""

    values: dict[str, float] = field(default_factory=dict)      # DetectorsConfig field -> fitted value
    evidence: dict[str, dict[str, Any]] = field(default_factory=dict)
    rate: float = 1e-5                                            # false alarms per step it targets
    steps: int = 0                                                # healthy step records it read
    skipped: dict[str, str] = field(default_factory=dict)         # field -> why it was not fitted

    def as_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "evidence": self.evidence, "false_alarm_rate_per_step": self.rate,
                "steps": self.steps, "not_fitted": dict(self.skipped)}


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def tail_quantile(values: list[float], rate: float) -> tuple[float, dict[str, Any]]:
    """The value exceeded with probability `rate`: empirical when the sample reaches that far, else an
    exponential tail (mean excess over the 90th percentile) extrapolated from it."""
    s = sorted(values)
    n = len(s)
    u = s[int(0.9 * (n - 1))]
    excess = [v - u for v in s if v > u]
    beta = sum(excess) / len(excess) if excess else 0.0
    p0 = len(excess) / n if excess else 0.0
    if p0 <= rate or beta <= 0:
        return s[-1], {"method": "max", "n": n, "max": s[-1]}
    x = u + beta * math.log(p0 / rate)
    return max(x, s[-1]), {"method": "exponential tail over p90", "n": n, "p90": u, "mean_excess": beta,
                           "max": s[-1]}


def fit(records: Iterable[Record], cfg: DetectorsConfig, rate: float = 1e-5,
        loss_bands: list[dict[str, Any]] | None = None) -> Fit:
    out = Fit(rate=rate)
    win: deque[float] = deque(maxlen=cfg.window)
    seq: list[tuple[int, float, int]] = []   # (step, step time / median, attempt segment)
    segment = 0
    mem_win: deque[float] = deque(maxlen=cfg.window)
    mem_ratios: list[float] = []
    mems: list[float] = []
    skip_next = False
    prev_time: float | None = None
    longest_gap = 0.0
    saving_at: float | None = None
    longest_save = 0.0
    startups: list[float] = []
    started_at: float | None = None
    tps_win: deque[float] = deque(maxlen=cfg.window)
    drop_run: deque[float] = deque(maxlen=cfg.throughput_persist_steps)
    drops: list[float] = []
    for rec in records:
        if isinstance(rec, EventRecord):
            name = rec.event
            if name.startswith("checkpoint_") or name == "control_applied":
                skip_next = True
            # Announced work is no silence: the gap runs up to its begin and starts again at its end.
            if name in ANNOUNCED_BEGIN and rec.time is not None:
                if prev_time is not None:
                    longest_gap = max(longest_gap, rec.time - prev_time)
                prev_time = None
            elif name in ANNOUNCED_END and rec.time is not None:
                prev_time = rec.time
            if name == "checkpoint_saving" and rec.time is not None:
                saving_at = rec.time
            elif name == "checkpoint_saved" and rec.time is not None and saving_at is not None:
                longest_save = max(longest_save, rec.time - saving_at)
                saving_at = None
            elif name == "started":
                st = rec.fields.get("startup")
                began = st.get("process_started_at") if isinstance(st, dict) else None
                started_at = float(began) if isinstance(began, int | float) else rec.time
                prev_time = None
                win.clear()
                mem_win.clear()
                segment += 1
            continue
        assert isinstance(rec, StepRecord)
        out.steps += 1
        if rec.time is not None:
            if started_at is not None:
                startups.append(rec.time - started_at)
                started_at = None
            if prev_time is not None:
                longest_gap = max(longest_gap, rec.time - prev_time)
            prev_time = rec.time
        tps = rec.tokens_per_s
        if tps is not None and tps > 0 and math.isfinite(tps):
            if len(tps_win) >= min(cfg.window, 20):
                base = sorted(tps_win)[len(tps_win) // 2]
                drop_run.append(1 - tps / base)
                if len(drop_run) == drop_run.maxlen:
                    drops.append(min(drop_run))
            tps_win.append(tps)
        mem = rec.mem_max_allocated_gib
        if mem is not None and mem > 0 and math.isfinite(mem):
            if len(mem_win) >= min(cfg.window, 20):
                mem_ratios.append(mem / sorted(mem_win)[len(mem_win) // 2])
            mem_win.append(mem)
            mems.append(mem)
        t = rec.step_time_max_s if rec.step_time_max_s is not None else rec.step_time_s
        if t is None or not t > 0:
            continue
        if skip_next:
            skip_next = False
            continue
        if len(win) >= min(cfg.window, 20):
            seq.append((rec.step, t / sorted(win)[len(win) // 2], segment))
        win.append(t)
    if out.steps < MIN_STEPS:
        out.skipped["all"] = f"{out.steps} healthy step records; a fit needs at least {MIN_STEPS}"
        return out
    period = _periodic_slow(seq, cfg, out)
    stats = _run_minima(seq, cfg.slow_step_min_consecutive, period)
    if len(stats) >= MIN_STEPS // 2:
        q, ev = tail_quantile(stats, rate)
        # 20 % above the extrapolated quantile: the fit's own uncertainty.
        # Floor: the configured ratio (a quiet run keeps the documented sensitivity; a noisy one is raised).
        bounds = (max(SLOW_RATIO_BOUNDS[0], cfg.slow_step_ratio), SLOW_RATIO_BOUNDS[1])
        out.values["slow_step_ratio"] = round(_clamp(1.2 * q, *bounds), 3)
        out.evidence["slow_step_ratio"] = {**ev, "statistic": f"min step-time/median over "
                                           f"{cfg.slow_step_min_consecutive} steps in a row"
                                           + (" outside the periodic slow steps" if period else ""),
                                           "quantile_at_rate": q, "bounds": bounds}
    else:
        out.skipped["slow_step_ratio"] = f"{len(stats)} step-time ratios; needs {MIN_STEPS // 2}"
    if len(drops) >= MIN_STEPS // 2:
        q, ev = tail_quantile(drops, rate)
        bounds = (cfg.throughput_drop_frac, THROUGHPUT_DROP_CEILING)
        out.values["throughput_drop_frac"] = round(_clamp(1.2 * q, *bounds), 3)
        out.evidence["throughput_drop_frac"] = {**ev, "statistic": f"min tokens/s drop below the median over "
                                                f"{cfg.throughput_persist_steps} steps in a row",
                                                "quantile_at_rate": q, "bounds": bounds}
    _fit_memory(mem_ratios, mems, cfg, rate, out)
    if longest_gap > 0:
        bounds = (cfg.hang_timeout_floor_s, max(cfg.hang_timeout_floor_s, HANG_FLOOR_CEILING_S))
        out.values["hang_timeout_floor_s"] = round(_clamp(MARGIN * longest_gap, *bounds), 1)
        out.evidence["hang_timeout_floor_s"] = {"longest_unannounced_gap_s": longest_gap, "margin": MARGIN,
                                                "bounds": bounds}
    if longest_save > 0:
        out.values["hang_checkpoint_timeout_s"] = round(_clamp(MARGIN * 2 * longest_save, *CKPT_TIMEOUT_BOUNDS_S), 1)
        out.evidence["hang_checkpoint_timeout_s"] = {"longest_save_s": longest_save, "margin": 2 * MARGIN,
                                                     "bounds": CKPT_TIMEOUT_BOUNDS_S}
    if startups:
        hi = min(STARTUP_TIMEOUT_BOUNDS_S[1], cfg.hang_startup_timeout_s)
        out.values["hang_startup_timeout_s"] = round(_clamp(5 * max(startups), STARTUP_TIMEOUT_BOUNDS_S[0], hi), 1)
        out.evidence["hang_startup_timeout_s"] = {"startups_s": [round(s, 2) for s in startups[-8:]],
                                                  "margin": 5, "bounds": (STARTUP_TIMEOUT_BOUNDS_S[0], hi)}
    if loss_bands:
        out.evidence["loss_bands"] = {"per_source": loss_bands, "k_sigma": cfg.loss_spike_mad,
                                      "note": "each source's band fits its own relative residual scale"}
    return out


def _periodic_slow(seq: list[tuple[int, float, int]], cfg: DetectorsConfig, out: Fit) -> dict[str, Any] | None:
    """Slow runs (step time above the configured ratio x median, steps in a row) that recur with one period
    (learned/periodic.py): fitted as slow_step_period/_phase/_steps, with the runs as evidence."""
    runs: list[tuple[int, int]] = []
    cur: list[int] = []
    last: tuple[int, int] | None = None   # (step, segment) of the previous entry
    for step, r, seg in seq:
        if r > cfg.slow_step_ratio and cur and last is not None and last[1] == seg and step - last[0] <= 2:
            cur.append(step)
        else:
            if cur:
                runs.append((cur[0], cur[-1] - cur[0] + 1))
            cur = [step] if r > cfg.slow_step_ratio else []
        last = (step, seg)
    if cur:
        runs.append((cur[0], cur[-1] - cur[0] + 1))
    if not seq:
        return None
    p = find_period(runs, seq[0][0], seq[-1][0])
    if p is None:
        if len(runs) >= 3:
            out.skipped["slow_step_period"] = f"{len(runs)} slow runs with no common period"
        return None
    out.values.update({"slow_step_period": p["period"], "slow_step_period_phase": p["phase"],
                       "slow_step_period_steps": p["steps"]})
    out.evidence["slow_step_period"] = {**p, "n": len(runs), "statistic": f"starts of runs of steps above "
                                        f"{cfg.slow_step_ratio:g}x the median", "tolerance_steps": 1}
    return p


def _run_minima(seq: list[tuple[int, float, int]], k: int, period: dict[str, Any] | None) -> list[float]:
    """The min ratio over each `k` entries in a row of one segment, leaving out the periodic windows."""
    stats: list[float] = []
    run: deque[float] = deque(maxlen=k)
    seg_of: int | None = None
    for step, r, seg in seq:
        if seg != seg_of:
            run.clear()
            seg_of = seg
        if period and in_window(step, period["period"], period["phase"], period["steps"]):
            run.clear()
            continue
        run.append(r)
        if len(run) == k:
            stats.append(min(run))
    return stats


def _fit_memory(ratios: list[float], mems: list[float], cfg: DetectorsConfig, rate: float, out: Fit) -> None:
    """memory_spike_ratio from the healthy peaks' ratio to their rolling baseline (floor: the configured ratio)."""
    if len(ratios) < MIN_STEPS // 2:
        out.skipped["memory_spike_ratio"] = f"{len(ratios)} memory readings over a baseline; needs {MIN_STEPS // 2}"
        return
    q, ev = tail_quantile(ratios, rate)
    bounds = (cfg.memory_spike_ratio, max(cfg.memory_spike_ratio, MEMORY_RATIO_CEILING))
    s = sorted(mems)
    out.values["memory_spike_ratio"] = round(_clamp(1.2 * q, *bounds), 3)
    out.evidence["memory_spike_ratio"] = {**ev, "statistic": "peak allocated / rolling median", "quantile_at_rate": q,
                                          "bounds": bounds, "baseline_gib": {"median": s[len(s) // 2],
                                          "p99": s[int(0.99 * (len(s) - 1))], "max": s[-1]}}


def apply(cfg: DetectorsConfig, f: Fit) -> dict[str, tuple[Any, float]]:
    """Set the fitted values on `cfg` (validated assignment); returns {field: (old, new)}."""
    changed: dict[str, tuple[Any, float]] = {}
    for key, val in f.values.items():
        old = getattr(cfg, key)
        if old != val:
            setattr(cfg, key, val)
            changed[key] = (old, val)
    return changed
