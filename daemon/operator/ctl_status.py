"""`ulyssesctl status [--watch]` and `ulyssesctl runs`: where a run is, read from the store and the run
directory's telemetry (so both work with the daemon down), plus the live daemon's view when it answers.

- progress: step/total with a bar, elapsed, ETA from the recent step rate of the newest attempt;
- last-step age, flagged once it passes the run's hang timeout (the hang detector's own rule, fed the same
  recent step records, with the run's `[detectors]` settings);
- tokens/s and MFU only while a job trains (RUNNING or REMEDIATING, and the newest step record is the current
  attempt's): a paused, restarting, starting, stopped or finished run has no throughput, so the last value
  would be a stale number that looks live (EMPTY instead);
- restarts (relaunches by the daemon: crashes, hangs, remediations) apart from operator relaunches
  (`pause`+`resume`, `restart`), which are not failures and not in the restart budget.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from ulyssesd.daemon.clock import SYSTEM, utc_now
from ulyssesd.daemon.operator.ctl_common import (
    DAEMON_NOT_RESPONDING,
    EMPTY,
    EXIT_NOT_RESPONDING,
    EXIT_OK,
    EXIT_RUN_FAILED,
    aware,
    console,
    current_run,
    daemon_info,
    daemon_pid_alive,
    fmt_duration,
    fmt_loss,
    json_text,
    open_ro_store,
    or_empty,
    out,
    reader_gone,
    socket_path,
)
from ulyssesd.daemon.telemetry.tail import recent_steps_from_telemetry

#: How many of the newest step records the ETA's step rate and the hang timeout are measured over (same
#: attempt only for the rate: a restart's resume time is not training speed).
RATE_WINDOW_STEPS = 20
#: Open incidents `status` lists one by one (the newest; the count is always the exact total).
OPEN_INCIDENTS_LISTED = 50
#: States with no ETA: the run waits for an operator (PAUSED) or is on its way there or to its end (STOPPING).
NO_ETA_STATES = frozenset({"PAUSED", "STOPPING"})
#: States in which a job trains: the only ones with a current tokens/s and MFU, and in which a silent job is a
#: hang candidate (elsewhere the last-step age is expected to grow, and the last throughput is history).
TRAINING_STATES = frozenset({"RUNNING", "REMEDIATING"})
#: Width of the progress bar, in characters.
BAR_WIDTH = 24


def progress_fields(recent: list[dict[str, Any]], total_steps: int | None, created_at: datetime,
                    ended_at: datetime | None, now: datetime) -> dict[str, Any]:
    """Progress of a run: fraction done, elapsed wall time, step rate over the newest records of the newest
    attempt, ETA at that rate (none once the run ended or when the rate is unknown), last-step age."""
    last = recent[-1] if recent else {}
    step = last.get("step") if isinstance(last.get("step"), int) else None
    progress = step / total_steps if step is not None and total_steps else None
    rate = None
    same_attempt = [r for r in recent if r.get("attempt") == last.get("attempt")
                    and isinstance(r.get("time"), int | float) and isinstance(r.get("step"), int)]
    if len(same_attempt) >= 2:
        dt = same_attempt[-1]["time"] - same_attempt[0]["time"]
        ds = same_attempt[-1]["step"] - same_attempt[0]["step"]
        rate = ds / dt if dt > 0 and ds > 0 else None
    eta = None
    if ended_at is None and rate and step is not None and total_steps:
        eta = max(0, total_steps - step) / rate
    last_time = last.get("time")
    age = max(0.0, now.timestamp() - last_time) if isinstance(last_time, int | float) else None
    return {"total_steps": total_steps, "progress": progress,
            "elapsed_s": max(0.0, ((ended_at or now) - created_at).total_seconds()),
            "step_rate_per_s": rate, "eta_s": eta, "last_step_age_s": age}


def total_steps_of(spec: dict[str, Any] | None, config: dict[str, Any] | None,
                   recent: list[dict[str, Any]]) -> tuple[int | None, str | None]:
    """A run's length in steps and where it comes from. The built-in job: its config's `train.steps`. A
    command job's length is its program's business: the newest step record's `total_steps` (the client's
    Reporter), else the spec's `[job] total_steps`, else unknown (None: never `[train] steps`, which that
    job does not read)."""
    def positive(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    job = (spec or {}).get("job") or {}
    if not isinstance(job, dict) or job.get("kind") != "command":
        total = positive(((config or {}).get("train") or {}).get("steps"))
        return total, "train.steps" if total else None
    reported = positive(recent[-1].get("total_steps")) if recent else None
    if reported is not None:
        return reported, "job telemetry"
    declared = positive(job.get("total_steps"))
    return (declared, "job.total_steps") if declared else (None, None)


def hang_timeout_s(recent: list[dict[str, Any]], detectors: dict[str, Any] | None) -> float | None:
    """The hang timeout the daemon's detector would apply after these step records: the detector itself,
    fed the records, with the run's `[detectors]` table (defaults where absent). None if unreadable."""
    from ulyssesd.remediation.config import DetectorsConfig
    from ulyssesd.remediation.detectors.hang import HangDetector
    from ulyssesd.remediation.records import RecordError, parse_record

    try:
        det = HangDetector(DetectorsConfig.model_validate(detectors or {}))
    except ValueError:  # a spec the daemon accepted is valid; an older schema's keys must not break status
        return None
    for d in recent:
        try:
            det.observe(parse_record(d), 0.0)
        except RecordError:
            continue
    return det.timeout()[0] if recent else None


