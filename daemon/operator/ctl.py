"""`ulyssesctl`: the operator CLI.

Read-only commands (status, incidents, incident, config, db current) read the SQLite store directly, so
they work while the daemon is down (Monday morning after a FAILED run). Mutating commands (pause, resume,
stop, restart) go through the daemon's control socket; `ack` does too, and falls back to the database
when no daemon runs. Every command takes --json.

Exit codes: 0 ok · 1 the run FAILED (status/incident report on a failed run) · 2 usage error ·
3 daemon not running (mutating commands) · 4 not found (run, incident, config version) ·
5 refused by the daemon (e.g. resume a run that is not paused) · 6 permission denied on the socket ·
7 daemon not responding (its process is alive but it did not answer in time: SIGSTOPped or busy; a mutating
request was sent with a deadline, so the daemon will never apply it later).
Store problems, each its own code and one line (never a traceback, never 1): 20 no database ·
21 database damaged (corrupt, truncated, emptied, not a database) · 22 schema mismatch (run
`ulyssesctl db upgrade`) · 23 database locked/busy · 24 permission denied on the database.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, EXIT_NO_DAEMON, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_PERM = 0, 1, 2, 3, 4, 5, 6
EXIT_NOT_RESPONDING = 7
EXIT_NO_DB, EXIT_DB_DAMAGED, EXIT_DB_SCHEMA, EXIT_DB_BUSY, EXIT_DB_PERM = 20, 21, 22, 23, 24
DAEMON_NOT_RESPONDING = "not responding (stopped or busy)"

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Operate ulyssesd: status, incidents, pause/resume/stop/restart, configs.")
db_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Database schema (Alembic).")
app.add_typer(db_app, name="db")
# Piped output (logs, CI) gets a wide fixed width instead of rich's 80-column fallback.
console = Console() if sys.stdout.isatty() else Console(width=160)
err = Console(stderr=True)


class Ctx:
    state_dir: Path
    db: Path | None = None
    socket: Path | None = None
    run: str | None = None


CTX = Ctx()


def _print_version(value: bool) -> None:
    if value:
        from ulyssesd.daemon.operator.version import version_line

        print(version_line("ulyssesctl"))
        raise typer.Exit(EXIT_OK)


@app.callback()
def _global(
    state_dir: str = typer.Option(None, "--state-dir", envvar="ULYSSESD_STATE_DIR",
                                  help="daemon state directory (default: XDG state home)"),
    db: str = typer.Option(None, "--db", help="SQLite file (default {state-dir}/ulyssesd.db)"),
    socket: str = typer.Option(None, "--socket", envvar="ULYSSESD_SOCKET", help="control socket path"),
    run: str = typer.Option(None, "--run", help="run id (default: the newest run)"),
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                  help="print the version and exit"),
) -> None:
    from ulyssesd.daemon.spec import default_state_dir

    CTX.state_dir = Path(state_dir or default_state_dir())
    CTX.db = Path(db) if db else None
    CTX.socket = Path(socket) if socket else None
    CTX.run = run


# ------------------------------------------------------------------------------------------ plumbing
def _daemon_info() -> dict[str, Any]:
    try:
        info = json.loads((CTX.state_dir / "ulyssesd.daemon.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def _db_path() -> Path:
    if CTX.db:
        return CTX.db
    info = _daemon_info()
    return Path(info["db"]) if info.get("db") else CTX.state_dir / "ulyssesd.db"


def _socket_path() -> Path:
    from ulyssesd.daemon.control.paths import resolve_socket_path

    if CTX.socket:
        return CTX.socket
    info = _daemon_info()
    if info.get("socket"):
        return Path(info["socket"])
    return resolve_socket_path(CTX.state_dir)


def _out(data: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")


def _die(msg: str, code: int, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps({"ok": False, "error": msg, "exit_code": code}) + "\n")
    else:
        _err_line(msg)
    raise typer.Exit(code)


def _err_line(msg: str) -> None:
    """One line on stderr, whatever the terminal width; the message is not rich markup (file bytes, paths)."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(msg)}", soft_wrap=True)


