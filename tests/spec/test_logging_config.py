"""structlog is configured in one place: JSON lines off a TTY (journald), console on a TTY."""

from __future__ import annotations

import io
import json

import structlog
from structlog.testing import capture_logs

from ulyssesd.daemon.logging import configure_logging, get_logger


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    configure_logging(stream=out)
    get_logger("t").info("launched", attempt=3)
    record = json.loads(out.getvalue().strip().splitlines()[-1])
    assert record["event"] == "launched" and record["attempt"] == 3 and record["level"] == "info"
    assert "timestamp" in record


def test_console_renderer_on_a_tty() -> None:
    out = _Tty()
    configure_logging(stream=out)
    get_logger("t").warning("slow step", ratio=2.5)
    text = out.getvalue()
    assert "slow step" in text and "ratio" in text
    try:
        json.loads(text.strip().splitlines()[-1])
        raise AssertionError("a TTY must not get JSON")
    except json.JSONDecodeError:
        pass


def test_level_filter_and_capture_logs() -> None:
    out = io.StringIO()
    configure_logging(level="warning", stream=out)
    get_logger("t").info("hidden")
    assert out.getvalue() == ""
    with capture_logs() as logs:
        get_logger("t").warning("seen", k=1)
    assert logs == [{"event": "seen", "k": 1, "log_level": "warning"}]
    structlog.reset_defaults()
