"""`ulyssesctl` commands that change a run through the daemon's control socket: `pause`, `resume`, `stop`,
`restart`, and `ack` (which falls back to the database when no daemon runs)."""

from __future__ import annotations

import os

import typer

from ulyssesd.daemon.operator.ctl_common import (
    DAEMON_NOT_RESPONDING,
    EXIT_NO_DAEMON,
    EXIT_NOT_FOUND,
    EXIT_NOT_RESPONDING,
    EXIT_PERM,
    EXIT_REFUSED,
    console,
    db_path,
    die,
    open_ro_store,
    out,
    request,
    socket_path,
)

#: The state each command moves the run to once the job has saved and exited. The daemon answers with the
#: state the run is in *now* (STOPPING while the job saves), which is not what the operator asked for.
TARGET_STATE = {"pause": "PAUSED", "stop": "STOPPED", "resume": "RUNNING", "restart": "RUNNING"}
#: What the run is doing meanwhile, in the operator's words.
UNDERWAY = {"pause": "pausing…", "stop": "stopping…", "resume": "resuming…", "restart": "restarting…"}


def outcome_line(cmd: str, state: str | None) -> str:
    """`pause: ok (run is PAUSED)` once it is there, else `pause: ok (pausing…; the run will be PAUSED)`."""
    target = TARGET_STATE[cmd]
    if state is None or state == target:
        return f"{cmd}: ok" + (f" (run is {state})" if state else "")
    return f"{cmd}: ok ({UNDERWAY[cmd]} the run will be {target})"


def _simple(cmd: str, json_out: bool) -> None:
    resp = request(cmd, None, json_out)
    if json_out:
        out({**resp, "target_state": TARGET_STATE[cmd]}, True)
    else:
        console.print(outcome_line(cmd, resp.get("state")), highlight=False)


def pause(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Pause the run. The job saves and exits; the run waits in PAUSED until `resume`."""
    _simple("pause", json_out)


def resume(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Relaunch a PAUSED run from its latest valid checkpoint."""
    _simple("resume", json_out)


def stop(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Stop the run for good. The job saves and exits; the run ends STOPPED."""
    _simple("stop", json_out)


def restart(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Restart the job gracefully. Save, exit, relaunch from the latest checkpoint; not a restart in the budget."""
    _simple("restart", json_out)


def ack(incident_id: int = typer.Argument(..., metavar="ID", help="incident id"),
        json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
        by: str = typer.Option(None, "--by", help="operator name (default: $USER)")) -> None:
    """Acknowledge an incident. Through the daemon; directly in the database if no daemon runs."""
    from ulyssesd.daemon.control.client import send_request
    from ulyssesd.daemon.control.protocol import ControlError, ControlTimeout, DaemonNotRunning
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.errors import NotFoundError

    who = by or os.environ.get("USER") or f"uid:{os.getuid()}"
    try:
        resp = send_request(socket_path(), {"cmd": "ack", "args": {"id": incident_id, "by": who}}, timeout_s=10.0,
                            with_deadline=True)
        if not resp.get("ok"):
            code = {"not_found": EXIT_NOT_FOUND, "expired": EXIT_NOT_RESPONDING,
                    "permission_denied": EXIT_PERM}.get(str(resp.get("code")), EXIT_REFUSED)
            if "no incident" in str(resp.get("error")):
                code = EXIT_NOT_FOUND
            die(f"ack refused: {resp.get('error')}", code, json_out)
        via = "daemon"
    except DaemonNotRunning:
        open_ro_store(json_out)  # clear error when there is no database at all
        try:
            with open_store(db_path(), migrate=False) as store:
                store.ack_incident(incident_id, who)
        except NotFoundError:
            die(f"no incident {incident_id}", EXIT_NOT_FOUND, json_out)
        via = "database (daemon not running)"
    except ControlTimeout as exc:
        die(f"daemon {DAEMON_NOT_RESPONDING}: {exc}; ack was not applied", EXIT_NOT_RESPONDING, json_out)
    except ControlError as exc:
        die(str(exc), EXIT_NO_DAEMON, json_out)
    if json_out:
        out({"ok": True, "id": incident_id, "by": who, "via": via}, True)
    else:
        console.print(f"incident {incident_id} acknowledged by {who} via {via}", markup=False)


def register_control(app: typer.Typer) -> None:
    """Add the mutating commands to ulyssesctl."""
    for fn in (pause, resume, stop, restart, ack):
        app.command(fn.__name__)(fn)
