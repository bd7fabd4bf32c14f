"""`ulyssesctl status --watch` as a real subprocess on real stores: one line per refresh in a pipe (JSON lines
with --json), `| head -3` ends it cleanly (exit 0, no traceback), and the run's end ends it: a finished run
(COMPLETED, FAILED, STOPPED) prints its final state once and exits with `status`'s code, in a pipe and on a
terminal, and a run that finishes while watched ends the watch. The runs come from real fake-job supervised
runs (the daemon loop in-process) or, for FAILED, a run written to a real SQLite store."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState

CTL = Path(sys.executable).parent / "ulyssesctl"


@pytest.fixture
def finished_state_dir(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=10, interval=5))
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=60)
    assert sup.state == RunState.COMPLETED
    return tmp_path / "state", sup.run_id


def _watch(state_dir: Path, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([str(CTL), "--state-dir", str(state_dir), "status", "--watch", "--interval", "0.1",
                           *extra], capture_output=True, text=True, timeout=timeout)


def _pipe_to_head(state_dir: Path, *extra: str) -> subprocess.Popen:
    # bash's PIPESTATUS gives ulyssesctl's own exit code after head closed the pipe on it.
    cmd = (f"'{CTL}' --state-dir '{state_dir}' status --watch --interval 0.1 {' '.join(extra)} 2>ctl.err"
           " | head -3; echo \"ctl_rc=${PIPESTATUS[0]}\"; cat ctl.err >&2")
    return subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=state_dir)


def _tick_while(sup, proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Drive the in-process daemon while `proc` runs (it answers the watch's status requests); its output."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        sup.tick()
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"watch still running after {timeout}s (state {sup.state}): {out[-2000:]} {err}")
    return proc.communicate()


def test_watch_of_a_finished_run_prints_its_final_state_once_and_exits_0(finished_state_dir):
    state_dir, run_id = finished_state_dir
    proc = _watch(state_dir)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert run_id in lines[0] and "COMPLETED" in lines[0] and "step 10/10 (100.0%)" in lines[0]
    assert "None" not in lines[0] and proc.stderr == ""

    proc = _watch(state_dir, "--json")
    docs = [json.loads(line) for line in proc.stdout.splitlines()]  # each line is one whole JSON object
    assert proc.returncode == 0 and len(docs) == 1, (proc.stdout, proc.stderr)
    assert docs[0]["run_id"] == run_id and docs[0]["state"] == "COMPLETED" and docs[0]["step"] == 10


def test_watch_of_a_failed_run_exits_1_like_status(tmp_path):
    state_dir = tmp_path / "state"
    store = open_store(state_dir / "ulyssesd.db")
    store.create_run("r-failed", run_dir=str(tmp_path / "runs" / "r-failed"), state=RunState.RUNNING)
    store.set_run_state("r-failed", RunState.FAILED, "restart budget exhausted")
    store.close()
    plain = subprocess.run([str(CTL), "--state-dir", str(state_dir), "status", "--json"], capture_output=True,
                           text=True, timeout=30)
    proc = _watch(state_dir, "--json")
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert plain.returncode == proc.returncode == 1, (plain.returncode, proc.returncode, proc.stderr)
    assert len(docs) == 1 and docs[0]["state"] == "FAILED" and docs[0]["state_reason"] == "restart budget exhausted"


def test_watch_on_a_terminal_shows_the_final_table_and_exits(finished_state_dir):
    """On a terminal the watch draws rich's live table; a finished run's table is drawn once, then it exits."""
    state_dir, run_id = finished_state_dir
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(CTL), "--state-dir", str(state_dir), "status", "--watch", "--interval", "0.1"],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    seen = b""
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    while True:  # the pty keeps what it wrote until read; EIO once the child's side is closed and drained
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    text = seen.decode("utf-8", errors="replace")
    assert rc == 0, (rc, text[-2000:])
    assert run_id in text and "COMPLETED" in text and "Traceback" not in text


def test_watch_ends_when_the_watched_run_finishes(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=40, interval=10, step_s=0.05))
    sup.start()
    run_until(sup, lambda s: s.state == RunState.RUNNING and (s.last_step or 0) >= 2, timeout=60)
    proc = subprocess.Popen([str(CTL), "--state-dir", str(tmp_path / "state"), "status", "--watch", "--interval",
                             "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # No tick until the watch printed its first line: the store's state stays RUNNING meanwhile, so a slow
    # start of ulyssesctl on a loaded box cannot miss the run's live part.
    first = proc.stdout.readline()
    out, err = _tick_while(sup, proc, timeout=90)
    out = first + out
    lines = out.splitlines()
    assert proc.returncode == 0 and sup.state == RunState.COMPLETED, (proc.returncode, out[-2000:], err)
    assert "RUNNING" in lines[0] and "COMPLETED" in lines[-1] and "step 40/40" in lines[-1], out
    assert not any("COMPLETED" in line for line in lines[:-1]), out  # the final state once, then the end


def test_watch_in_a_pipe_prints_one_line_per_refresh_until_head_closes_it(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=4000, interval=1000, step_s=0.05))  # stopped at the end
    sup.start()
    run_until(sup, lambda s: s.state == RunState.RUNNING and (s.last_step or 0) >= 2, timeout=60)
    state_dir = tmp_path / "state"
    for extra in ((), ("--json",)):
        proc = _pipe_to_head(state_dir, *extra)
        out, err = _tick_while(sup, proc, timeout=60)
        lines = out.splitlines()
        assert len(lines) == 4 and lines[-1] == "ctl_rc=0", (out, err)
        if extra:
            docs = [json.loads(line) for line in lines[:3]]  # each line is one whole JSON object
            assert all(d["run_id"] == sup.run_id and d["state"] == "RUNNING" and d["total_steps"] == 4000
                       for d in docs), docs
        else:
            assert all(sup.run_id in line and "RUNNING" in line and "None" not in line for line in lines[:3])
        assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert sup.handle_command({"cmd": "stop"})["ok"]
    run_until(sup, lambda s: s.state == RunState.STOPPED, timeout=30)


def test_watch_refuses_a_zero_interval(finished_state_dir):
    state_dir, _ = finished_state_dir
    proc = subprocess.run([str(CTL), "--state-dir", str(state_dir), "status", "--watch", "--interval", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--interval" in proc.stderr
