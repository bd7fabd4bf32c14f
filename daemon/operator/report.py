"""`ulyssesctl report RUN [--out report.html]`: a self-contained HTML postmortem of one run.

What it shows, all from the store (read-only) and the run's telemetry file: loss, throughput and memory
curves over wall-clock time (one colour per attempt, so redone steps are visible) with every incident
(red) and action (blue) marked; the timeline of states and attempts; every config version's diff; and a
goodput breakdown of the wall-clock time from the first launch to the end:

- productive: step time of the steps the run kept (the last computation of each step);
- redone after rollbacks / after restarts: step time of steps computed again by a later attempt that
  resumed at or before them (a rollback if a rollback action came between the two attempts);
- lost to restarts: from an attempt's last step to the next attempt's first (detection, teardown,
  relaunch, checkpoint load);
- other: the rest (the first start-up, checkpoint saves, evaluation, pauses).

The page is one file with inline SVG and a few lines of inline JS (hover values): no network, no CDN.
Telemetry is read twice, streaming (the second pass samples at most MAX_POINTS points per attempt and
MAX_TOTAL_POINTS in all), so a multi-day run's file is never held in memory. A file over 32 MiB is read in
evenly spaced windows of 32 MiB in all, the attempts' boundaries found exactly (telemetry/step_sample.py): the
page then says that its curves and goodput come from that sample (`--full-telemetry` reads it all).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ulyssesd.daemon.telemetry.step_sample import SampleConfig, Sampled, step_lines
from ulyssesd.remediation.records import finite_or_none

#: Points kept per attempt and series in the plots (steps are sampled evenly beyond this).
MAX_POINTS = 1500
#: ...and over all attempts together (a run of up to 8 attempts keeps 1,500 each), never under MIN_POINTS each.
MAX_TOTAL_POINTS, MIN_POINTS = 12_000, 20
#: Incidents and actions listed (and marked on the curves): the newest; the page stays a few MB at 10^5 of each.
MAX_ROWS = 2000
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
ROLLBACK_KINDS = ("rollback_skip",)
INCIDENT_COLOUR, ACTION_COLOUR = "#d62728", "#111111"  # marks: not in PALETTE, so never an attempt's colour


@dataclass
class _AttemptSteps:
    """What the first telemetry pass learns about one attempt's steps."""

    first_step: int | None = None
    first_time: float | None = None
    last_time: float | None = None
    count: int = 0


@dataclass
class Goodput:
    wall_s: float = 0.0
    productive_s: float = 0.0
    redone_rollback_s: float = 0.0
    redone_restart_s: float = 0.0
    restart_downtime_s: float = 0.0
    sampled: Sampled | None = None  # the telemetry was read in windows: the step-time sums are estimates

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.productive_s - self.redone_rollback_s - self.redone_restart_s
                   - self.restart_downtime_s)

    def rows(self) -> list[tuple[str, float]]:
        return [("productive", self.productive_s), ("redone after rollbacks", self.redone_rollback_s),
                ("redone after restarts", self.redone_restart_s), ("lost to restarts", self.restart_downtime_s),
                ("other (start-up, checkpoints, pauses)", self.other_s)]


@dataclass
class Series:
    """Sampled points of one attempt: (time, loss, tokens/s, memory GiB)."""

    attempt: int
    points: list[tuple[float, float | None, float | None, float | None]] = field(default_factory=list)


def _duration(rec: Any, prev_time: float | None) -> float:
    for d in (rec.step_time_max_s, rec.step_time_s):
        if d is not None and math.isfinite(d) and d >= 0:
            return d
    return max(0.0, rec.time - prev_time) if prev_time is not None and rec.time is not None else 0.0