def _store_exit_code(exc: Exception) -> int | None:
    """ulyssesctl's exit code of a store problem (module doc), None if `exc` is not one."""
    from ulyssesd.daemon.store import errors as E

    for cls, code in ((E.NoDatabaseError, EXIT_NO_DB), (E.CorruptStoreError, EXIT_DB_DAMAGED),
                      (E.SchemaMismatchError, EXIT_DB_SCHEMA), (E.StoreBusyError, EXIT_DB_BUSY),
                      (E.StorePermissionError, EXIT_DB_PERM)):
        if isinstance(exc, cls):
            return code
    return None


def _store(as_json: bool):
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.errors import StoreError

    try:
        return open_store(_db_path(), readonly=True)
    except StoreError as exc:
        _die(str(exc), _store_exit_code(exc) or EXIT_DB_DAMAGED, as_json)


def _run(store, as_json: bool):
    from ulyssesd.daemon.store.errors import NotFoundError

    if CTX.run:
        try:
            return store.get_run(CTX.run)
        except NotFoundError:
            _die(f"no run {CTX.run!r} in {_db_path()}", EXIT_NOT_FOUND, as_json)
    run = store.latest_run()
    if run is None:
        _die(f"no runs in {_db_path()} yet", EXIT_NOT_FOUND, as_json)
    return run


def _daemon_pid_alive() -> int | None:
    """The daemon's pid from its info file when that process exists (signal 0), else None."""
    pid = _daemon_info().get("pid")
    if type(pid) is not int or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # exists, owned by another user (e.g. the unit's)
        return pid
    return pid


def _request(cmd: str, args: dict | None, as_json: bool) -> dict:
    """A mutating request, sent with a deadline: one the daemon handles too late is refused, never applied."""
    from ulyssesd.daemon.control.client import send_request
    from ulyssesd.daemon.control.protocol import (
        ControlError,
        ControlPermissionError,
        ControlTimeout,
        DaemonNotRunning,
    )

    try:
        resp = send_request(_socket_path(), {"cmd": cmd, "args": args or {}}, timeout_s=10.0, with_deadline=True)
    except DaemonNotRunning as exc:
        _die(f"{exc} (this command needs a running daemon)", EXIT_NO_DAEMON, as_json)
    except ControlPermissionError as exc:
        _die(str(exc), EXIT_PERM, as_json)
    except ControlTimeout as exc:
        pid = _daemon_pid_alive()
        who = f"daemon (pid {pid}) {DAEMON_NOT_RESPONDING}" if pid else "daemon not responding"
        _die(f"{who}: {exc}; {cmd} was not applied", EXIT_NOT_RESPONDING, as_json)
    except ControlError as exc:
        _die(str(exc), EXIT_NO_DAEMON, as_json)
    if not resp.get("ok"):
        code = {"permission_denied": EXIT_PERM, "expired": EXIT_NOT_RESPONDING,
                "not_found": EXIT_NOT_FOUND}.get(str(resp.get("code")), EXIT_REFUSED)
        _die(f"daemon refused {cmd}: {resp.get('error')}", code, as_json)
    return resp


#: How many of the newest step records the ETA's step rate is measured over (same attempt only: a restart's
#: resume time is not training speed).
RATE_WINDOW_STEPS = 20
#: What `status` prints for a field that has no value yet (never a literal None).
EMPTY = "—"


def _recent_steps_from_telemetry(run_dir: str | None, limit: int = RATE_WINDOW_STEPS) -> list[dict[str, Any]]:
    """The newest `limit` step records in telemetry.jsonl, oldest first (read from its end; works with the
    daemon down)."""
    if not run_dir:
        return []
    path = Path(run_dir) / "telemetry.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    found: list[dict[str, Any]] = []
    for line in reversed(lines):
        try:
            d = json.loads(line)
        except (ValueError, RecursionError):  # garbage or a hostile deeply nested line: not a step
            continue
        if isinstance(d, dict) and d.get("kind") == "step":
            found.append(d)
            if len(found) >= limit:
                break
    return found[::-1]


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


def _fmt_duration(seconds: float | None) -> str:
    """1h02m03s / 4m05s / 7s; EMPTY when unknown."""
    if seconds is None:
        return EMPTY
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _or_empty(value: Any) -> str:
    return EMPTY if value is None else str(value)


