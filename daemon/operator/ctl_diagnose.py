"""`ulyssesctl diagnose LOGFILE`: classify a job log with the remediation library's log diagnosis.

Only the last `TAIL_BYTES` of the file are read (seek from the end), so a 50 GB log costs the same as a
small one. Only a regular file is read, opened non-blocking: a FIFO, device or directory is refused with a
clear error (exit 2), never waited on. The lead's ulyssesctl calls `register_diagnose(app)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.text import Text

from ulyssesd.daemon.core.attempt_diagnosis import RecordError, from_record, read_record, record_for_log
from ulyssesd.remediation.diagnosis import TAIL_BYTES, Diagnosis, diagnose
from ulyssesd.training.spec import UnreadableFile, read_regular_file

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # missing/unreadable file: same code click uses for usage errors

_STYLE = {"healthy": "green", "loss_scale_overflow": "yellow", "launcher_error": "yellow"}


class LogReadError(Exception):
    """The log file cannot be read; the message names the path and the reason."""


def read_log_tail(path: Path, max_bytes: int = TAIL_BYTES) -> str:
    """The last `max_bytes` of regular file `path`, decoded as UTF-8 (undecodable bytes replaced)."""
    try:
        data, _size = read_regular_file(path, max_bytes, tail=True)
    except UnreadableFile as e:
        reason = str(e).removeprefix(f"{path}: ")
        if reason == "file not found":
            raise LogReadError(f"log file not found: {path}") from None
        raise LogReadError(f"cannot read log file {path}: {reason}") from None
    return data.decode("utf-8", errors="replace")


def diagnose_log(logfile: Path, text: str, exit_code: int | None, signal: int | None) -> tuple[Diagnosis, dict]:
    """The diagnosis of a log; for a daemon attempt log (<run_dir>/logs/attempt-N.log) with no exit status
    given, the daemon's own: the same inputs (exit status, host OOM evidence) it recorded, the same function.

    Raises typer.Exit(EXIT_BAD_INPUT) when the attempt's record exists but cannot be read."""
    rec_path = record_for_log(logfile)
    if rec_path is not None and exit_code is None and signal is None:
        try:
            data = read_record(rec_path)
        except RecordError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        if data is not None:
            d, how = from_record(data, text)
            return d, {"record": str(rec_path), "decided_by": how, "returncode": data.get("returncode"),
                       "signal": data.get("signal")}
    return diagnose(text, exit_code=exit_code, signal=signal), {}


def render(d: Diagnosis, path: Path, console: Console, record: dict | None = None) -> None:
    body = Text()
    body.append(f"{d.reason}\n", style="bold")
    body.append(f"confidence: {d.confidence}\n")
    if record:
        body.append(f"as the daemon decided it (by {record['decided_by']}; exit status and host evidence from "
                    f"{record['record']})\n", style="dim")
    if d.evidence:
        body.append("\nevidence:\n", style="underline")
        for line in d.evidence:
            body.append(f"  {line}\n", style="dim")
    if d.secondary:
        body.append(f"\nalso seen: {', '.join(d.secondary)}\n")
    style = _STYLE.get(d.label, "red")
    console.print(Panel(body, title=f"[{style}]{d.label}[/{style}]", subtitle=escape(str(path)), expand=True))


def register_diagnose(app: typer.Typer) -> None:
    """Add the `diagnose` command to an ulyssesctl Typer app."""

    @app.command("diagnose")
    def diagnose_cmd(
        logfile: Path = typer.Argument(..., metavar="LOGFILE", help="Job log (stdout+stderr of the launcher); only its tail is read."),
        exit_code: Optional[int] = typer.Option(
            None, "--exit-code",
            help="Launcher exit status: negative = killed by that signal (subprocess), 128+N = shell. It can change the "
                 "label: 0 is always healthy; 137/-9 (SIGKILL) with no other cause is host_oom_killed (medium); "
                 "139/-11 is segfault; another non-zero status makes a log with no failure line launcher_error. "
                 "Without it (and without --signal), a daemon attempt's recorded status is used, else the log alone."),
        signal: Optional[int] = typer.Option(
            None, "--signal", help="Signal number that ended the job, when known; like --exit-code it can change the "
                                   "label (9 -> host_oom_killed, 11 -> segfault, 15 with no failure -> healthy)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a panel."),
    ) -> None:
        """Diagnose why a job stopped. One label from the fixed set, plus the log lines that decided it."""
        try:
            text = read_log_tail(logfile)
        except LogReadError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        d, record = diagnose_log(logfile, text, exit_code, signal)
        if as_json:
            from ulyssesd.daemon.operator.ctl_common import json_text  # strict JSON, like every --json

            typer.echo(json_text({**d.to_dict(), "file": str(logfile), **record}))
        else:
            render(d, logfile, Console(), record)
        raise typer.Exit(EXIT_OK)
