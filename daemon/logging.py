"""The one place structlog is configured.

JSON lines on stdout when stdout is not a TTY (journald under systemd), a readable console renderer on a
TTY. Tests use `structlog.testing.capture_logs()`, which works with this configuration because it only
swaps the processor chain.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


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


def configure_logging(level: str | None = None, json: bool | None = None, stream=None) -> None:
    global _configured
    stream = stream or _CurrentStdout()
    level_name = (level or os.environ.get("ULYSSESD_LOG_LEVEL") or "INFO").upper()
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
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


def get_logger(name: str | None = None, **initial):
    if not _configured:
        configure_logging()
    return structlog.get_logger(name, **initial) if name else structlog.get_logger(**initial)
