"""What every `ulyssesctl` command shares: exit codes, the global options (state dir, db, socket, run),
the store/socket plumbing, the one-line error path, and the field formatting (EMPTY for no value).

Exit codes: 0 ok · 1 the run FAILED (status/incident report on a failed run) · 2 usage error ·
3 daemon not running (mutating commands) · 4 not found (run, incident, config version, attempt log) ·
5 refused by the daemon (e.g. resume a run that is not paused) · 6 permission denied on the socket ·
7 daemon not responding (its process is alive but it did not answer in time: SIGSTOPped or busy; a mutating
request was sent with a deadline, so the daemon will never apply it later).
Store problems, each its own code and one line (never a traceback, never 1): 20 no database ·
21 database damaged (corrupt, truncated, emptied, not a database) · 22 schema mismatch (run
`ulyssesctl db upgrade`) · 23 database locked/busy · 24 permission denied on the database.
Every --json output is strict JSON (`json_text`: a NaN loss is the string "NaN"). A mutating request that
meets a daemon whose control slots are all taken (`busy`) is retried with backoff for up to BUSY_RETRY_S.
"""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

from ulyssesd.daemon.clock import utc_now

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, EXIT_NO_DAEMON, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_PERM = 0, 1, 2, 3, 4, 5, 6
EXIT_NOT_RESPONDING = 7
EXIT_NOTHING_PARSED = 8  # `replay` read no step record: nothing was judged
EXIT_NO_DB, EXIT_DB_DAMAGED, EXIT_DB_SCHEMA, EXIT_DB_BUSY, EXIT_DB_PERM = 20, 21, 22, 23, 24
DAEMON_NOT_RESPONDING = "not responding (stopped or busy)"
#: What a command prints for a field that has no value (yet, or not in this state): never a literal None.
EMPTY = "—"

# Piped output (logs, CI) gets a wide fixed width instead of rich's 80-column fallback.
console = Console() if sys.stdout.isatty() else Console(width=160)
err = Console(stderr=True)


class Ctx:
    """The global options of this invocation (set by ulyssesctl's callback before any command runs)."""

    state_dir: Path
    db: Path | None = None
    socket: Path | None = None
    run: str | None = None


CTX = Ctx()


def daemon_info() -> dict[str, Any]:
    """The running daemon's info file (pid, socket, db, run_id); {} when there is none or it is unreadable."""
    try:
        info = json.loads((CTX.state_dir / "ulyssesd.daemon.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def db_path() -> Path:
    if CTX.db:
        return CTX.db
    info = daemon_info()
    return Path(info["db"]) if info.get("db") else CTX.state_dir / "ulyssesd.db"


def socket_path() -> Path:
    from ulyssesd.daemon.control.paths import resolve_socket_path

    if CTX.socket:
        return CTX.socket
    info = daemon_info()
    if info.get("socket"):
        return Path(info["socket"])
    return resolve_socket_path(CTX.state_dir)


def _strict(value: Any) -> Any:
    """`value` with every NaN/±inf float replaced by the string "NaN" / "Infinity" / "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def json_text(data: Any, indent: int | None = None) -> str:
    """Strict JSON (RFC 8259) for every --json output: Python writes a NaN loss as the bare token NaN, which
    jq and other strict parsers refuse, so non-finite floats become strings ("NaN", "Infinity", "-Infinity")
    — a NaN loss is exactly what the operator must be able to read."""
    return json.dumps(_strict(data), indent=indent, default=str, allow_nan=False)


def fmt_loss(loss: Any) -> str:
    """A loss for the table: 4 decimals, or 4 significant digits in e-notation once it is huge (a diverging
    fp32 loss of 1e38 would otherwise print as 39 digits); EMPTY when unknown."""
    if not isinstance(loss, float | int) or isinstance(loss, bool):
        return or_empty(loss)
    return f"{loss:.4f}" if abs(loss) < 1e6 else f"{loss:.4e}"


def out(data: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json_text(data, indent=1) + "\n")


def die(msg: str, code: int, as_json: bool) -> NoReturn:
    if as_json:
        sys.stdout.write(json.dumps({"ok": False, "error": msg, "exit_code": code}) + "\n")
    else:
        err_line(msg)
    raise typer.Exit(code)


def err_line(msg: str) -> None:
    """One line on stderr, whatever the terminal width; the message is not rich markup (file bytes, paths)."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(msg)}", soft_wrap=True)


def store_exit_code(exc: Exception) -> int | None:
    """ulyssesctl's exit code of a store problem (module doc), None if `exc` is not one."""
    from ulyssesd.daemon.store import errors as E

    for cls, code in ((E.NoDatabaseError, EXIT_NO_DB), (E.CorruptStoreError, EXIT_DB_DAMAGED),
                      (E.SchemaMismatchError, EXIT_DB_SCHEMA), (E.StoreBusyError, EXIT_DB_BUSY),
                      (E.StorePermissionError, EXIT_DB_PERM)):
        if isinstance(exc, cls):
            return code
    return None


def open_ro_store(as_json: bool):
    """The store, read-only (works with the daemon down); a store problem exits with its own code."""
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.errors import StoreError

    try:
        return open_store(db_path(), readonly=True)
    except StoreError as exc:
        die(str(exc) + no_database_hint(exc), store_exit_code(exc) or EXIT_DB_DAMAGED, as_json)


def no_database_hint(exc: Exception) -> str:
    """For a missing database found through the state dir: where ulyssesctl looked and how to point it
    elsewhere (a newcomer's first `ulyssesctl status` looks in ~/.local/state, the unit writes /var/lib)."""
    from ulyssesd.daemon.store.errors import NoDatabaseError

    if not isinstance(exc, NoDatabaseError) or CTX.db is not None or daemon_info().get("db"):
        return ""
    return (f" (state dir {CTX.state_dir}: pass --state-dir DIR or set ULYSSESD_STATE_DIR; the systemd unit's "
            f"is /var/lib/ulyssesd)")


def current_run(store, as_json: bool):
    """The --run run, else the newest; exits EXIT_NOT_FOUND when there is none."""
    from ulyssesd.daemon.store.errors import NotFoundError

    if CTX.run:
        try:
            return store.get_run(CTX.run)
        except NotFoundError:
            die(f"no run {CTX.run!r} in {db_path()}", EXIT_NOT_FOUND, as_json)
    run = store.latest_run()
    if run is None:
        die(f"no runs in {db_path()} yet", EXIT_NOT_FOUND, as_json)
    return run


def daemon_pid_alive() -> int | None:
    """The daemon's pid from its info file when that process exists (signal 0), else None."""
    pid = daemon_info().get("pid")
    if type(pid) is not int or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # exists, owned by another user (e.g. the unit's)
        return pid
    return pid


#: How long a mutating command keeps retrying a daemon that answers `busy` (every control slot taken, e.g. by
#: a burst of other clients). The daemon says busy at accept, before it reads a byte, so a retry can never
#: make it apply a request twice.
BUSY_RETRY_S = 5.0


def _send_retrying_busy(send_request, path: Path, payload: dict) -> dict:
    """send_request with its deadline, retried with backoff while the answer is `busy` (bounded by
    BUSY_RETRY_S; then the last busy answer is returned); any other answer or error ends it at once."""
    import tenacity

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(BUSY_RETRY_S),
        wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05),
        retry=tenacity.retry_if_result(lambda resp: isinstance(resp, dict) and resp.get("code") == "busy"),
        # tenacity sets `outcome` before it calls back; the check only narrows the Optional for mypy.
        retry_error_callback=lambda state: state.outcome.result() if state.outcome is not None else None,
    )
    return retrying(send_request, path, payload, timeout_s=10.0, with_deadline=True)


