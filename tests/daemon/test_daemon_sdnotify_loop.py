"""The daemon's loop talks to systemd: READY, STATUS, WATCHDOG (from the loop), STOPPING — checked on a
real AF_UNIX datagram socket standing in for systemd's notify socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from uls_daemon_helpers import fake_spec


def test_ready_status_watchdog_stopping_on_a_real_socket(tmp_path):
    addr = f"/tmp/uls-notify-{os.getpid()}.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(addr)
    srv.settimeout(0.5)
    try:
        spec = fake_spec(tmp_path, steps=40, interval=10)
        env = dict(os.environ, NOTIFY_SOCKET=addr, WATCHDOG_USEC="1000000")  # ping every 0.5 s
        d = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)], env=env,
                             stdout=open(tmp_path / "d.log", "wb"), stderr=subprocess.STDOUT)
        msgs: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and d.poll() is None:
            try:
                msgs.append(srv.recv(4096).decode())
            except TimeoutError:
                pass
        assert d.wait(30) == 0
        while True:
            try:
                msgs.append(srv.recv(4096).decode())
            except (TimeoutError, BlockingIOError):
                break
    finally:
        srv.close()
        os.unlink(addr)
    text = "\n".join(msgs)
    assert msgs[0].startswith("READY=1"), msgs[:3]
    assert "STATUS=" in text and "RUNNING" in text and "COMPLETED" in text
    assert sum(m == "WATCHDOG=1" for m in msgs) >= 2
    assert msgs[-1].startswith("STOPPING=1")
