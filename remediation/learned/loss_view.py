"""Per-source loss for `ulyssesctl status`: each data source's recent level and its trend, from the newest
step records of the run's telemetry (as dicts). A hard source's high loss that keeps falling is progress
and is shown as such."""

from __future__ import annotations

import math
from typing import Any


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


def per_source(recent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """[{source, loss (median of its newer half), before (median of its older half), trend, n}] from
    step dicts carrying `loss_by_source`; [] when none does. Trend: falling/rising when the halves differ
    by more than 2 % of the level, else flat."""
    by: dict[str, list[float]] = {}
    for rec in recent:
        src = rec.get("loss_by_source")
        if not isinstance(src, dict):
            continue
        for name, val in src.items():
            if isinstance(val, int | float) and math.isfinite(val):
                by.setdefault(str(name), []).append(float(val))
    out = []
    for name, vals in sorted(by.items()):
        half = len(vals) // 2
        now = _median(vals[half:]) if vals[half:] else math.nan
        before = _median(vals[:half]) if half else math.nan
        if math.isnan(before):
            trend = "new"
        elif now < before * 0.98:
            trend = "falling"
        elif now > before * 1.02:
            trend = "rising"
        else:
            trend = "flat"
        out.append({"source": name, "loss": now, "before": None if math.isnan(before) else before,
                    "trend": trend, "n": len(vals)})
    return out
