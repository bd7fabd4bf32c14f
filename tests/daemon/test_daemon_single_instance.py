"""One supervisor per state dir and per run, with real daemon processes (the fake job, no torch).

A second daemon — same state dir (even after the socket file was removed), or another state dir and
socket path reaching the live run through a shared database with `--run-id` — exits at once with code 12
and names the holder's pid; the first daemon keeps sole control of the job. A SIGKILLed daemon's locks go
with it (the job does not inherit them), so the next daemon re-adopts the job. Files and dirs the daemon
creates have its own modes under `umask 000`.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from uls_daemon_helpers import fake_spec
from uls_daemon_helpers import wait_for as _wait

from ulyssesd.daemon.control.client import send_request
from ulyssesd.daemon.store import open_store

EXIT_BUSY = 12


def _daemon(spec: Path, log: Path, *extra: str, umask: int | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec), *extra],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def _info(state: Path) -> dict | None:
    try:
        return json.loads((state / "ulyssesd.daemon.json").read_text())
    except (OSError, ValueError):
        return None


def _second(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", *args], capture_output=True,
                          text=True, timeout=timeout)


def _stop(d: subprocess.Popen, sock: str) -> None:
    try:
        send_request(sock, {"cmd": "stop"})
        d.wait(60)
    finally:
        if d.poll() is None:
            os.killpg(d.pid, signal.SIGKILL)
            d.wait(10)


def test_second_daemon_same_state_dir_or_same_run_exits_12_naming_the_holder(tmp_path):
    spec = fake_spec(tmp_path, steps=5000, interval=1000, step_s=0.1)
    state = tmp_path / "state"
    d1 = _daemon(spec, tmp_path / "d1.log")
    try:
        info = _wait(lambda: _info(state), 60, "daemon 1 up")
        run_id, sock = info["run_id"], info["socket"]
        lock = json.loads((state / "ulyssesd.lock").read_text())
        assert lock["pid"] == d1.pid

        # 1. Same state dir, after the socket file was removed (the socket probe cannot see daemon 1).
        os.unlink(sock)
        t0 = time.monotonic()
        r = _second(["--spec", str(spec)])
        assert r.returncode == EXIT_BUSY, r.stderr
        assert time.monotonic() - t0 < 30  # at once: no preflight, no store work, no wait on the lock
        assert f"pid {d1.pid}" in r.stderr and f"state dir {state}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr

        # 2. Another state dir and socket path, the same database, --run-id of the live run: the run lock.
        other = tmp_path / "other"
        other.mkdir()
        spec2 = fake_spec(other, steps=5000, interval=1000,
                          daemon={"db_path": str(state / "ulyssesd.db"),
                                  "socket_path": str(Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "o.sock")})
        r = _second(["--spec", str(spec2), "--run-id", run_id])
        assert r.returncode == EXIT_BUSY, r.stderr
        assert f"run {run_id}" in r.stderr and f"pid {d1.pid}" in r.stderr, r.stderr
        assert str(state / "runs" / run_id / "supervisor.lock") in r.stderr

        # Daemon 1 still has sole control: one attempt, its job alive, the run still going.
        store = open_store(state / "ulyssesd.db", readonly=True)
        atts = store.list_attempts(run_id)
        assert len(atts) == 1 and atts[0].ended_at is None and psutil.pid_exists(atts[0].pid)
        assert store.get_run(run_id).state.value in ("STARTING", "RUNNING")
        assert [t.to_state.value for t in store.list_transitions(run_id)].count("FAILED") == 0
        assert d1.poll() is None

        # 3. SIGKILL daemon 1: the kernel drops its locks (the job, which keeps running, holds none),
        # so a new daemon on the same state dir starts and re-adopts the same job.
        job_pid = atts[0].pid
        os.kill(d1.pid, signal.SIGKILL)
        d1.wait(10)
        assert psutil.pid_exists(job_pid)
        (state / "ulyssesd.daemon.json").unlink(missing_ok=True)
        d3 = _daemon(spec, tmp_path / "d3.log")
        info3 = _wait(lambda: _info(state), 60, "daemon 3 up")
        assert info3["pid"] == d3.pid and info3["run_id"] == run_id
        assert len(open_store(state / "ulyssesd.db", readonly=True).list_attempts(run_id)) == 1
        _stop(d3, info3["socket"])
        assert d3.returncode == 0, (tmp_path / "d3.log").read_text()[-2000:]
    finally:
        if d1.poll() is None:
            os.killpg(d1.pid, signal.SIGKILL)
            d1.wait(10)
        for p in psutil.process_iter(["cmdline"]):  # no fake job left behind
            if str(tmp_path) in " ".join(p.info["cmdline"] or ()):
                p.kill()


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_daemon_files_have_private_modes_under_umask_000(tmp_path):
    spec = fake_spec(tmp_path, steps=6, interval=3)
    d = _daemon(spec, tmp_path / "d.log", umask=0)
    assert d.wait(120) == 0, (tmp_path / "d.log").read_text()[-2000:]
    state = tmp_path / "state"
    run_dir = next((state / "runs").iterdir())
    for dd in (state, state / "runs", run_dir, run_dir / "configs", run_dir / "logs", state / "backups"):
        assert _mode(dd) == 0o750, (dd, oct(_mode(dd)))
    backups = sorted((state / "backups").glob("ulyssesd-*.db"))
    assert backups, "the clean shutdown writes a backup"
    for f in (state / "ulyssesd.db", *backups, state / "ulyssesd.lock", run_dir / "supervisor.lock"):
        assert _mode(f) == 0o640, (f, oct(_mode(f)))
    assert open_store(backups[-1], readonly=True).get_run(run_dir.name).state.value == "COMPLETED"


def test_unusable_state_dir_is_a_clear_error_not_a_traceback(tmp_path):
    spec = fake_spec(tmp_path)
    (tmp_path / "state").write_text("a file where the state dir should be")
    r = _second(["--spec", str(spec)])
    assert r.returncode == 13, r.stderr
    assert "cannot use state dir" in r.stderr and "Traceback" not in r.stderr
