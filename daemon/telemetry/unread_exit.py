"""Unknown is loud at a derived-telemetry job's exit: a job that ends with no step record ever understood
from its output (or its framework's files) has an unknown progress, loss and final step; the run's end says
so, with the setting that fixes it, instead of claiming a final step."""

from __future__ import annotations

from typing import Any

from ulyssesd.daemon.telemetry.log_source import fix_hint, read_health, source_kind, stdout_source


def no_step_record_at_exit(sup: Any) -> tuple[str, dict[str, Any]] | None:
    """(what to say, evidence) when the run's telemetry is derived and no step record was understood in the
    whole run; None otherwise (the job's own telemetry, or at least one record)."""
    if not stdout_source(sup.config) or sup.last_step is not None:
        return None
    kind = source_kind(sup.config)
    src = getattr(sup, "_log_source", None)
    if src is not None and src.attempt == sup.attempt:
        stats = src.parser.stats
        if stats.step_records:
            return None
        lines, sample = stats.lines, stats.unparsed_sample
    else:  # a re-adopting daemon without a source: what the health file says
        health = read_health(sup.run_dir) or {}
        if health.get("step_records"):
            return None
        lines, sample = health.get("lines"), health.get("unparsed_sample")
    fix = fix_hint(kind, sample)
    what = (f"no step record was understood from the job's {'output' if kind == 'stdout' else kind} "
            f"({lines if lines is not None else '?'} line(s) read): its progress, loss and final step are "
            f"unknown, and loss, NaN, spike, slow-step and progress-based hang detection were blind")
    return what + f". Fix: {fix}", {"source": kind, "lines": lines, "example_line": sample, "fix": fix}
