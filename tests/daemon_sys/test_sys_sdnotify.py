"""sd_notify against a real AF_UNIX datagram socket (path and abstract namespace)."""

from __future__ import annotations

import os
import socket
import uuid

from structlog.testing import capture_logs

from ulyssesd.daemon.host.sdnotify import SdNotifier


def _listener(addr):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(2.0)
    return s


def _recv(s) -> str:
    return s.recv(4096).decode()


def test_messages_reach_a_path_socket(sockdir):
    path = os.path.join(sockdir, "notify")
    s = _listener(path)
    n = SdNotifier(env={"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready(status="launching  attempt\n1")
    assert _recv(s) == "READY=1\nSTATUS=launching attempt 1"  # status squashed onto one line
    assert n.status("step 10 loss 2.3")
    assert _recv(s) == "STATUS=step 10 loss 2.3"
    assert n.watchdog()
    assert _recv(s) == "WATCHDOG=1"
    assert n.stopping()
    assert _recv(s) == "STOPPING=1"
    assert n.mainpid(4242)
    assert _recv(s) == "MAINPID=4242"
    assert n.extend_timeout(90)
    assert _recv(s) == "EXTEND_TIMEOUT_USEC=90000000"
    assert n.reloading()
    msg = _recv(s)
    assert msg.startswith("RELOADING=1\nMONOTONIC_USEC=") and int(msg.split("=")[-1]) > 0
    n.close()
    s.close()


def test_abstract_namespace_socket():
    name = f"ulyssesd-test-{uuid.uuid4().hex}"
    s = _listener(b"\0" + name.encode())
    n = SdNotifier(env={"NOTIFY_SOCKET": "@" + name})
    assert n.ready()
    assert _recv(s) == "READY=1"
    s.close()


def test_noop_outside_systemd_and_environment_is_not_required():
    n = SdNotifier(env={})
    assert not n.enabled
    assert n.ready() is False and n.watchdog() is False and n.status("x") is False
    assert n.watchdog_interval_s() is None and n.maybe_watchdog() is False


def test_socket_that_points_nowhere_logs_once_and_never_raises(sockdir):
    n = SdNotifier(env={"NOTIFY_SOCKET": os.path.join(sockdir, "missing")})
    with capture_logs() as logs:
        for _ in range(5):
            assert n.ready() is False
            assert n.watchdog() is False
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "missing" in warnings[0]["notify_socket"]


def test_watchdog_interval_and_tick_pings(sockdir):
    path = os.path.join(sockdir, "notify")
    s = _listener(path)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}
    n = SdNotifier(env=env)
    assert n.watchdog_interval_s() == 30.0
    assert n.maybe_watchdog(now=100.0) is True  # first tick pings
    assert _recv(s) == "WATCHDOG=1"
    assert n.maybe_watchdog(now=129.9) is False  # not yet half the interval
    assert n.maybe_watchdog(now=130.0) is True
    assert _recv(s) == "WATCHDOG=1"
    s.settimeout(0.1)
    # Watchdog meant for another pid (e.g. inherited): no pings.
    other = SdNotifier(env={**env, "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval_s() is None and other.maybe_watchdog(now=0.0) is False
    assert SdNotifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "junk"}).watchdog_interval_s() is None
    s.close()


def test_children_do_not_inherit_notify_socket(monkeypatch, sockdir):
    path = os.path.join(sockdir, "notify")
    s = _listener(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    n = SdNotifier()
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
    assert n.watchdog_interval_s() == 1.0
    assert n.ready() and _recv(s) == "READY=1"
    s.close()