def request(cmd: str, args: dict | None, as_json: bool) -> dict:
    """A mutating request, sent with a deadline: one the daemon handles too late is refused, never applied."""
    from ulyssesd.daemon.control.client import send_request
    from ulyssesd.daemon.control.protocol import (
        ControlError,
        ControlPermissionError,
        ControlTimeout,
        DaemonNotRunning,
    )

    try:
        resp = _send_retrying_busy(send_request, socket_path(), {"cmd": cmd, "args": args or {}})
    except DaemonNotRunning as exc:
        die(f"{exc} (this command needs a running daemon)", EXIT_NO_DAEMON, as_json)
    except ControlPermissionError as exc:
        die(str(exc), EXIT_PERM, as_json)
    except ControlTimeout as exc:
        pid = daemon_pid_alive()
        who = f"daemon (pid {pid}) {DAEMON_NOT_RESPONDING}" if pid else "daemon not responding"
        die(f"{who}: {exc}; {cmd} was not applied", EXIT_NOT_RESPONDING, as_json)
    except ControlError as exc:
        die(str(exc), EXIT_NO_DAEMON, as_json)
    if not resp.get("ok"):
        code = {"permission_denied": EXIT_PERM, "expired": EXIT_NOT_RESPONDING,
                "not_found": EXIT_NOT_FOUND}.get(str(resp.get("code")), EXIT_REFUSED)
        die(f"daemon refused {cmd}: {resp.get('error')}", code, as_json)
    return resp


def reader_gone() -> None:
    """After a BrokenPipeError (`| head` closed the pipe): point stdout at /dev/null so the interpreter's final
    flush does not raise again; the caller then exits 0, like other Unix tools under head."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


# ------------------------------------------------------------------------------------------- formatting
def fmt_duration(seconds: float | None) -> str:
    """1h02m03s / 4m05s / 7s; EMPTY when unknown."""
    if seconds is None:
        return EMPTY
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, ending in "…" when cut (a table cell that stops mid-word looks broken)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def or_empty(value: Any) -> str:
    return EMPTY if value is None else str(value)


def fmt_time(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else EMPTY


def aware(t: datetime) -> datetime:
    """A stored time as an aware UTC datetime (SQLite hands back naive ones)."""
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def parse_since(since: str | None) -> datetime | None:
    if not since:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if since[-1] in units and since[:-1].replace(".", "", 1).isdigit():
        return utc_now() - timedelta(seconds=float(since[:-1]) * units[since[-1]])
    try:
        dt = datetime.fromisoformat(since)
    except ValueError:
        raise typer.BadParameter(f"--since {since!r}: use e.g. 30m, 12h, 2d or an ISO time") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
