"""An operator's session against a real daemon (`ulyssesd run` as a process, the fake job, the control
socket), every command through the installed `ulyssesctl` executable: pause says where the run is going,
status shows the live daemon with no throughput while PAUSED and counts the resume as an operator relaunch
(not a restart), `logs -f` follows the live attempt and ends by itself when `stop` ends it, `runs` lists it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec, wait_for

CTL = Path(sys.executable).parent / "ulyssesctl"


def _ctl(state: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(CTL), "--state-dir", str(state), *args], capture_output=True, text=True,
                          timeout=timeout)


def _status(state: Path) -> dict:
    res = _ctl(state, "status", "--json")
    return json.loads(res.stdout)


@pytest.mark.slow
def test_operator_session_against_a_real_daemon(tmp_path):
    spec = fake_spec(tmp_path, steps=3000, interval=20, step_s=0.05)
    state = tmp_path / "state"
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    follow = None
    try:
        wait_for(lambda: (s := _status(state))["daemon"] == "running" and (s["step"] or 0) >= 5, 90, "training")
        paused = _ctl(state, "pause")
        assert paused.returncode == 0 and "PAUSED" in paused.stdout and "STOPPING" not in paused.stdout, paused
        st = wait_for(lambda: (s := _status(state))["state"] == "PAUSED" and s, 60, "PAUSED")
        assert st["daemon"] == "running" and st["tokens_per_s"] is None and st["loss"] is not None

        resumed = _ctl(state, "resume")
        assert resumed.returncode == 0 and "RUNNING" in resumed.stdout, resumed
        st = wait_for(lambda: (s := _status(state))["attempt"] == 2 and s["state"] == "RUNNING"
                      and (s["tokens_per_s"] or 0) > 0 and s, 60, "attempt 2 training")
        assert (st["restarts"], st["operator_relaunches"]) == (0, 1)

        follow = subprocess.Popen([str(CTL), "--state-dir", str(state), "logs", "-f"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        stopped = _ctl(state, "stop")
        assert stopped.returncode == 0 and "STOPPED" in stopped.stdout, stopped
        out, err = follow.communicate(timeout=60)  # ends by itself once the attempt is over
        assert follow.returncode == 0, err
        run_dir = Path(st["run_dir"])
        assert out == (run_dir / "logs" / "attempt-2.log").read_bytes()  # the live attempt's whole output
        assert daemon.wait(60) == 0
        runs = json.loads(_ctl(state, "runs", "--json").stdout)
        assert [(r["run_id"], r["state"], r["attempts"]) for r in runs] == [(st["run_id"], "STOPPED", 2)]
    finally:
        for proc in (follow, daemon):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        _kill_jobs_left(state)
        log.close()


def _kill_jobs_left(state: Path) -> None:
    """A failed test must not leave a job behind: SIGKILL the process group of every attempt still open."""
    import os

    from ulyssesd.daemon.store import open_store

    try:
        with open_store(state / "ulyssesd.db", readonly=True) as store:
            groups = [a.pgid for r in store.list_runs() for a in store.list_attempts(r.id)
                      if a.ended_at is None and a.pgid]
    except Exception:  # noqa: BLE001 - no store, nothing was launched
        return
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