#: Steps over which `status` shows each data source's loss and its trend (older half vs newer half).
PER_SOURCE_STEPS = 200


def per_source_loss(recent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from ulyssesd.remediation.learned.loss_view import per_source

    return per_source(recent)


def calibration_of(run_dir: str | None) -> dict[str, Any] | None:
    """The daemon's fit of the detector thresholds ({run_dir}/calibration.json), None before one."""
    try:
        return json.loads((Path(run_dir) / "calibration.json").read_text()) if run_dir else None
    except (OSError, ValueError):
        return None


def thresholds_text(cal: dict[str, Any]) -> str:
    """Which detector thresholds are fitted and from what: sample size, fitted value, the rate targeted."""
    ev = cal.get("evidence") or {}
    parts = []
    for k, (a, b) in (cal.get("changed") or {}).items():
        n = (ev.get("slow_step_period" if k.startswith("slow_step_period") else k) or {}).get("n")
        parts.append(f"{k} {a} -> {b}" + (f" (n={n})" if n is not None else ""))
    version = f"config v{cal['config_version']}: " if cal.get("config_version") is not None else ""
    not_fitted = cal.get("not_fitted") or {}
    return (f"{version}fitted at step {cal.get('at_step')} from {cal.get('steps')} healthy steps (target "
            f"{cal.get('false_alarm_rate_per_step'):g} false alarms/step): {', '.join(parts) or 'no change'}"
            + (f"; not fitted: {', '.join(f'{k} ({why})' for k, why in not_fitted.items())}" if not_fitted else ""))


def status_data(store, run) -> dict[str, Any]:
    from ulyssesd.daemon.store import flat_diff

    last_attempt = store.latest_attempt(run.id)  # one row: a long run has thousands of attempts
    cursor = store.get_telemetry_cursor(run.id)
    latest = store.latest_checkpoint(run.id)
    good = store.latest_checkpoint(run.id, known_good=True)
    versions = store.list_config_versions(run.id)
    cur_v = next((v for v in versions if v.version == run.config_version), versions[-1] if versions else None)
    # Fitted thresholds show as detectors.X; the fit's evidence is the thresholds row, not a config diff.
    diff = flat_diff({"detectors": {}, **versions[0].config}, {"detectors": {}, **{
        k: v for k, v in cur_v.config.items() if k != "calibration"}}) if versions and cur_v else {}
    recent = recent_steps_from_telemetry(run.run_dir, spec=run.spec)
    step = recent[-1] if recent else {}
    total, total_source = total_steps_of(run.spec, cur_v.config if cur_v else None, recent)
    # Counted in SQL, listed newest first up to OPEN_INCIDENTS_LISTED: a noisy month can leave thousands open.
    n_open = store.count_incidents(run.id, status="open") + store.count_incidents(run.id, status="remediating")
    open_inc = sorted(store.list_incidents(run.id, status="open", limit=OPEN_INCIDENTS_LISTED, newest_first=True)
                      + store.list_incidents(run.id, status="remediating", limit=OPEN_INCIDENTS_LISTED,
                                             newest_first=True), key=lambda i: i.id)[-OPEN_INCIDENTS_LISTED:]
    relaunches = store.relaunch_counts(run.id)  # the store owns the rule (pause/resume, restart: not restarts)
    daemon, live = _live_daemon(run.id)
    state = run.state.value
    attempt = last_attempt.number if last_attempt else None
    training = state in TRAINING_STATES and step.get("attempt") in (None, attempt)  # not the previous attempt's
    progress = progress_fields(recent, total, aware(run.created_at),
                               aware(run.ended_at) if run.ended_at else None, utc_now())
    if state in NO_ETA_STATES:
        progress["eta_s"] = None
    hang_s = hang_timeout_s(recent, (run.spec or {}).get("detectors"))
    age = progress["last_step_age_s"]
    return {
        "run_id": run.id, "state": state, "state_reason": run.state_reason,
        "daemon": daemon, "daemon_pid": daemon_info().get("pid") if daemon != "not running" else None,
        "attempt": attempt,
        # What the newest attempt was given to resume from (or reported loading); None: from the start.
        "resumed_from": last_attempt.resumed_from if last_attempt else None,
        "restarts": relaunches.restarts, "operator_relaunches": relaunches.operator_relaunches,
        "step": step.get("step", cursor.last_step if cursor else None),
        "loss": step.get("loss"),
        "tokens_per_s": step.get("tokens_per_s") if training else None,
        "mfu": step.get("mfu") if training else None,
        "mem_max_allocated_gib": step.get("mem_max_allocated_gib"),
        "latest_checkpoint": latest.tag if latest else None,
        "known_good_checkpoint": good.tag if good else None,
        "checkpoint_disk": _checkpoint_disk(store, run),
        "config_version": run.config_version, "config_diff_from_v1": diff,
        "open_incidents": n_open,
        # The newest OPEN_INCIDENTS_LISTED of them, oldest first (`ulyssesctl incidents --status open`: all).
        "open_incident_list": [{"id": i.id, "symptom": i.symptom.value, "status": i.status.value, "step": i.step,
                                "summary": i.summary} for i in open_inc],
        "run_dir": run.run_dir,
        **job_processes(last_attempt, live, (run.spec or {}).get("launcher") or {}),
        "created_at": run.created_at.isoformat(), "ended_at": run.ended_at.isoformat() if run.ended_at else None,
        **progress,
        "total_steps_source": total_source,
        "hang_timeout_s": hang_s,
        "loss_by_source": per_source_loss(recent_steps_from_telemetry(run.run_dir, limit=PER_SOURCE_STEPS)),
        "calibration": calibration_of(run.run_dir),
        "last_step_overdue": bool(state in TRAINING_STATES and age is not None and hang_s is not None
                                  and age > hang_s),
        "telemetry_health": _telemetry_health(run, state, attempt),
        # The daemon's own store (safety/store_health.py): not writable means the stored state may lag the
        # daemon's (`daemon_state`, from memory).
        "store": (live or {}).get("store"),
        "daemon_state": (live or {}).get("state"),
    }


def _telemetry_health(run, state: str, attempt: int | None) -> dict[str, Any] | None:
    """What the daemon's reading of a log / framework files found for the current attempt (derived sources)."""
    from ulyssesd.daemon.telemetry.log_source import read_health, stdout_source

    if not stdout_source(run.spec or {}):
        return None
    health = read_health(run.run_dir)
    if health is None or health.get("attempt") != attempt:
        return None
    # STARTING too: a stdout job whose lines are never understood stays STARTING (no first step) all its run.
    health["silent"] = bool(health.get("silent")) and (state in TRAINING_STATES or state == "STARTING")
    return health


def _checkpoint_disk(store, run) -> dict[str, Any] | None:
    from ulyssesd.daemon.host.disk_budget import disk_status

    try:
        return disk_status(store, run)
    except Exception as exc:  # noqa: BLE001 - status must answer; the directory view is one row of it
        return {"dir": None, "error": f"{type(exc).__name__}: {exc}"}


def job_processes(attempt, live: dict[str, Any] | None, launcher: dict[str, Any]) -> dict[str, Any]:
    """The live attempt's processes, for py-spy, kill and nvidia-smi's pid column: its launcher's pid (the
    wrapper, leader of the attempt's process group), that group, the host, and the training ranks' pids
    (torchrun starts each rank in its own session, so the group alone does not reach them). The ranks come
    from the daemon's rank watch when it answers with some, else from a scan of this host's process table
    (the daemon down: the attempt's recorded pid and start time tell its processes from a recycled pid).
    All None/empty once the attempt ended."""
    none: dict[str, Any] = {"launcher_pid": None, "pgid": None, "job_host": None, "rank_pids": [],
                            "rank_pids_source": None}
    if attempt is None or attempt.ended_at is not None or not attempt.pid:
        return none
    found = {"launcher_pid": attempt.pid, "pgid": attempt.pgid or attempt.pid, "job_host": attempt.host}
    if live and live.get("attempt") == attempt.number and live.get("rank_pids"):
        return {**found, "rank_pids": [int(p) for p in live["rank_pids"]], "rank_pids_source": "daemon"}
    import socket

    if attempt.host and attempt.host != socket.gethostname():
        return {**found, "rank_pids": [], "rank_pids_source": None}  # another host's pids: not ours to scan
    from ulyssesd.daemon.host.process import JobHandle, RealOS

    job = JobHandle(attempt.pid, attempt.proc_start_time or 0.0)
    try:
        if not attempt.proc_start_time or not RealOS().is_alive(job):  # recorded open, but its launcher is gone
            return {**found, "rank_pids": [], "rank_pids_source": "process table (launcher gone)"}
        ranks = RealOS().rank_pids(job, str(launcher.get("module") or "ulyssesd.training"))
    except Exception:  # noqa: BLE001 - status must answer; the pids are a convenience
        return {**found, "rank_pids": [], "rank_pids_source": "unavailable"}
    return {**found, "rank_pids": ranks, "rank_pids_source": "process table"}


def _processes_cell(d: dict[str, Any]) -> str:
    if d.get("pgid") is None:
        return f"{EMPTY} (no live attempt)"
    ranks = ", ".join(map(str, d["rank_pids"])) or EMPTY
    where = {"daemon": "the daemon's rank watch", "process table": "this host's process table",
             "process table (launcher gone)": "this host's process table: the launcher is gone",
             "unavailable": "the process table could not be read"}.get(
        d.get("rank_pids_source") or "", f"not scanned: on host {d.get('job_host')}")
    return f"pgid {d['pgid']} (launcher pid {d['launcher_pid']}); ranks {ranks} ({where})"


def _live_daemon(run_id: str) -> tuple[str, dict | None]:
    """('running', its status) when this run's daemon answers; 'not responding' when its pid lives but it
    does not answer; else 'not running'."""
    if daemon_info().get("run_id") != run_id:
        return "not running", None
    from ulyssesd.daemon.control.client import send_request
    from ulyssesd.daemon.control.protocol import ControlTimeout

    try:
        live = send_request(socket_path(), {"cmd": "status"}, timeout_s=2.0).get("status")
    except ControlTimeout:  # accepted (the kernel queues it) but unanswered: alive but stopped or busy?
        return (DAEMON_NOT_RESPONDING if daemon_pid_alive() else "not running"), None
    except Exception:  # noqa: BLE001 - status must work without the daemon
        return "not running", None
    return ("running", live) if live else ("not running", None)


def progress_bar(progress: float | None, width: int = BAR_WIDTH) -> str:
    """`████████░░░░░░░░` for a fraction in [0, 1]; '' when unknown."""
    if progress is None:
        return ""
    filled = round(min(1.0, max(0.0, progress)) * width)
    return "█" * filled + "░" * (width - filled)


def _last_step_cell(d: dict[str, Any]) -> str:
    age = d.get("last_step_age_s")
    if age is None:
        return EMPTY
    text = f"{fmt_duration(age)} ago"
    if d.get("last_step_overdue"):
        return f"[bold red]{text} (past the hang timeout {fmt_duration(d['hang_timeout_s'])})[/bold red]"
    return text


def total_cell(d: dict[str, Any]) -> str:
    """The total steps, or "unknown": a command job whose program reports none and whose spec sets none."""
    total = d.get("total_steps")
    return str(total) if isinstance(total, int) else "unknown"


def render_status(d: dict[str, Any]) -> Table:
    from rich.markup import escape

    from ulyssesd.daemon.telemetry.log_source import health_text

    t = Table(title=f"run {escape(d['run_id'])}", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    color = {"COMPLETED": "green", "FAILED": "red", "RUNNING": "green", "PAUSED": "yellow"}.get(d["state"], "cyan")
    reason = f" ({escape(d['state_reason'])})" if d.get("state_reason") else ""
    t.add_row("state", f"[{color}]{d['state']}[/{color}]{reason}")
    t.add_row("daemon", d["daemon"] + (f" (pid {d['daemon_pid']})" if d.get("daemon_pid") else ""))
    store = d.get("store") or {}
    if store.get("writable") is False:
        t.add_row("store", f"[red]NOT WRITABLE[/red] for {store.get('since_s')} s ({escape(str(store.get('error')))}); "
                           f"retry in {store.get('next_retry_s')} s; the daemon's state: {d.get('daemon_state')}; "
                           f"{escape(str(store.get('note') or ''))}")
    t.add_row("attempt", or_empty(d["attempt"]) + ("" if d.get("attempt") is None else
                                                    f" (resumed from {escape(d['resumed_from'])})"
                                                    if d.get("resumed_from") else " (from the start)"))
    t.add_row("restarts / operator relaunches", f"{d['restarts']} / {d['operator_relaunches']}")
    pct = f" ({d['progress']:.1%})" if isinstance(d.get("progress"), float) else ""
    # Unknown is loud: the setting that gives a progress bar and an ETA (rich markup: "\\[" is a literal "[").
    fix = " (set \\[job] total_steps for progress and ETA)" if total_cell(d) == "unknown" else ""
    t.add_row("step / total", f"{or_empty(d['step'])} / {total_cell(d)}{pct}{fix}")
    if d.get("progress") is not None:
        t.add_row("progress", progress_bar(d["progress"]))
    t.add_row("elapsed", fmt_duration(d.get("elapsed_s")))
    rate = d.get("step_rate_per_s")
    t.add_row("ETA", fmt_duration(d.get("eta_s")) + (f" (at {rate:.2f} steps/s)" if rate and d.get("eta_s") is not None
                                                      else ""))
    t.add_row("last step", _last_step_cell(d))
    if d.get("telemetry_health"):  # derived telemetry: what reading the log found (SILENT: the fix)
        h = d["telemetry_health"]
        t.add_row("telemetry", ("[red]SILENT[/red] " if h.get("silent") else "") + escape(health_text(h)))
    loss = d["loss"]
    t.add_row("loss", fmt_loss(loss))
    for src in d.get("loss_by_source") or []:
        before = f" (was {src['before']:.4g})" if src.get("before") is not None else ""
        t.add_row("", f"{escape(src['source'])}: {src['loss']:.4g}{before}, {src['trend']} over its last {src['n']} steps")
    cal = d.get("calibration")
    if cal:
        t.add_row("thresholds", escape(thresholds_text(cal)))
    tps = d["tokens_per_s"]
    t.add_row("tokens/s", f"{tps:,.0f}" if isinstance(tps, int | float) else EMPTY)
    t.add_row("MFU", f"{d['mfu']:.1%}" if isinstance(d.get("mfu"), int | float) else EMPTY)
    mem = d["mem_max_allocated_gib"]
    t.add_row("max memory (GiB)", f"{mem:.2f}" if isinstance(mem, int | float) else EMPTY)
    t.add_row("checkpoint (latest / known good)",
              f"{or_empty(d['latest_checkpoint'])} / {or_empty(d['known_good_checkpoint'])}")
    if d.get("checkpoint_disk") is not None:
        from ulyssesd.daemon.host.disk_budget import render_disk

        t.add_row("checkpoint disk", escape(render_disk(d["checkpoint_disk"])))
    diff = d["config_diff_from_v1"]
    t.add_row("config", f"v{d['config_version']}" + ("" if not diff else "; vs v1: " + escape(", ".join(
        f"{k}: {b!r} -> {a!r}" for k, (b, a) in diff.items()))))
    listed = len(d["open_incident_list"])
    t.add_row("open incidents", str(d["open_incidents"]) + (f" (the newest {listed} below; `ulyssesctl incidents "
                                                              f"--status open` lists them all)"
                                                              if listed < d["open_incidents"] else ""))
    for inc in d["open_incident_list"]:
        t.add_row("", f"[yellow]#{inc['id']} {inc['symptom']}[/yellow] ({inc['status']}, step {inc['step']}) "
                      f"{escape((inc['summary'] or '')[:100])}")
    t.add_row("job processes", escape(_processes_cell(d)))
    t.add_row("run dir", escape(or_empty(d["run_dir"])))
    return t


def status(json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
           watch: bool = typer.Option(False, "--watch", help="refresh until the run ends (COMPLETED, FAILED, "
                                      "STOPPED) or Ctrl-C: a live table on a terminal, one line per refresh in "
                                      "a pipe, JSON lines with --json"),
           interval: float = typer.Option(2.0, "--interval", min=0.05, max=86400.0, metavar="SECONDS", help="--watch refresh period")) -> None:
    """Where the run is. State, progress, ETA, last step, loss, tokens/s, MFU, memory, checkpoints, restarts,
    open incidents."""
    store = open_ro_store(json_out)
    if watch and (json_out or not sys.stdout.isatty()):
        raise typer.Exit(_watch_lines(store, json_out, interval))
    if watch:
        raise typer.Exit(_watch_live(store, interval))
    d = status_data(store, current_run(store, json_out))
    if json_out:
        out(d, True)
    else:
        console.print(render_status(d))
    if d["daemon"] == DAEMON_NOT_RESPONDING:
        raise typer.Exit(EXIT_NOT_RESPONDING)
    raise typer.Exit(final_exit_code(d))


def final_exit_code(d: dict[str, Any]) -> int:
    """`status`'s exit code for a run in this state: EXIT_RUN_FAILED for a FAILED run, else EXIT_OK."""
    return EXIT_RUN_FAILED if d["state"] == "FAILED" else EXIT_OK


def run_ended(d: dict[str, Any]) -> bool:
    """Whether the run is in a state it never leaves (COMPLETED, FAILED, STOPPED): a watch of it is over."""
    from ulyssesd.daemon.store.enums import TERMINAL_RUN_STATES

    return d["state"] in {s.value for s in TERMINAL_RUN_STATES}


def _watch_live(store, interval: float) -> int:
    """`status --watch` on a terminal: a live table, refreshed until the run ends (the final table stays on
    screen; exit code as `status`'s) or Ctrl-C (exit 0)."""
    from rich.live import Live

    with Live(console=console, refresh_per_second=4) as live:
        try:
            while True:
                d = status_data(store, current_run(store, False))
                live.update(render_status(d), refresh=True)
                if run_ended(d):
                    return final_exit_code(d)
                SYSTEM.sleep(interval)
        except KeyboardInterrupt:
            pass
    return EXIT_OK


def status_line(d: dict[str, Any]) -> str:
    """One line of `status --watch` in a pipe: the fields an operator tails for, EMPTY where unknown."""
    pct = f" ({d['progress']:.1%})" if isinstance(d.get("progress"), float) else ""
    loss = d.get("loss")
    tps = d.get("tokens_per_s")
    age = d.get("last_step_age_s")
    overdue = " OVERDUE" if d.get("last_step_overdue") else ""
    return (f"{utc_now().strftime('%Y-%m-%dT%H:%M:%SZ')} {d['run_id']} {d['state']} "
            f"step {or_empty(d['step'])}/{total_cell(d)}{pct} "
            f"loss {fmt_loss(loss)} "
            f"tok/s {f'{tps:,.0f}' if isinstance(tps, int | float) else EMPTY} "
            f"elapsed {fmt_duration(d.get('elapsed_s'))} ETA {fmt_duration(d.get('eta_s'))} "
            f"last-step {EMPTY if age is None else fmt_duration(age) + ' ago'}{overdue} "
            f"open-incidents {d['open_incidents']} daemon {d['daemon']}")


def _watch_lines(store, json_out: bool, interval: float) -> int:
    """`status --watch` when stdout is a pipe or --json: one line (or one JSON object) per refresh, flushed,
    so `| head -3` or a log collector sees each at once. The run's end prints its final line and ends the
    watch (exit code as `status`'s); a reader that goes away or Ctrl-C ends it quietly (exit 0)."""
    try:
        while True:
            d = status_data(store, current_run(store, json_out))
            sys.stdout.write((json_text(d) if json_out else status_line(d)) + "\n")
            sys.stdout.flush()
            if run_ended(d):
                return final_exit_code(d)
            SYSTEM.sleep(interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # the reader closed the pipe (`| head -3`)
        reader_gone()
    return EXIT_OK


def register_status(app: typer.Typer) -> None:
    """Add `status` to ulyssesctl (`runs` is in ctl_records)."""
    app.command("status")(status)