def _ts(t: datetime | None) -> float | None:
    return t.timestamp() if t is not None else None


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def analyse_telemetry(path: Path | None, attempts: list[Any], actions: list[Any],
                      sample: SampleConfig = SampleConfig()) -> tuple[list[Series], Goodput]:
    """Two streaming passes over the telemetry file: the curves (sampled) and the goodput breakdown. A file
    over `sample.max_bytes` is read in windows (telemetry/step_sample.py): `good.sampled` says so."""
    good = Goodput()
    starts = _known(_ts(a.started_at) for a in attempts)
    ends = _known(_ts(a.ended_at) for a in attempts)
    if path is None or not path.is_file():
        if starts:
            good.wall_s = max(0.0, (max(ends) if ends else max(starts)) - min(starts))
        return [], good
    lines, good.sampled = step_lines(path, sample)
    per: dict[int, _AttemptSteps] = {}
    for line in lines:
        rec = line.rec
        a = per.setdefault(rec.attempt or 0, _AttemptSteps())
        t = rec.time or 0.0  # never None here: step_lines yields timed records only
        if a.first_step is None:
            a.first_step, a.first_time = rec.step, t
        a.last_time = t
        a.count += 1
    numbers = sorted(per)
    # A step of attempt n is redone if a later attempt started at or before it: its cutoff is the lowest
    # first step of the attempts after it, and the attempt that set that cutoff says why (rollback or not).
    cutoff: dict[int, tuple[int, int]] = {}
    lowest: tuple[int, int] | None = None
    for n in reversed(numbers):
        if lowest is not None:
            cutoff[n] = lowest
        first = per[n].first_step
        if first is not None and (lowest is None or first <= lowest[0]):
            lowest = (first, n)
    started = {a.number: _ts(a.started_at) for a in attempts}
    rollback_times = [_ts(x.applied_at) for x in actions
                      if str(getattr(x.kind, "value", x.kind)) in ROLLBACK_KINDS
                      or (x.parameters or {}).get("rollback_to_step") is not None]

    def by_rollback(n: int, later: int) -> bool:
        lo = started.get(n) or per[n].first_time or 0.0
        hi = started.get(later) or per[later].first_time or float("inf")
        return any(t is not None and lo <= t <= hi for t in rollback_times)

    # Per attempt, not per redone step: it depends on the attempt and its cutoff only.
    rolled_back = {n: n in cutoff and by_rollback(n, cutoff[n][1]) for n in numbers}
    series = {n: Series(n) for n in numbers}
    # MAX_POINTS per attempt, MAX_TOTAL_POINTS over all: 10^3 attempts would otherwise draw 4.5 million points.
    budget = max(MIN_POINTS, min(MAX_POINTS, MAX_TOTAL_POINTS // max(1, len(numbers))))
    stride = {n: max(1, math.ceil(per[n].count / budget)) for n in numbers}
    seen = dict.fromkeys(numbers, 0)
    prev_time: dict[int, float | None] = dict.fromkeys(numbers)
    for line in (lines if good.sampled is not None else step_lines(path, sample)[0]):
        rec = line.rec
        n = rec.attempt or 0
        if n not in per:  # appended between the passes
            continue
        t = rec.time or 0.0
        d = _duration(rec, prev_time[n] if line.follows else None) * line.weight
        prev_time[n] = t
        cut = cutoff.get(n)
        if cut is not None and rec.step >= cut[0]:
            if rolled_back[n]:
                good.redone_rollback_s += d
            else:
                good.redone_restart_s += d
        else:
            good.productive_s += d
        if seen[n] % stride[n] == 0 or per[n].last_time == t:
            mem = rec.mem_max_allocated_gib if rec.mem_max_allocated_gib is not None else rec.mem_allocated_gib
            series[n].points.append((t, finite_or_none(rec.loss), finite_or_none(rec.tokens_per_s), finite_or_none(mem)))
        seen[n] += 1
    for earlier, later in zip(numbers, numbers[1:], strict=False):
        lt, ft = per[earlier].last_time, per[later].first_time
        if lt is not None and ft is not None and ft > lt:
            good.restart_downtime_s += ft - lt
    first_times = _known(per[n].first_time for n in numbers)
    last_times = _known(per[n].last_time for n in numbers)
    begin = min(starts + first_times) if starts or first_times else 0.0
    end = max(ends + last_times) if ends or last_times else begin
    good.wall_s = max(0.0, end - begin)
    return [series[n] for n in numbers if series[n].points], good


# ------------------------------------------------------------------------------------------------ SVG
def _nice(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e3:
        return f"{v / 1e3:.3g}k"
    return f"{v:.3g}"


def _plot(plot_id: str, title: str, unit: str, series: list[Series], col: int, t0: float, t1: float,
          marks: list[tuple[float, str, str]], bands: list[tuple[float, int]]) -> str:
    """One inline SVG line chart over hours since t0; marks = (time, colour, label), bands = attempt starts."""
    w, h, left, right, top, bottom = 960, 260, 64, 16, 28, 36
    values = _known(finite_or_none(p[col]) for s in series for p in s.points)
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return left + (t - t0) / span * (w - left - right)

    def y(v: float) -> float:
        return top + (hi - v) / (hi - lo) * (h - top - bottom)

    out = [f'<svg class="plot" id="{plot_id}" viewBox="0 0 {w} {h}" width="100%" role="img" '
           f'aria-label="{html.escape(title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{left}" y="18" class="title">{html.escape(title)} ({html.escape(unit)})</text>',
           f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" class="frame"/>']
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" class="tick" text-anchor="end">{_nice(v)}</text>')
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>')
    scale, unit_t = (3600.0, "h") if span >= 3 * 3600 else (60.0, "min") if span >= 180 else (1.0, "s")
    for i in range(6):
        t = t0 + span * i / 5
        out.append(f'<text x="{x(t):.1f}" y="{h - 14}" class="tick" text-anchor="middle">'
                   f'{(t - t0) / scale:.3g} {unit_t}</text>')
    for t, number in bands:
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{h - bottom}" class="attempt"/>'
                   f'<text x="{x(t) + 3:.1f}" y="{top + 11}" class="tick">#{number}</text>')
    for s in series:
        line = [(x(p[0]), y(val)) for p in s.points if (val := finite_or_none(p[col])) is not None]
        if not line:
            continue
        colour = PALETTE[(s.attempt - 1) % len(PALETTE)]
        d = " ".join(f"{'M' if i == 0 else 'L'}{px:.1f},{py:.1f}" for i, (px, py) in enumerate(line))
        out.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="1.5" class="series" '
                   f'data-attempt="{s.attempt}"/>')
        if len(line) <= 3:  # a path of one point draws nothing: an attempt that ran a step or two shows as dots
            out.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in line)
    for t, colour, label in marks:
        if t0 <= t <= t1 + 1:
            out.append(f'<g class="mark"><line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{h - bottom}" '
                       f'stroke="{colour}" stroke-dasharray="3,3"/><circle cx="{x(t):.1f}" cy="{top + 4}" r="4" '
                       f'fill="{colour}"><title>{html.escape(label)}</title></circle></g>')
    out.append("</svg>")
    return "\n".join(out)


def _secs(s: float) -> str:
    return f"{s:,.0f} s" if s >= 100 else f"{s:.2f} s"


STATE_COLOURS = {"STARTING": "#aec7e8", "RUNNING": "#2ca02c", "REMEDIATING": "#ff7f0e", "RESTARTING": "#d62728",
                 "BACKOFF": "#ff9896", "PAUSED": "#c7c7c7", "STOPPING": "#9467bd", "COMPLETED": "#17becf",
                 "FAILED": "#000000", "STOPPED": "#7f7f7f"}


def _timeline(transitions: list[Any], t0: float, t1: float, marks: list[tuple[float, str, str]]) -> str:
    """The run's states as one bar over the same time axis as the curves; incidents and actions on it."""
    w, left, right = 960, 64, 16
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return left + (min(max(t, t0), t1) - t0) / span * (w - left - right)

    timed = [(t, _val(tr.to_state), tr) for tr in transitions if (t := _ts(tr.at)) is not None]
    out = [f'<svg class="plot" id="plot-timeline" viewBox="0 0 {w} 58" width="100%" '
           f'xmlns="http://www.w3.org/2000/svg"><text x="{left}" y="12" class="title">States</text>']
    for i, (t, state, tr) in enumerate(timed):
        end = timed[i + 1][0] if i + 1 < len(timed) else t1
        width = max(x(end) - x(t), 1.0)
        out.append(f'<rect x="{x(t):.1f}" y="18" width="{width:.1f}" height="20" '
                   f'fill="{STATE_COLOURS.get(state, "#bbbbbb")}"><title>{_e(state)} from {_time(tr.at)} '
                   f'(attempt {_e(tr.attempt)}): {_e(tr.reason)}</title></rect>')
    for t, colour, label in marks:
        out.append(f'<circle cx="{x(t):.1f}" cy="46" r="3.5" fill="{colour}"><title>{html.escape(label)}</title>'
                   f'</circle>')
    out.append("</svg>")
    seen = dict.fromkeys(state for _, state, _ in timed)
    out.append('<p class="legend">' + "".join(
        f'<span><span class="sw" style="background:{STATE_COLOURS.get(st, "#bbbbbb")}"></span>{_e(st)}</span>'
        for st in seen) + "</p>")
    return "".join(out)


def _goodput_bar(good: Goodput) -> str:
    colours = ("#2ca02c", "#d62728", "#ff7f0e", "#9467bd", "#bbbbbb")
    total = good.wall_s or 1.0
    x, parts, legend = 0.0, [], []
    for (label, secs), colour in zip(good.rows(), colours, strict=True):
        wd = secs / total * 960
        parts.append(f'<rect x="{x:.1f}" y="0" width="{wd:.1f}" height="28" fill="{colour}">'
                     f'<title>{html.escape(label)}: {secs:.0f} s</title></rect>')
        legend.append(f'<tr><td><span class="sw" style="background:{colour}"></span>{html.escape(label)}</td>'
                      f'<td>{_secs(secs)}</td><td>{secs / total * 100:.1f} %</td></tr>')
        x += wd
    return (f'<svg class="plot" id="plot-goodput" viewBox="0 0 960 28" width="100%" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
            f'<table class="goodput"><tr><th>where the wall-clock went</th><th>seconds</th><th>share</th></tr>'
            f'{"".join(legend)}<tr><td><b>wall clock, first launch to end</b></td><td><b>{_secs(good.wall_s)}</b>'
            f'</td><td></td></tr></table>')


# ---------------------------------------------------------------------------------------------- HTML
_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1000px;
color:#222} h1{font-size:22px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%;margin:6px 0} td,th{border-bottom:1px solid #eee;padding:3px 6px;
text-align:left;vertical-align:top} th{background:#f6f6f6} .plot{display:block;margin:8px 0 16px}
.title{font-weight:600;font-size:13px} .tick{font-size:11px;fill:#555} .grid{stroke:#eee} .frame{fill:none;
stroke:#ccc} .attempt{stroke:#999;stroke-dasharray:1,3} .sw{display:inline-block;width:10px;height:10px;
margin-right:6px} .mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.legend span{margin-right:14px} #hover{position:fixed;background:#222;color:#fff;padding:2px 6px;
font-size:12px;border-radius:3px;pointer-events:none;display:none}
"""

#: Hover values for the marks; also sets data-plots (the number of plots drawn) for tests and tools.
_JS = """
(function(){
  var tip=document.getElementById('hover');
  document.querySelectorAll('g.mark circle').forEach(function(c){
    c.addEventListener('mouseenter',function(e){var t=c.querySelector('title');
      tip.textContent=t?t.textContent:'';tip.style.display='block';
      tip.style.left=(e.clientX+10)+'px';tip.style.top=(e.clientY+10)+'px';});
    c.addEventListener('mouseleave',function(){tip.style.display='none';});
  });
  document.body.setAttribute('data-plots',String(document.querySelectorAll('svg.plot path.series').length>0?
    document.querySelectorAll('svg.plot').length:0));
})();
"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _val(v: Any) -> str:
    return _e(getattr(v, "value", v))


