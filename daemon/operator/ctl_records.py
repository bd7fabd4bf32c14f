"""`ulyssesctl` read-only views of the store: `incidents`, `incident ID`, `config`, `db upgrade|current`,
`report`. They read SQLite directly, so they work while the daemon is down."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from ulyssesd.daemon.operator import ctl_status
from ulyssesd.daemon.operator.ctl_common import (
    CTX,
    EXIT_DB_DAMAGED,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    aware,
    clip,
    console,
    current_run,
    db_path,
    die,
    fmt_time,
    open_ro_store,
    or_empty,
    out,
    parse_since,
    store_exit_code,
)

#: How many incidents `ulyssesctl incidents` lists unless --limit says otherwise (the newest; a month-long run
#: with a noisy detector has 10^5, which no terminal reads and which took seconds to render).
DEFAULT_INCIDENTS_LIMIT = 1000


def incidents(json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
              kind: str = typer.Option(None, "--kind", help="symptom, e.g. hang, nan_loss, crash"),
              status_: str = typer.Option(None, "--status", help="open|remediating|resolved|escalated|failed"),
              since: str = typer.Option(None, "--since", help="30m, 12h, 2d or an ISO time"),
              all_runs: bool = typer.Option(False, "--all-runs", help="every run, not only the newest"),
              limit: int = typer.Option(DEFAULT_INCIDENTS_LIMIT, "--limit", min=0, metavar="N",
                                        help="list the newest N matching incidents (0: all of them)"),
              before: int = typer.Option(None, "--before", min=1, metavar="ID",
                                         help="only incidents older than incident ID (the next page: pass the "
                                              "oldest id listed)")) -> None:
    """List incidents (filter by kind, status, since; the newest --limit of them, paged with --before)."""
    store = open_ro_store(json_out)
    run_id = None if all_runs else current_run(store, json_out).id
    try:
        # With their actions, in the same query however many incidents (the table's action column needs them).
        filters: dict[str, Any] = dict(symptom=kind, status=status_, since=parse_since(since), before_id=before)
        rows = store.list_incidents(run_id, **filters, limit=limit or None, with_actions=True)
        total = store.count_incidents(run_id, **filters) if limit and len(rows) == limit else len(rows)
    except ValueError as exc:
        die(str(exc), EXIT_USAGE, json_out)
    left = total - len(rows)
    more = (f"{left} older incident(s) not listed: --before {rows[0].id} for the next page, --limit 0 for all"
            if left and rows else "")
    if json_out:
        out([r.to_dict() for r in rows], True)
        if more:  # the JSON stays a list of incidents; the cut is said where a script's log sees it
            typer.echo(f"ulyssesctl incidents: the newest {len(rows)} of {total} listed; {more}", err=True)
        return
    console.print(incidents_table(rows, resumes=next_resumes(store, rows)))
    if more:
        console.print(f"the newest {len(rows)} of {total} listed; {escape(more)}")


def next_resumes(store, rows) -> dict[tuple[str, int], str]:
    """(run, attempt) -> what the attempt after it resumed from ("the start" when nothing): the outcome of
    an incident's restart, rollback or fix, as the store recorded the launch (and the job's own report)."""
    out: dict[tuple[str, int], str] = {}
    for rid in sorted({r.run_id for r in rows}):
        attempts = {a.number: a for a in store.list_attempts(rid)}
        for n, a in attempts.items():
            if n - 1 >= 1:
                out[(rid, n - 1)] = a.resumed_from or "the start"
    return out


def incidents_table(rows, store=None, resumes: dict[tuple[str, int], str] | None = None) -> Table:
    """The incidents listing; each row's actions are the ones it carries (`list_incidents(with_actions=True)`).
    Rows listed without them and a `store`: their actions are read per run listed (not per incident).
    `resumes` (`next_resumes`): a restart-mode action shows what the next attempt resumed from."""
    if store is not None and not any(r.actions for r in rows):
        by_incident: dict[int | None, tuple] = {}
        for rid in sorted({r.run_id for r in rows}):
            for a in store.list_actions(run_id=rid):
                by_incident[a.incident_id] = (*by_incident.get(a.incident_id, ()), a)
        rows = [r.replace(actions=by_incident.get(r.id, ())) for r in rows]
    t = Table(title="incidents")
    for col, kw in (("id", {"no_wrap": True}), ("UTC", {"no_wrap": True}), ("att", {}), ("step", {}),
                    ("symptom", {"no_wrap": True}), ("status", {"no_wrap": True}), ("action", {"overflow": "fold"}),
                    ("config", {"no_wrap": True}), ("summary", {"overflow": "fold", "ratio": 1})):
        t.add_column(col, **kw)
    for r in rows:
        acts = r.actions
        act = ", ".join(f"{a.kind.value}" + (f" ({a.mode.value})" if a.mode.value not in ("none",) else "")
                        for a in acts) or "-"
        nxt = (resumes or {}).get((r.run_id, r.attempt)) if r.attempt is not None else None
        if nxt is not None and any(a.mode.value == "restart" for a in acts):
            act += f" -> resumed from {nxt}"
        cfg = ", ".join(f"v{a.from_config_version}->v{a.to_config_version}" for a in acts
                        if a.to_config_version and a.to_config_version != a.from_config_version) or "-"
        color = {"resolved": "green", "failed": "red", "escalated": "yellow"}.get(r.status.value, "cyan")
        t.add_row(str(r.id), r.detected_at.strftime("%H:%M:%S"), str(r.attempt), str(r.step), r.symptom.value,
                  f"[{color}]{r.status.value}[/{color}]", act, cfg, escape(clip(r.summary or "", 90)))
    return t


#: How much of a long evidence text (stacks, log tail) `incident ID` prints; --json has all of it.
EVIDENCE_SHOWN_CHARS = 4000
#: The header the daemon puts before each rank's stack dump in a hang's `stacks` evidence.
RANK_DUMP_HEADER = re.compile(r"^=== rank \d+ stack dump .*===$", re.MULTILINE)
#: Where faulthandler starts a thread's stack; `Current thread` is the one that got the signal (the trainer).
THREAD_START = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ ", re.MULTILINE)


def evidence_excerpt(text: str, limit: int, incident_id: int) -> str:
    """About `limit` characters of a long evidence text, for the terminal. A stack dump is cut per rank, under
    its `=== rank N ===` header: each rank's `Current thread` (the training thread, innermost frames first),
    its other threads dropped first; any other text keeps its last lines. Cuts are noted. The text's last
    `limit` characters, shown before, hid rank 0's dump (the rank the others wait for, in the demo's hang)
    and began mid-line."""
    if len(text) <= limit:
        return text
    starts = [m.start() for m in RANK_DUMP_HEADER.finditer(text)]
    starts = starts if starts and starts[0] == 0 else [0, *starts]
    sections = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    shown: dict[int, str] = {}
    budget = limit
    for i in sorted(range(len(sections)), key=lambda i: len(sections[i])):  # short ones whole, the rest share
        share = budget // (len(sections) - len(shown))
        shown[i] = sections[i] if len(sections[i]) <= share else _section_excerpt(sections[i], share)
        budget -= len(shown[i])
    return "".join(shown[i] for i in range(len(sections))) + f"\n[all of it: ulyssesctl incident {incident_id} --json]"


def _section_excerpt(section: str, share: int) -> str:
    header, body = ("", section)
    if RANK_DUMP_HEADER.match(section):
        first, _, body = section.partition("\n")
        header = first + "\n"
    threads = [m.start() for m in THREAD_START.finditer(body)]
    current = next((a for a in threads if body.startswith("Current thread", a)), None)
    if current is None:  # not a faulthandler dump: its last lines, from a line start
        tail = body[-max(0, share - len(header)):]
        tail = tail[tail.find("\n") + 1:] if "\n" in tail[:-1] else tail
        return f"{header}[… {len(body) - len(tail)} characters before this not shown]\n{tail}"
    end = next((b for b in threads if b > current), len(body))
    others = len(threads) - 1
    note = f"[{others} other thread(s) of this rank not shown]\n" if others else ""
    lines = body[current:end].splitlines(keepends=True)
    kept: list[str] = []
    room = share - len(header) - len(note)
    for line in lines:  # innermost frames first (faulthandler: most recent call first)
        if kept and sum(map(len, kept)) + len(line) > room:
            kept.append(f"  [… {len(lines) - len(kept)} more line(s)]\n")
            break
        kept.append(line)
    return header + note + "".join(kept)


def threshold_line(th: dict[str, Any]) -> str:
    """A finding's `thresholds` evidence in one line: each value, fitted (from n samples) or configured."""
    fit = th.get("fit")
    vals = [f"{k} {v.get('value')}" + (f" (fitted, was {v.get('configured')}, n={v.get('n')})" if v.get("fitted")
                                       else " (configured)")
            for k, v in th.items() if k != "fit" and isinstance(v, dict)]
    src = (f"fit at step {fit.get('at_step')} from {fit.get('healthy_steps')} healthy steps, target "
           f"{fit.get('false_alarm_rate_per_step')} false alarms/step, config v{fit.get('config_version')}"
           if isinstance(fit, dict) else str(fit))
    return f"{', '.join(vals)} — {src}"


