"""The adoption command the daemon itself prints works the first time. Before, `ulyssesd run --run-id X` of a
run directory the store had lost took its own run lock twice (adopting the directory, then the run), called
itself "another ulyssesd", exited 12, and the job ran on unsupervised. Real daemon processes, the fake job."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from uls_daemon_helpers import fake_spec  # noqa: E402
from uls_daemon_helpers import wait_for as _wait  # noqa: E402

from ulyssesd.daemon.control.client import send_request  # noqa: E402

pytestmark = pytest.mark.slow


def _daemon(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", *args], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _info(state: Path) -> dict | None:
    try:
        return json.loads((state / "ulyssesd.daemon.json").read_text())
    except (OSError, ValueError):
        return None


def test_the_printed_adoption_command_adopts_the_run_the_first_time(tmp_path):
    spec = fake_spec(tmp_path, steps=5000, interval=1000, step_s=0.1)
    state = tmp_path / "state"
    d1 = _daemon(["--spec", str(spec)], tmp_path / "d1.log")
    d2 = None
    try:
        info = _wait(lambda: _info(state), 60, "daemon 1 up")
        run_id = info["run_id"]
        _wait(lambda: (state / "runs" / run_id / "attempts").is_dir(), 60, "attempt launched")
        os.kill(d1.pid, signal.SIGKILL)  # the daemon dies, the job trains on
        d1.wait(10)
        (state / "ulyssesd.daemon.json").unlink(missing_ok=True)
        for name in ("ulyssesd.db", "ulyssesd.db-wal", "ulyssesd.db-shm"):  # the database is lost
            (state / name).unlink(missing_ok=True)
        for backup in (state / "backups").glob("*"):
            backup.unlink()
        refused = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "--run-id" in refused.stderr, refused.stderr
        printed = re.search(r"`(ulyssesd run [^`]+)`", refused.stderr)
        assert printed, refused.stderr
        args = shlex.split(printed.group(1))[2:]  # run the command exactly as printed
        d2 = _daemon(args, tmp_path / "d2.log")
        info2 = _wait(lambda: _info(state), 60, "the adopting daemon up")
        assert info2["run_id"] == run_id and d2.poll() is None, (tmp_path / "d2.log").read_text()[-2000:]
        assert "another ulyssesd" not in (tmp_path / "d2.log").read_text()
        send_request(info2["socket"], {"cmd": "stop"})
        d2.wait(60)
    finally:
        for d in (d1, d2):
            if d is not None and d.poll() is None:
                os.killpg(d.pid, signal.SIGKILL)
                d.wait(10)
        for p in psutil.process_iter(["cmdline"]):  # no fake job left behind
            if str(tmp_path) in " ".join(p.info["cmdline"] or ()):
                p.kill()
