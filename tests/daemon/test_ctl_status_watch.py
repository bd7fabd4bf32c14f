"""`ulyssesctl status --watch` in a real pipe: one line per refresh (JSON lines with --json), and `| head -3`
ends it cleanly (exit 0, no traceback). The store comes from a real fake-job supervised run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState

CTL = Path(sys.executable).parent / "ulyssesctl"


@pytest.fixture
def finished_state_dir(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=10, interval=5))
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=60)
    return tmp_path / "state", sup.run_id


def _pipe_to_head(state_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    # bash's PIPESTATUS gives ulyssesctl's own exit code after head closed the pipe on it.
    cmd = (f"'{CTL}' --state-dir '{state_dir}' status --watch --interval 0.1 {' '.join(extra)} 2>ctl.err"
           " | head -3; echo \"ctl_rc=${PIPESTATUS[0]}\"; cat ctl.err >&2")
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60, cwd=state_dir)


def test_watch_in_a_pipe_prints_one_line_per_refresh(finished_state_dir):
    state_dir, run_id = finished_state_dir
    proc = _pipe_to_head(state_dir)
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "ctl_rc=0", (proc.stdout, proc.stderr)
    for line in lines[:3]:
        assert run_id in line and "COMPLETED" in line and "step 10/10 (100.0%)" in line and "None" not in line
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_watch_json_prints_json_lines(finished_state_dir):
    state_dir, run_id = finished_state_dir
    proc = _pipe_to_head(state_dir, "--json")
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "ctl_rc=0", (proc.stdout, proc.stderr)
    docs = [json.loads(line) for line in lines[:3]]  # each line is one whole JSON object
    assert all(d["run_id"] == run_id and d["step"] == 10 and d["total_steps"] == 10 for d in docs)
    assert "Traceback" not in proc.stderr, proc.stderr


def test_watch_refuses_a_zero_interval(finished_state_dir):
    state_dir, _ = finished_state_dir
    proc = subprocess.run([str(CTL), "--state-dir", str(state_dir), "status", "--watch", "--interval", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--interval" in proc.stderr