def _time(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t is not None else ""


def telemetry_path_of(run: Any) -> Path | None:
    """The run's telemetry file: the job's telemetry.jsonl, or the records the daemon parsed from its log."""
    if not run.run_dir:
        return None
    from ulyssesd.daemon.telemetry.log_source import STDOUT_TELEMETRY_NAME

    for name in ("telemetry.jsonl", STDOUT_TELEMETRY_NAME):
        p = Path(run.run_dir) / name
        if p.is_file():
            return p
    return None


def _last_loss(point: tuple[float, float | None, float | None, float | None] | None) -> str:
    """The summary's note on the newest telemetry point's loss (None there: NaN/Inf, or not reported)."""
    if point is None:
        return ""
    return f" (last loss {point[1]:.4g})" if point[1] is not None else " (last loss not finite or not reported)"


def render_report(store: Any, run_id: str, telemetry: Path | None = None,
                  sample: SampleConfig = SampleConfig()) -> str:
    """The postmortem page of `run_id` as one HTML string (see module doc)."""
    run = store.get_run(run_id)
    attempts = store.list_attempts(run_id)
    transitions = store.list_transitions(run_id)
    # The newest MAX_ROWS incidents and actions (marks and tables; a long run has 10^5), the totals counted.
    incidents = store.list_incidents(run_id=run_id, limit=MAX_ROWS)
    actions = store.list_actions(run_id, limit=MAX_ROWS)
    n_inc, n_act = store.count_incidents(run_id), store.count_actions(run_id)
    versions = store.list_config_versions(run_id)
    path = telemetry or telemetry_path_of(run)
    series, good = analyse_telemetry(path, attempts, store.list_actions(run_id, rollbacks=True), sample)
    sampled = _sampled_note(good.sampled)

    times = [p[0] for s in series for p in s.points]
    stamps = _known([_ts(a.started_at) for a in attempts] + [_ts(a.ended_at) for a in attempts])
    t0 = min(times + stamps) if times or stamps else 0.0
    t1 = max(times + stamps) if times or stamps else 1.0
    marks = [(t, INCIDENT_COLOUR, f"incident #{i.id} {_val(i.symptom)} at step {i.step}: {i.summary}")
             for i in incidents if (t := _ts(i.detected_at)) is not None]
    marks += [(t, ACTION_COLOUR, f"action #{a.id} {_val(a.kind)} ({_val(a.mode)})"
               + (f" for incident #{a.incident_id}" if a.incident_id else ""))
              for a in actions if (t := _ts(a.applied_at)) is not None]
    bands = [(t, a.number) for a in attempts if (t := _ts(a.started_at)) is not None]
    plots = [_plot("plot-loss", "Loss", "per step", series, 1, t0, t1, marks, bands),
             _plot("plot-throughput", "Throughput", "tokens/s", series, 2, t0, t1, marks, bands),
             _plot("plot-memory", "Peak allocated accelerator memory", "GiB", series, 3, t0, t1, marks, bands)]
    legend = "".join(f'<span><span class="sw" style="background:{PALETTE[(s.attempt - 1) % len(PALETTE)]}"></span>'
                     f"attempt {s.attempt}</span>" for s in series)
    legend += (f'<span><span class="sw" style="background:{INCIDENT_COLOUR}"></span>incident</span>'
               f'<span><span class="sw" style="background:{ACTION_COLOUR}"></span>action</span>')
    no_tele = "" if series else (f"<p><b>No step telemetry found</b> ({_e(path) or 'no run directory'}): "
                                 "the curves are empty.</p>")

    rows_att = "".join(
        f"<tr><td>{a.number}</td><td>{_time(a.started_at)}</td><td>{_time(a.ended_at)}</td>"
        f"<td>{_e(a.returncode)}{' sig ' + _e(a.signal) if a.signal else ''}</td><td>{_e(a.diagnosis)}</td>"
        f"<td>v{_e(a.config_version)}</td><td>{_e(a.resumed_from)}</td></tr>" for a in attempts)
    rows_tr = "".join(f"<tr><td>{_time(t.at)}</td><td>{_val(t.from_state)} → <b>{_val(t.to_state)}</b></td>"
                      f"<td>{_e(t.attempt)}</td><td>{_e(t.reason)}</td></tr>" for t in transitions)
    rows_inc = "".join(f"<tr><td>#{i.id}</td><td>{_time(i.detected_at)}</td><td>{_e(i.attempt)}</td><td>{i.step}</td>"
                       f"<td>{_val(i.symptom)}</td><td>{_val(i.severity)}</td><td>{_val(i.status)}</td>"
                       f"<td>{_e(i.summary)}</td></tr>" for i in incidents)
    rows_act = "".join(f"<tr><td>#{a.id}</td><td>{_time(a.applied_at)}</td><td>{_e(a.incident_id)}</td>"
                       f"<td>{_val(a.kind)}</td><td>{_val(a.mode)}</td><td>{_val(a.outcome)}</td>"
                       f"<td class='mono'>{_e(json.dumps(a.config_diff, default=str)) if a.config_diff else ''}</td></tr>"
                       for a in actions)
    rows_cfg = "".join(f"<tr><td>v{v.version}</td><td>{_time(v.created_at)}</td><td>{_e(v.parent_version)}</td>"
                       f"<td>{_e(v.reason)}</td><td class='mono'>{_diff_html(versions, v)}</td></tr>" for v in versions)
    # The newest point by time alone (a non-finite loss is None there, and tuples would compare it); of
    # points sharing a time (records read from a log together) the last written.
    last_step = max(reversed([p for s in series for p in s.points]), key=lambda p: p[0], default=None)
    summary = (f"<table><tr><th>run</th><td>{_e(run.id)}</td><th>state</th><td><b>{_val(run.state)}</b> — "
               f"{_e(run.state_reason)}</td></tr><tr><th>created</th><td>{_time(run.created_at)}</td><th>ended</th>"
               f"<td>{_time(run.ended_at)}</td></tr><tr><th>attempts</th><td>{len(attempts)}</td><th>incidents / "
               f"actions</th><td>{n_inc} / {n_act}</td></tr><tr><th>run directory</th>"
               f"<td class='mono' colspan='3'>{_e(run.run_dir)}</td></tr><tr><th>telemetry</th>"
               f"<td class='mono' colspan='3'>{_e(path)}"
               f"{_last_loss(last_step)}</td></tr>"
               f"<tr><th>checkpoint disk</th><td class='mono' colspan='3'>{_e(_checkpoint_disk(store, run))}</td>"
               f"</tr></table>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ulyssesd report: {_e(run.id)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>
<body><div id="hover"></div>
<h1>Postmortem of run {_e(run.id)}</h1>{summary}
<h2>Timeline</h2>{_timeline(transitions, t0, t1, marks)}
<h2>Curves</h2><p class="legend">{legend}</p>{no_tele}{sampled}
{''.join(plots)}
<h2>Goodput</h2>{sampled}{_goodput_bar(good)}
<h2>Attempts</h2><table><tr><th>#</th><th>started</th><th>ended</th><th>exit</th><th>diagnosis</th><th>config</th>
<th>resumed from</th></tr>{rows_att}</table>
<h2>States</h2><table><tr><th>at</th><th>transition</th><th>attempt</th><th>reason</th></tr>{rows_tr}</table>
<h2>Incidents</h2><table><tr><th>id</th><th>detected</th><th>attempt</th><th>step</th><th>symptom</th>
<th>severity</th><th>status</th><th>summary</th></tr>{rows_inc}</table>{_cut(len(incidents), n_inc, "incidents")}
<h2>Actions</h2><table><tr><th>id</th><th>applied</th><th>incident</th><th>kind</th><th>mode</th><th>outcome</th>
<th>config diff</th></tr>{rows_act}</table>{_cut(len(actions), n_act, "actions")}
<h2>Config versions</h2><table><tr><th>version</th><th>created</th><th>parent</th><th>reason</th><th>diff from parent</th>
</tr>{rows_cfg}</table>
<script>{_JS}</script></body></html>
"""


def _sampled_note(info: Sampled | None) -> str:
    """What a page drawn from a sample of its telemetry says about it (telemetry/step_sample.py)."""
    if info is None:
        return ""
    return (f"<p><b>Sampled telemetry:</b> the file is {info.file_bytes / 1e6:,.0f} MB; "
            f"{info.read_bytes / 1e6:,.0f} MB of it were read, in {info.windows} evenly spaced windows, and every "
            f"attempt's first and last step were found exactly ({info.probes} bisection probes). The curves show "
            "the sampled steps; "
            "the step-time parts of the goodput are estimates scaled from the sample (the wall time and the time "
            "lost between attempts are exact). <code>ulyssesctl report --full-telemetry</code> reads it all.</p>")


def _cut(shown: int, total: int, what: str) -> str:
    """The line under a table that lists only the newest rows."""
    return (f"<p><b>The newest {shown} of {total} {what}</b> are shown (here and as marks on the curves); "
            f"<code>ulyssesctl incidents --limit 0 --json</code> lists them all.</p>" if shown < total else "")


def _checkpoint_disk(store: Any, run: Any) -> str:
    """The checkpoint directory by category and the free space (daemon/host/disk_budget.py), as of now."""
    from ulyssesd.daemon.host.disk_budget import disk_status, render_disk

    try:
        return render_disk(disk_status(store, run))
    except Exception as exc:  # noqa: BLE001 - a report is written even when the directory cannot be read
        return f"unreadable: {type(exc).__name__}: {exc}"


def _diff_html(versions: list[Any], v: Any) -> str:
    parent = next((p for p in versions if p.version == v.parent_version), None)
    if parent is None:
        return "(initial)"
    from ulyssesd.daemon.store import flat_diff

    diff = flat_diff(parent.config, v.config)
    return "<br>".join(f"{_e(k)}: {_e(b)} → {_e(a)}" for k, (b, a) in diff.items()) or "(no change)"