def incident(incident_id: int = typer.Argument(..., metavar="ID", help="incident id"),
             json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """One incident. Evidence, actions with their config diffs, outcome."""
    from ulyssesd.daemon.store.errors import NotFoundError

    store = open_ro_store(json_out)
    try:
        inc = store.get_incident(incident_id)
    except NotFoundError:
        die(f"no incident {incident_id}", EXIT_NOT_FOUND, json_out)
    if json_out:
        out(inc.to_dict(), True)
        return
    # Store text is printed escaped: rich read `[rank1]` in a summary as a style and dropped it, and a path in
    # brackets (`[/ckpt/x]`) as a closing tag, which raised MarkupError: a traceback instead of the incident.
    console.print(f"[bold]incident {inc.id}[/bold]  {inc.symptom.value} ({inc.severity.value})  run {escape(inc.run_id)}  "
                  f"attempt {inc.attempt}  step {inc.step}")
    console.print(f"detected {fmt_time(inc.detected_at)}  status [bold]{inc.status.value}[/bold]"
                  f"{' — ' + escape(inc.status_reason) if inc.status_reason else ''}")
    if inc.acknowledged_by:
        console.print(f"acknowledged by {escape(inc.acknowledged_by)} at {fmt_time(inc.acknowledged_at)}")
    console.print(f"summary: {escape(inc.summary or '')}")
    ev = dict(inc.evidence or {})
    if isinstance(ev.get("thresholds"), dict):   # which thresholds judged it: fitted (from what) or configured
        console.print(f"thresholds: {escape(threshold_line(ev['thresholds']))}")
    long_keys = [k for k in ("stacks", "log_tail") if k in ev]
    console.print_json(json.dumps({k: v for k, v in ev.items() if k not in long_keys}, default=str))
    for k in long_keys:
        console.rule(k)
        console.print(evidence_excerpt(str(ev[k]), EVIDENCE_SHOWN_CHARS, inc.id), markup=False, highlight=False)
    t = Table(title="actions")
    for col in ("id", "kind", "mode", "config", "diff", "outcome", "parameters"):
        t.add_column(col, overflow="fold")
    for a in inc.actions:
        diff = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in (a.config_diff or {}).items()) or "-"
        cfg = f"v{a.from_config_version}->v{a.to_config_version}" if a.to_config_version != a.from_config_version else (
            f"v{a.from_config_version}" if a.from_config_version else "-")
        t.add_row(str(a.id), a.kind.value + (" (observe-only)" if a.observe_only else ""), a.mode.value, cfg,
                  escape(diff), a.outcome.value, escape(clip(json.dumps(a.parameters, default=str), 200)))
    console.print(t)


