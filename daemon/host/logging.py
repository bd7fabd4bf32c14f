"""The one place structlog is configured.

JSON lines on stdout when stdout is not a TTY, a readable console renderer on a TTY. Under systemd
(`JOURNAL_STREAM` names the stream we write to, see systemd.exec(5)) every JSON line is prefixed with its
syslog priority `<N>` as sd-daemon(3) describes, so journald stores it as PRIORITY and `journalctl -p err`
shows the daemon's errors. Levels mean something: info = progress, warning = an incident or a degraded
path, error = a crash, a hang, a launch failure or an action that could not be applied, critical = the run
FAILED. The run and attempt are bound once (`bind_run`) through structlog's contextvars, so every line of
the loop carries them. Tests use `structlog.testing.capture_logs()`, which works with this configuration
because it only swaps the processor chain.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import structlog

_configured = False

#: structlog level -> syslog priority (sd-daemon(3): "<3>" error, "<4>" warning, "<6>" info, ...).
SYSLOG_PRIORITY = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7,
                   "notset": 7}


class _CurrentStdout:
    """Writes to whatever `sys.stdout` is at the time of the write, not at configure time.

    A daemon that redirects stdout later (or pytest, which swaps and closes it per test) must never be left
    logging into a closed file.
    """

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def isatty(self) -> bool:
        return hasattr(sys.stdout, "isatty") and sys.stdout.isatty()

    def fileno(self) -> int:
        return sys.stdout.fileno()


def writes_to_journal(stream: Any, environ: dict[str, str] | None = None) -> bool:
    """True if `stream` is the journald stream systemd connected us to (JOURNAL_STREAM = "dev:inode").

    systemd.exec(5) asks to compare the device and inode with the fd's: a child whose stdout was
    redirected to a file inherits the variable but must not write `<N>` prefixes into that file.
    """
    value = (environ if environ is not None else os.environ).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # StringIO, a closed file
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def _with_priority_prefix(render: Callable[..., Any]) -> Callable[..., str]:
    def render_for_journald(logger: Any, method_name: str, event_dict: dict[str, Any]) -> str:
        level = str(event_dict.get("level", method_name)).lower()
        return f"<{SYSLOG_PRIORITY.get(level, 6)}>{render(logger, method_name, event_dict)}"

    return render_for_journald


def configure_logging(level: str | None = None, json: bool | None = None, stream=None,
                      journald: bool | None = None) -> None:
    """Configure structlog once for the process.

    level: minimum level (default $ULYSSESD_LOG_LEVEL or INFO); json: JSON lines (default: off a TTY);
    journald: `<N>` priority prefixes (default: when `JOURNAL_STREAM` names this stream).
    """
    global _configured
    stream = stream or _CurrentStdout()
    level_name = (level or os.environ.get("ULYSSESD_LOG_LEVEL") or "INFO").upper()
    if journald is None:
        journald = writes_to_journal(stream)
    if json is None:
        json = journald or not (hasattr(stream, "isatty") and stream.isatty())
    renderer: Callable[..., Any] = (structlog.processors.JSONRenderer() if json
                                    else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    if journald:
        renderer = _with_priority_prefix(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def bind_run(run_id: str | None, attempt: int | None) -> None:
    """Bind the run and attempt to every later log line of this thread (structlog contextvars)."""
    structlog.contextvars.bind_contextvars(run_id=run_id or None, attempt=attempt or None)


def get_logger(name: str | None = None, **initial):
    if not _configured:
        configure_logging()
    return structlog.get_logger(name, **initial) if name else structlog.get_logger(**initial)
