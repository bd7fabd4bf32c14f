"""structlog is configured in one place: JSON lines off a TTY, `<N>`-prefixed for journald, console on a TTY."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import structlog
from structlog.testing import capture_logs

from ulyssesd.daemon.host.logging import (
    SYSLOG_PRIORITY,
    bind_run,
    configure_logging,
    get_logger,
    writes_to_journal,
)


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


_EMIT = """
import sys
from ulyssesd.daemon.host.logging import bind_run, configure_logging, get_logger
configure_logging()
bind_run("tiny-7", 3)
log = get_logger("t")
log.debug("not shown")
log.info("launched")
log.warning("incident", symptom="loss_spike")
log.error("attempt ended", status="exit 1")
log.critical("state", to="FAILED")
"""


def _run_under_journal(tmp_path, stream_matches: bool) -> list[str]:
    """A real child process whose stdout is a file standing in for journald's stream socket; JOURNAL_STREAM
    names that file's device:inode (as systemd does) or another file's (a redirected child)."""
    out = tmp_path / "stdout"
    other = tmp_path / "other"
    other.write_text("")
    with out.open("w") as fh:
        st = os.fstat(fh.fileno()) if stream_matches else os.stat(other)
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        env.pop("ULYSSESD_LOG_LEVEL", None)
        subprocess.run([sys.executable, "-c", _EMIT], stdout=fh, env=env, check=True, timeout=60)
    return out.read_text().splitlines()


def test_journald_priority_prefix_in_a_real_child_process(tmp_path) -> None:
    lines = _run_under_journal(tmp_path, stream_matches=True)
    assert [line[:3] for line in lines] == ["<6>", "<4>", "<3>", "<2>"]  # sd-daemon(3): info warning err crit
    records = [json.loads(line[3:]) for line in lines]  # after the prefix: one JSON object per event
    assert [r["event"] for r in records] == ["launched", "incident", "attempt ended", "state"]
    assert all(r["run_id"] == "tiny-7" and r["attempt"] == 3 for r in records)  # bound through contextvars


def test_no_prefix_when_journal_stream_names_another_file(tmp_path) -> None:
    lines = _run_under_journal(tmp_path, stream_matches=False)
    assert len(lines) == 4 and all(line.startswith("{") for line in lines)
    assert json.loads(lines[-1])["level"] == "critical"


def test_priority_mapping_and_bound_context() -> None:
    out = io.StringIO()
    configure_logging(stream=out, journald=True)
    structlog.contextvars.clear_contextvars()
    bind_run("r1", 2)
    try:
        get_logger("t").warning("w")
        get_logger("t").info("i", attempt=9)  # an explicit value wins over the bound one
    finally:
        structlog.contextvars.clear_contextvars()
    first, second = out.getvalue().splitlines()
    assert first.startswith("<4>{") and json.loads(first[3:])["run_id"] == "r1"
    assert second.startswith("<6>{") and json.loads(second[3:])["attempt"] == 9
    assert SYSLOG_PRIORITY["critical"] == 2 and SYSLOG_PRIORITY["error"] == 3 and SYSLOG_PRIORITY["debug"] == 7
    assert writes_to_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"}) is False  # no fd: never prefixed
    structlog.reset_defaults()