def config(version: int = typer.Option(None, "--version", help="config version (default: current)"),
           json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """A job config version. Its settings and its diff from its parent and from v1."""
    from ulyssesd.daemon.store import flat_diff
    from ulyssesd.daemon.store.errors import NotFoundError

    store = open_ro_store(json_out)
    run = current_run(store, json_out)
    try:
        cv = store.get_config_version(run.id, version)
    except NotFoundError as exc:
        die(str(exc), EXIT_NOT_FOUND, json_out)
    versions = {v.version: v for v in store.list_config_versions(run.id)}
    parent = versions.get(cv.parent_version) if cv.parent_version else None
    d = {"run_id": run.id, "version": cv.version, "parent_version": cv.parent_version, "reason": cv.reason,
         "created_at": cv.created_at.isoformat(),
         "diff_from_parent": flat_diff(parent.config, cv.config) if parent else {},
         "diff_from_v1": flat_diff(versions[1].config, cv.config) if 1 in versions else {},
         "config": cv.config, "versions": sorted(versions)}
    if json_out:
        out(d, True)
        return
    console.print(f"[bold]config v{cv.version}[/bold] of run {escape(run.id)} (versions {d['versions']}): "
                  f"{escape(cv.reason or '')}")
    for title, diff in (("diff from parent", d["diff_from_parent"]), ("diff from v1", d["diff_from_v1"])):
        t = Table(title=title)
        t.add_column("key")
        t.add_column("before")
        t.add_column("after")
        for k, (b, a) in diff.items():
            t.add_row(escape(k), escape(repr(b)), escape(repr(a)))
        console.print(t)
    console.print_json(json.dumps(cv.config))


def db_upgrade_cmd(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Create or upgrade the database schema to head."""
    from ulyssesd.daemon.store.cli import db_upgrade

    rev = db_upgrade(db_path())
    if json_out:
        out({"ok": True, "path": str(db_path()), "revision": rev}, True)
    else:
        console.print(f"{db_path()}: at revision {rev}")


def db_current_cmd(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """The database's schema revision vs this code's head."""
    from ulyssesd.daemon.store.cli import db_status
    from ulyssesd.daemon.store.errors import StoreError

    try:
        st = db_status(db_path())
    except StoreError as exc:
        die(str(exc), store_exit_code(exc) or EXIT_DB_DAMAGED, json_out)
    if json_out:
        out(st, True)
    else:
        console.print(f"{st['path']}: current {st['current']}, head {st['head']}"
                      f"{'' if st['up_to_date'] else ' — run `ulyssesctl db upgrade`'}")


def report(run_id: str = typer.Argument(None, metavar="RUN",
                                        help="run id (default: the --run option, else the latest run)"),
           out_path: Path = typer.Option(None, "--out", "-o", help="HTML file to write (default: report-RUN.html)"),
           telemetry: Path = typer.Option(None, "--telemetry",
                                          help="telemetry file (default: the run directory's)"),
           full_telemetry: bool = typer.Option(False, "--full-telemetry",
                                               help="read all of a telemetry file over 32 MiB (default: evenly "
                                                    "spaced windows of it, said on the page)")) -> None:
    """Write an HTML postmortem of a run. Curves with incidents and actions, timeline, goodput; self-contained."""
    from ulyssesd.daemon.operator.report import render_report  # the page builder (it never imports ctl)
    from ulyssesd.daemon.telemetry.step_sample import SampleConfig

    store = open_ro_store(False)
    try:
        if run_id:
            CTX.run = run_id
        run = current_run(store, False)
        if telemetry is not None and not telemetry.is_file():
            die(f"--telemetry {telemetry}: no such file", EXIT_USAGE, False)
        page = render_report(store, run.id, telemetry,
                             SampleConfig(max_bytes=1 << 62) if full_telemetry else SampleConfig())
    finally:
        store.close()
    target = out_path or Path(f"report-{run.id}.html")
    target.write_text(page, encoding="utf-8")
    print(target.resolve())


# ------------------------------------------------------------------------------------------------ runs
def runs_data(store) -> list[dict[str, Any]]:
    """One summary per run in the store, newest first: id, state, step/total, started, last change, incidents."""
    rows = []
    for run in store.list_runs():
        versions = store.list_config_versions(run.id)
        cur_v = next((v for v in versions if v.version == run.config_version), versions[-1] if versions else None)
        recent = ctl_status.recent_steps_from_telemetry(run.run_dir, limit=1, spec=run.spec)
        total, _ = ctl_status.total_steps_of(run.spec, cur_v.config if cur_v else None, recent)
        cursor = store.get_telemetry_cursor(run.id)
        step = recent[-1].get("step") if recent else (cursor.last_step if cursor else None)
        n_open = store.count_incidents(run.id, status="open") + store.count_incidents(run.id, status="remediating")
        rows.append({"run_id": run.id, "state": run.state.value, "step": step,
                     "total_steps": total,
                     "attempts": len(store.list_attempts(run.id)),
                     "started": aware(run.created_at).isoformat(), "last_change": aware(run.updated_at).isoformat(),
                     "ended": aware(run.ended_at).isoformat() if run.ended_at else None,
                     "incidents": store.count_incidents(run.id),  # counted in SQL: a long run has 10^5
                     "open_incidents": n_open,
                     "run_dir": run.run_dir})
    return rows


def runs_table(rows: list[dict[str, Any]]) -> Table:
    from rich.markup import escape

    t = Table(title="runs")
    for col in ("run", "state", "step / total", "attempts", "started (UTC)", "last change (UTC)", "incidents"):
        t.add_column(col, no_wrap=col != "run")
    for r in rows:
        color = {"COMPLETED": "green", "FAILED": "red", "RUNNING": "green", "PAUSED": "yellow"}.get(r["state"], "cyan")
        incs = str(r["incidents"]) + (f" ({r['open_incidents']} open)" if r["open_incidents"] else "")
        t.add_row(escape(r["run_id"]), f"[{color}]{r['state']}[/{color}]",
                  f"{or_empty(r['step'])} / {ctl_status.total_cell(r)}", str(r["attempts"]),
                  fmt_time(datetime.fromisoformat(r["started"])), fmt_time(datetime.fromisoformat(r["last_change"])),
                  incs)
    return t


def runs(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Every run, newest first. State, step/total, attempts, started, last change, incidents."""
    store = open_ro_store(json_out)
    try:
        rows = runs_data(store)
    finally:
        store.close()
    if json_out:
        out(rows, True)
    elif not rows:
        console.print("no runs yet")
    else:
        console.print(runs_table(rows))


def register_records(app: typer.Typer, db_app: typer.Typer) -> None:
    """Add the read-only store views to ulyssesctl (and `db` to its sub-app)."""
    app.command("runs")(runs)
    app.command("incidents")(incidents)
    app.command("incident")(incident)
    app.command("config")(config)
    db_app.command("upgrade")(db_upgrade_cmd)
    db_app.command("current")(db_current_cmd)
    app.command("report")(report)
