"""`ulyssesctl`: the operator CLI.

Read-only commands (status, runs, logs, incidents, incident, config, report, db current) read the SQLite store
and the run directory directly, so they work while the daemon is down (Monday morning after a FAILED run).
Mutating commands (pause, resume, stop, restart) go through the daemon's control socket; `ack` does too, and
falls back to the database when no daemon runs. Commands that print data take --json.

One module per concern: ctl_common (exit codes, global options, store/socket plumbing), ctl_status (status,
runs), ctl_logs (logs), ctl_records (incidents, incident, config, db, report), ctl_control (pause, resume,
stop, restart, ack), ctl_offline (replay), ctl_diagnose (diagnose), ctl_plan (plan). Exit codes: ctl_common.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ulyssesd.cli_app import cli_app, run_cli, wants_json
from ulyssesd.daemon.operator.ctl_common import (  # noqa: F401 - the documented import path of these names
    CTX,
    DAEMON_NOT_RESPONDING,
    EMPTY,
    EXIT_DB_BUSY,
    EXIT_DB_DAMAGED,
    EXIT_DB_PERM,
    EXIT_DB_SCHEMA,
    EXIT_NO_DAEMON,
    EXIT_NO_DB,
    EXIT_NOT_FOUND,
    EXIT_NOT_RESPONDING,
    EXIT_OK,
    EXIT_PERM,
    EXIT_REFUSED,
    EXIT_RUN_FAILED,
    EXIT_USAGE,
    db_path,
    err_line,
    store_exit_code,
)
from ulyssesd.daemon.operator.ctl_records import incidents_table  # noqa: F401 - public API
from ulyssesd.daemon.operator.ctl_status import progress_fields, status_data  # noqa: F401 - public API

app = cli_app("Operate ulyssesd: status, runs, logs, incidents, pause/resume/stop/restart, configs, reports.")
db_app = cli_app("Database schema (Alembic).")
app.add_typer(db_app, name="db")


def _print_version(value: bool) -> None:
    if value:
        from ulyssesd.daemon.operator.version import version_line

        print(version_line("ulyssesctl"))
        raise typer.Exit(EXIT_OK)


@app.callback()
def _global(
    state_dir: str = typer.Option(None, "--state-dir", envvar="ULYSSESD_STATE_DIR",
                                  help="daemon state directory (default: XDG state home)"),
    db: str = typer.Option(None, "--db", help="SQLite file (default: ulyssesd.db in the state dir)"),
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


def _register_commands() -> None:
    """Every command lives in its module. Imported unguarded: a broken module must fail `ulyssesctl`
    loudly, not make its command silently vanish."""
    from ulyssesd.daemon.operator.ctl_control import register_control
    from ulyssesd.daemon.operator.ctl_diagnose import register_diagnose
    from ulyssesd.daemon.operator.ctl_logs import register_logs
    from ulyssesd.daemon.operator.ctl_offline import register
    from ulyssesd.daemon.operator.ctl_plan import register_plan
    from ulyssesd.daemon.operator.ctl_records import register_records
    from ulyssesd.daemon.operator.ctl_status import register_status
    from ulyssesd.daemon.operator.ctl_tune import register_tune

    register_status(app)
    register_logs(app)
    register_records(app, db_app)
    register_control(app)
    for register_fn in (register, register_diagnose, register_plan, register_tune):
        register_fn(app)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    as_json = wants_json(argv)
    try:
        return run_cli(app, argv, "ulyssesctl", json_errors=as_json)  # under --json a usage error is JSON too
    except Exception as exc:  # a store problem found mid-command (a damaged page, a lock): one line, its code
        from ulyssesd.daemon.store.errors import classify

        problem = classify(exc, db_path())
        code = store_exit_code(problem) if problem is not None else None
        if code is None:
            raise
        if as_json:
            sys.stdout.write(json.dumps({"ok": False, "error": str(problem), "exit_code": code}) + "\n")
        else:
            err_line(str(problem))
        return code


if __name__ == "__main__":
    sys.exit(main())
