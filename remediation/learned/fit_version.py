"""A calibration as a config version: the fitted detector thresholds join the run's stored config (next to the
job config and the launcher env) under `detectors`, with the fit's evidence under `calibration`, so the
store's config versions say when the thresholds changed, to what and from what - as they do for a ladder's
change of the job config. The job's configs/vN.json stays a pure job config (`job_part`).

Pure: the daemon stores what `fit_version` builds (core/decisions.py) and carries these keys over to the
versions that later actions make (`carried`).
"""

from __future__ import annotations

from typing import Any

# Keys of a stored config version that are the daemon's own (not the job's, not the launcher env).
FIT_KEYS = ("detectors", "calibration")


def job_part(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config version without the calibration's keys (the job config, with `launcher` if present)."""
    return {k: v for k, v in stored.items() if k not in FIT_KEYS}


def carried(stored: dict[str, Any] | None) -> dict[str, Any]:
    """The calibration's keys of `stored`, for the next version an action makes (a ladder's change of the job
    config keeps the thresholds in force)."""
    return {k: stored[k] for k in FIT_KEYS if stored and k in stored}


def summary(fit: dict[str, Any]) -> dict[str, Any]:
    """The evidence kept with the version: per fitted value its sample size, statistic and bounds; the rate."""
    per: dict[str, Any] = {}
    for key, value in (fit.get("values") or {}).items():
        ev = (fit.get("evidence") or {}).get("slow_step_period" if key.startswith("slow_step_period") else key) or {}
        per[key] = {"value": value, "n": ev.get("n"), "statistic": ev.get("statistic"),
                    "bounds": list(ev["bounds"]) if isinstance(ev.get("bounds"), list | tuple) else None}
    return {"at_step": fit.get("at_step"), "healthy_steps": fit.get("steps"),
            "false_alarm_rate_per_step": fit.get("false_alarm_rate_per_step"), "fitted": per,
            "not_fitted": dict(fit.get("not_fitted") or {})}


def fit_version(stored: dict[str, Any], fit: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """The next stored config version for `fit` (the engine's calibration dict), and its reason; None when the
    thresholds in force already are the fitted ones (a refit that moved nothing, a re-adopting daemon's replay
    of the same history)."""
    changed = {k: v[1] for k, v in (fit.get("changed") or {}).items()}
    if changed == (stored.get("detectors") or {}):
        return None
    new = {**job_part(stored), "detectors": changed, "calibration": summary(fit)}
    parts = []
    for key, (old, val) in (fit.get("changed") or {}).items():
        n = new["calibration"]["fitted"].get(key, {}).get("n")
        parts.append(f"{key} {old} -> {val}" + (f" (n={n})" if n is not None else ""))
    reason = (f"calibration at step {fit.get('at_step')}: fitted to {fit.get('steps')} healthy steps at "
              f"{fit.get('false_alarm_rate_per_step'):g} false alarms/step: "
              + ("; ".join(parts) if parts else "back to the configured thresholds"))
    return new, reason