def _fmt_time(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _parse_since(since: str | None) -> datetime | None:
    if not since:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if since[-1] in units and since[:-1].replace(".", "", 1).isdigit():
        return datetime.now(timezone.utc) - timedelta(seconds=float(since[:-1]) * units[since[-1]])
    try:
        dt = datetime.fromisoformat(since)
    except ValueError:
        raise typer.BadParameter(f"--since {since!r}: use e.g. 30m, 12h, 2d or an ISO time") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


# ------------------------------------------------------------------------------------------- status
def status_data(store, run) -> dict[str, Any]:
    from ulyssesd.daemon.store import flat_diff

    attempts = store.list_attempts(run.id)
    cursor = store.get_telemetry_cursor(run.id)
    latest = store.latest_checkpoint(run.id)
    good = store.latest_checkpoint(run.id, known_good=True)
    versions = store.list_config_versions(run.id)
    cur_v = next((v for v in versions if v.version == run.config_version), versions[-1] if versions else None)
    diff = flat_diff(versions[0].config, cur_v.config) if versions and cur_v else {}
    recent = _recent_steps_from_telemetry(run.run_dir)
    step = recent[-1] if recent else {}
    total = (cur_v.config.get("train") or {}).get("steps") if cur_v else None
    open_inc = store.list_incidents(run.id, status="open") + store.list_incidents(run.id, status="remediating")
    info = _daemon_info()
    live = None
    daemon = "not running"
    if info.get("run_id") == run.id:
        from ulyssesd.daemon.control.client import send_request
        from ulyssesd.daemon.control.protocol import ControlTimeout

        try:
            live = send_request(_socket_path(), {"cmd": "status"}, timeout_s=2.0).get("status")
        except ControlTimeout:  # accepted (the kernel queues it) but unanswered: alive but stopped or busy?
            if _daemon_pid_alive():
                daemon = DAEMON_NOT_RESPONDING
        except Exception:  # noqa: BLE001 - status must work without the daemon
            live = None
        if live:
            daemon = "running"
    return {
        "run_id": run.id, "state": run.state.value, "state_reason": run.state_reason,
        "daemon": daemon, "daemon_pid": info.get("pid") if daemon != "not running" else None,
        "attempt": attempts[-1].number if attempts else None,
        "restarts": max(0, len(attempts) - 1),
        "step": step.get("step", cursor.last_step if cursor else None),
        "loss": step.get("loss"), "tokens_per_s": step.get("tokens_per_s"), "mfu": step.get("mfu"),
        "mem_max_allocated_gib": step.get("mem_max_allocated_gib"),
        "latest_checkpoint": latest.tag if latest else None,
        "known_good_checkpoint": good.tag if good else None,
        "config_version": run.config_version, "config_diff_from_v1": diff,
        "open_incidents": len(open_inc), "run_dir": run.run_dir,
        "created_at": run.created_at.isoformat(), "ended_at": run.ended_at.isoformat() if run.ended_at else None,
        **progress_fields(recent, total if isinstance(total, int) else None, _aware(run.created_at),
                          _aware(run.ended_at) if run.ended_at else None, datetime.now(timezone.utc)),
    }


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _render_status(d: dict[str, Any]) -> Table:
    t = Table(title=f"run {d['run_id']}", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    color = {"COMPLETED": "green", "FAILED": "red", "RUNNING": "green", "PAUSED": "yellow"}.get(d["state"], "cyan")
    reason = f" ({d['state_reason']})" if d.get("state_reason") else ""
    t.add_row("state", f"[{color}]{d['state']}[/{color}]{reason}")
    t.add_row("daemon", d["daemon"] + (f" (pid {d['daemon_pid']})" if d.get("daemon_pid") else ""))
    t.add_row("attempt / restarts", f"{_or_empty(d['attempt'])} / {d['restarts']}")
    pct = f" ({d['progress']:.1%})" if isinstance(d.get("progress"), float) else ""
    t.add_row("step / total", f"{_or_empty(d['step'])} / {_or_empty(d.get('total_steps'))}{pct}")
    t.add_row("elapsed", _fmt_duration(d.get("elapsed_s")))
    rate = d.get("step_rate_per_s")
    t.add_row("ETA", _fmt_duration(d.get("eta_s")) + (f" (at {rate:.2f} steps/s)" if rate else ""))
    age = d.get("last_step_age_s")
    t.add_row("last step", EMPTY if age is None else f"{_fmt_duration(age)} ago")
    loss = d["loss"]
    t.add_row("loss", f"{loss:.4f}" if isinstance(loss, float) else _or_empty(loss))
    tps = d["tokens_per_s"]
    t.add_row("tokens/s", f"{tps:,.0f}" if isinstance(tps, int | float) else EMPTY)
    t.add_row("MFU", f"{d['mfu']:.1%}" if isinstance(d.get("mfu"), int | float) else EMPTY)
    mem = d["mem_max_allocated_gib"]
    t.add_row("max memory (GiB)", f"{mem:.2f}" if isinstance(mem, int | float) else EMPTY)
    t.add_row("checkpoint (latest / known good)",
              f"{_or_empty(d['latest_checkpoint'])} / {_or_empty(d['known_good_checkpoint'])}")
    diff = d["config_diff_from_v1"]
    t.add_row("config", f"v{d['config_version']}" + ("" if not diff else "; vs v1: " + ", ".join(
        f"{k}: {b!r} -> {a!r}" for k, (b, a) in diff.items())))
    t.add_row("open incidents", str(d["open_incidents"]))
    t.add_row("run dir", _or_empty(d["run_dir"]))
    return t


@app.command()
def status(json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
           watch: bool = typer.Option(False, "--watch", help="refresh until Ctrl-C: a live table on a terminal, "
                                      "one line per refresh in a pipe, JSON lines with --json"),
           interval: float = typer.Option(2.0, "--interval", min=0.05, help="--watch refresh period (s)")) -> None:
    """State, step/total, ETA, loss, tokens/s, MFU, memory, checkpoints, restarts, config version and its diff."""
    store = _store(json_out)
    if watch and (json_out or not sys.stdout.isatty()):
        _watch_lines(store, json_out, interval)
        return
    if watch:
        from rich.live import Live

        with Live(console=console, refresh_per_second=4) as live:
            try:
                while True:
                    live.update(_render_status(status_data(store, _run(store, json_out))))
                    time.sleep(interval)
            except KeyboardInterrupt:
                pass
        return
    d = status_data(store, _run(store, json_out))
    if json_out:
        _out(d, True)
    else:
        console.print(_render_status(d))
    if d["daemon"] == DAEMON_NOT_RESPONDING:
        raise typer.Exit(EXIT_NOT_RESPONDING)
    raise typer.Exit(EXIT_RUN_FAILED if d["state"] == "FAILED" else EXIT_OK)


def status_line(d: dict[str, Any]) -> str:
    """One line of `status --watch` in a pipe: the fields an operator tails for, EMPTY where unknown."""
    pct = f" ({d['progress']:.1%})" if isinstance(d.get("progress"), float) else ""
    loss = d.get("loss")
    tps = d.get("tokens_per_s")
    age = d.get("last_step_age_s")
    return (f"{datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')} {d['run_id']} {d['state']} "
            f"step {_or_empty(d['step'])}/{_or_empty(d.get('total_steps'))}{pct} "
            f"loss {f'{loss:.4f}' if isinstance(loss, float) else _or_empty(loss)} "
            f"tok/s {f'{tps:,.0f}' if isinstance(tps, int | float) else EMPTY} "
            f"elapsed {_fmt_duration(d.get('elapsed_s'))} ETA {_fmt_duration(d.get('eta_s'))} "
            f"last-step {EMPTY if age is None else _fmt_duration(age) + ' ago'} "
            f"open-incidents {d['open_incidents']} daemon {d['daemon']}")


def _watch_lines(store, json_out: bool, interval: float) -> None:
    """`status --watch` when stdout is a pipe or --json: one line (or one JSON object) per refresh, flushed,
    so `| head -3` or a log collector sees each at once. A reader that goes away ends the watch quietly."""
    try:
        while True:
            d = status_data(store, _run(store, json_out))
            sys.stdout.write((json.dumps(d, default=str) if json_out else status_line(d)) + "\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader closed the pipe (`| head -3`): point stdout at /dev/null so the interpreter's final
        # flush does not raise again, and exit 0 like other Unix tools do under head.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


# ---------------------------------------------------------------------------------------- incidents
@app.command()
def incidents(json_out: bool = typer.Option(False, "--json"),
              kind: str = typer.Option(None, "--kind", help="symptom, e.g. hang, nan_loss, crash"),
              status_: str = typer.Option(None, "--status", help="open|remediating|resolved|escalated|failed"),
              since: str = typer.Option(None, "--since", help="30m, 12h, 2d or an ISO time"),
              all_runs: bool = typer.Option(False, "--all-runs", help="every run, not only the newest")) -> None:
    """List incidents (filter by kind, status, since)."""
    store = _store(json_out)
    run_id = None if all_runs else _run(store, json_out).id
    try:
        rows = store.list_incidents(run_id, symptom=kind, status=status_, since=_parse_since(since))
    except ValueError as exc:
        _die(str(exc), EXIT_USAGE, json_out)
    if json_out:
        _out([r.to_dict() for r in rows], True)
        return
    console.print(incidents_table(rows, store))


def incidents_table(rows, store=None) -> Table:
    t = Table(title="incidents")
    for col, kw in (("id", {"no_wrap": True}), ("UTC", {"no_wrap": True}), ("att", {}), ("step", {}),
                    ("symptom", {"no_wrap": True}), ("status", {"no_wrap": True}), ("action", {"no_wrap": True}),
                    ("config", {"no_wrap": True}), ("summary", {"overflow": "fold", "ratio": 1})):
        t.add_column(col, **kw)
    for r in rows:
        acts = store.list_actions(incident_id=r.id) if store is not None else []
        act = ", ".join(f"{a.kind.value}" + (f" ({a.mode.value})" if a.mode.value not in ("none",) else "")
                        for a in acts) or "-"
        cfg = ", ".join(f"v{a.from_config_version}->v{a.to_config_version}" for a in acts
                        if a.to_config_version and a.to_config_version != a.from_config_version) or "-"
        color = {"resolved": "green", "failed": "red", "escalated": "yellow"}.get(r.status.value, "cyan")
        t.add_row(str(r.id), r.detected_at.strftime("%H:%M:%S"), str(r.attempt), str(r.step), r.symptom.value,
                  f"[{color}]{r.status.value}[/{color}]", act, cfg, (r.summary or "")[:90])
    return t


@app.command()
def incident(incident_id: int = typer.Argument(..., help="incident id"),
             json_out: bool = typer.Option(False, "--json")) -> None:
    """One incident: evidence, actions with their config diffs, outcome."""
    from ulyssesd.daemon.store.errors import NotFoundError

    store = _store(json_out)
    try:
        inc = store.get_incident(incident_id)
    except NotFoundError:
        _die(f"no incident {incident_id}", EXIT_NOT_FOUND, json_out)
    if json_out:
        _out(inc.to_dict(), True)
        return
    console.print(f"[bold]incident {inc.id}[/bold]  {inc.symptom.value} ({inc.severity.value})  run {inc.run_id}  "
                  f"attempt {inc.attempt}  step {inc.step}")
    console.print(f"detected {_fmt_time(inc.detected_at)}  status [bold]{inc.status.value}[/bold]"
                  f"{' — ' + inc.status_reason if inc.status_reason else ''}")
    if inc.acknowledged_by:
        console.print(f"acknowledged by {inc.acknowledged_by} at {_fmt_time(inc.acknowledged_at)}")
    console.print(f"summary: {inc.summary}")
    ev = dict(inc.evidence or {})
    long_keys = [k for k in ("stacks", "log_tail") if k in ev]
    console.print_json(json.dumps({k: v for k, v in ev.items() if k not in long_keys}, default=str))
    for k in long_keys:
        console.rule(k)
        console.print(str(ev[k])[-4000:], markup=False, highlight=False)
    t = Table(title="actions")
    for col in ("id", "kind", "mode", "config", "diff", "outcome", "parameters"):
        t.add_column(col, overflow="fold")
    for a in inc.actions:
        diff = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in (a.config_diff or {}).items()) or "-"
        cfg = f"v{a.from_config_version}->v{a.to_config_version}" if a.to_config_version != a.from_config_version else (
            f"v{a.from_config_version}" if a.from_config_version else "-")
        t.add_row(str(a.id), a.kind.value + (" (observe-only)" if a.observe_only else ""), a.mode.value, cfg, diff,
                  a.outcome.value, json.dumps(a.parameters, default=str)[:200])
    console.print(t)


# ----------------------------------------------------------------------------------------- mutating
def _simple(cmd: str, json_out: bool, args: dict | None = None) -> None:
    resp = _request(cmd, args, json_out)
    if json_out:
        _out(resp, True)
    else:
        console.print(f"{cmd}: ok" + (f" (run is now {resp['state']})" if resp.get("state") else ""))


@app.command()
def pause(json_out: bool = typer.Option(False, "--json")) -> None:
    """Ask the job to save and exit; the run waits in PAUSED until `resume`."""
    _simple("pause", json_out)


@app.command()
def resume(json_out: bool = typer.Option(False, "--json")) -> None:
    """Relaunch a PAUSED run from its latest valid checkpoint."""
    _simple("resume", json_out)


@app.command()
def stop(json_out: bool = typer.Option(False, "--json")) -> None:
    """Stop the run for good (the job saves and exits; the run ends STOPPED)."""
    _simple("stop", json_out)


@app.command()
def restart(json_out: bool = typer.Option(False, "--json")) -> None:
    """Graceful restart of the job (save, exit, relaunch from latest); not counted against the budget."""
    _simple("restart", json_out)


@app.command()
def ack(incident_id: int = typer.Argument(...), json_out: bool = typer.Option(False, "--json"),
        by: str = typer.Option(None, "--by", help="operator name (default: $USER)")) -> None:
    """Acknowledge an incident (through the daemon; directly in the database if no daemon runs)."""
    from ulyssesd.daemon.control.client import send_request
    from ulyssesd.daemon.control.protocol import ControlError, ControlTimeout, DaemonNotRunning
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.errors import NotFoundError

    who = by or os.environ.get("USER") or f"uid:{os.getuid()}"
    try:
        resp = send_request(_socket_path(), {"cmd": "ack", "args": {"id": incident_id, "by": who}}, timeout_s=10.0,
                            with_deadline=True)
        if not resp.get("ok"):
            code = {"not_found": EXIT_NOT_FOUND, "expired": EXIT_NOT_RESPONDING,
                    "permission_denied": EXIT_PERM}.get(str(resp.get("code")), EXIT_REFUSED)
            if "no incident" in str(resp.get("error")):
                code = EXIT_NOT_FOUND
            _die(f"ack refused: {resp.get('error')}", code, json_out)
        via = "daemon"
    except DaemonNotRunning:
        _store(json_out)  # clear error when there is no database at all
        try:
            with open_store(_db_path(), migrate=False) as store:
                store.ack_incident(incident_id, who)
        except NotFoundError:
            _die(f"no incident {incident_id}", EXIT_NOT_FOUND, json_out)
        via = "database (daemon not running)"
    except ControlTimeout as exc:
        _die(f"daemon {DAEMON_NOT_RESPONDING}: {exc}; ack was not applied", EXIT_NOT_RESPONDING, json_out)
    except ControlError as exc:
        _die(str(exc), EXIT_NO_DAEMON, json_out)
    if json_out:
        _out({"ok": True, "id": incident_id, "by": who, "via": via}, True)
    else:
        console.print(f"incident {incident_id} acknowledged by {who} via {via}")


# ------------------------------------------------------------------------------------------- config
@app.command()
def config(version: int = typer.Option(None, "--version", help="config version (default: current)"),
           json_out: bool = typer.Option(False, "--json")) -> None:
    """An effective job config version and its diff from its parent and from v1."""
    from ulyssesd.daemon.store import flat_diff
    from ulyssesd.daemon.store.errors import NotFoundError

    store = _store(json_out)
    run = _run(store, json_out)
    try:
        cv = store.get_config_version(run.id, version)
    except NotFoundError as exc:
        _die(str(exc), EXIT_NOT_FOUND, json_out)
    versions = {v.version: v for v in store.list_config_versions(run.id)}
    parent = versions.get(cv.parent_version) if cv.parent_version else None
    d = {"run_id": run.id, "version": cv.version, "parent_version": cv.parent_version, "reason": cv.reason,
         "created_at": cv.created_at.isoformat(),
         "diff_from_parent": flat_diff(parent.config, cv.config) if parent else {},
         "diff_from_v1": flat_diff(versions[1].config, cv.config) if 1 in versions else {},
         "config": cv.config, "versions": sorted(versions)}
    if json_out:
        _out(d, True)
        return
    console.print(f"[bold]config v{cv.version}[/bold] of run {run.id} (versions {d['versions']}): {cv.reason}")
    for title, diff in (("diff from parent", d["diff_from_parent"]), ("diff from v1", d["diff_from_v1"])):
        t = Table(title=title)
        t.add_column("key")
        t.add_column("before")
        t.add_column("after")
        for k, (b, a) in diff.items():
            t.add_row(k, repr(b), repr(a))
        console.print(t)
    console.print_json(json.dumps(cv.config))


# ----------------------------------------------------------------------------------------------- db
@db_app.command("upgrade")
def db_upgrade_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """Create or upgrade the database schema to head."""
    from ulyssesd.daemon.store.cli import db_upgrade

    rev = db_upgrade(_db_path())
    _out({"ok": True, "path": str(_db_path()), "revision": rev}, json_out) if json_out else console.print(
        f"{_db_path()}: at revision {rev}")


@db_app.command("current")
def db_current_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """The database's schema revision vs this code's head."""
    from ulyssesd.daemon.store.cli import db_status
    from ulyssesd.daemon.store.errors import StoreError

    try:
        st = db_status(_db_path())
    except StoreError as exc:
        _die(str(exc), _store_exit_code(exc) or EXIT_DB_DAMAGED, json_out)
    if json_out:
        _out(st, True)
    else:
        console.print(f"{st['path']}: current {st['current']}, head {st['head']}"
                      f"{'' if st['up_to_date'] else ' — run `ulyssesctl db upgrade`'}")


@app.command("report")
def report(run_id: str = typer.Argument(None, help="run id (default: the --run option, else the latest run)"),
           out: Path = typer.Option(None, "--out", "-o", help="HTML file to write (default: report-RUN.html)"),
           telemetry: Path = typer.Option(None, "--telemetry",
                                          help="telemetry file (default: the run directory's)")) -> None:
    """Write a self-contained HTML postmortem: curves with incidents and actions, timeline, goodput."""
    from ulyssesd.daemon.operator.report import render_report  # the page builder (it never imports ctl)

    store = _store(False)
    try:
        if run_id:
            CTX.run = run_id
        run = _run(store, False)
        if telemetry is not None and not telemetry.is_file():
            _die(f"--telemetry {telemetry}: no such file", 2, False)
        page = render_report(store, run.id, telemetry)
    finally:
        store.close()
    target = out or Path(f"report-{run.id}.html")
    target.write_text(page, encoding="utf-8")
    print(target.resolve())


def _register_subcommands() -> None:
    """Commands that live in their own modules (replay, diagnose, plan). Imported unguarded: a broken
    module must fail `ulyssesctl` loudly, not make its command silently vanish."""
    from ulyssesd.daemon.operator.ctl_diagnose import register_diagnose
    from ulyssesd.daemon.operator.ctl_offline import register
    from ulyssesd.daemon.operator.ctl_plan import register_plan

    for register_fn in (register, register_diagnose, register_plan):
        register_fn(app)

_register_subcommands()


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, prog_name="ulyssesctl")
    except SystemExit as exc:  # typer/click standalone mode exits with the command's code
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    except Exception as exc:  # a store problem found mid-command (a damaged page, a lock): one line, its code
        from ulyssesd.daemon.store.errors import classify

        problem = classify(exc, _db_path())
        code = _store_exit_code(problem) if problem is not None else None
        if code is None:
            raise
        as_json = "--json" in (argv if argv is not None else sys.argv[1:])
        if as_json:
            sys.stdout.write(json.dumps({"ok": False, "error": str(problem), "exit_code": code}) + "\n")
        else:
            _err_line(str(problem))
        return code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
