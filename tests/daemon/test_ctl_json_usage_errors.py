"""`ulyssesctl … --json` answers a usage error (unknown option or command, missing argument, bad value) with one
JSON object on stdout, the shape of its other --json errors (`{"ok": false, "error", "exit_code"}`, plus the
command's usage line), and the same exit code 2 as without --json; without --json the usage text stays on
stderr. Run as the installed executable, as a script would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CTL = Path(sys.executable).parent / "ulyssesctl"


def _ctl(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CTL), "--state-dir", str(tmp_path / "state"), *argv], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("argv", "message", "usage"), [
    (["status", "--json", "--bogus"], "No such option: --bogus", "Usage: ulyssesctl status [OPTIONS]"),
    (["incident", "--json"], "Missing argument 'ID'", "Usage: ulyssesctl incident [OPTIONS] ID"),
    (["status", "--json", "--interval", "abc"], "Invalid value for '--interval'", "Usage: ulyssesctl status"),
    (["status", "--json", "--interval"], "Option '--interval' requires an argument", None),
    (["incident", "seven", "--json"], "Invalid value for 'ID'", "Usage: ulyssesctl incident"),
    (["nosuchcmd", "--json"], "No such command 'nosuchcmd'", "Usage: ulyssesctl [OPTIONS] COMMAND"),
    (["logs", "--json"], "No such option: --json", "Usage: ulyssesctl logs"),  # a command without --json
])
def test_a_usage_error_under_json_is_one_json_object_with_exit_2(tmp_path, argv, message, usage):
    proc = _ctl(tmp_path, *argv)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert doc["ok"] is False and doc["exit_code"] == 2 and message in doc["error"], doc
    assert usage is None or (doc["usage"] or "").startswith(usage), doc
    assert proc.stderr == "", proc.stderr


def test_without_json_a_usage_error_stays_text_on_stderr(tmp_path):
    proc = _ctl(tmp_path, "status", "--bogus")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Usage: ulyssesctl status" in proc.stderr and "No such option: --bogus" in proc.stderr


def test_json_commands_still_answer_normally(tmp_path):
    """Parsing without click's standalone mode changes nothing else: help is 0, a store problem keeps its code."""
    assert _ctl(tmp_path, "status", "--json", "--help").returncode == 0
    proc = _ctl(tmp_path, "status", "--json")
    assert proc.returncode == 20 and json.loads(proc.stdout)["exit_code"] == 20  # no database yet
