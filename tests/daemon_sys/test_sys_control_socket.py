"""Control socket with real unix sockets, real SO_PEERCRED and a real foreign uid (fork + setuid)."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from ulyssesd.daemon.control_socket import (
    ControlPermissionError,
    ControlServer,
    ControlSocketError,
    ControlTimeout,
    DaemonNotRunning,
    Peer,
    PeerAuthorizer,
    find_socket_path,
    parse_request,
    resolve_socket_path,
    send_request,
)

NOBODY = 65534


class Recorder:
    def __init__(self):
        self.requests = []
        self.paused = False

    def __call__(self, request):
        self.requests.append(request)
        if request["cmd"] == "pause":
            self.paused = True
            return {"ok": True, "state": "PAUSED"}
        if request["cmd"] == "boom":
            raise RuntimeError("handler bug")
        if request["cmd"] == "status":
            return {"state": "RUNNING", "echo": request["args"]}
        return {"ok": False, "code": "unknown_command", "error": f"unknown command {request['cmd']!r}"}


class Loop:
    """Stands in for the supervisor main loop: polls the server in a thread."""

    def __init__(self, server):
        self.server = server
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.server.poll(0.05)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.server.close()


@pytest.fixture
def running(sockdir):
    handler = Recorder()
    path = os.path.join(sockdir, "ctl.sock")
    loop = Loop(ControlServer(path, handler, group="ulyssesd-test-nonexistent"))
    yield path, handler, loop
    loop.close()


def _raw(path, data: bytes, read=True, shutdown=False) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(data)
    if shutdown:
        s.shutdown(socket.SHUT_WR)
    buf = b""
    while read and b"\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    return json.loads(buf)


def test_roundtrip_mode_and_peer(running):
    path, handler, _ = running
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    resp = send_request(path, {"cmd": "status", "args": {"verbose": True}})
    assert resp == {"ok": True, "state": "RUNNING", "echo": {"verbose": True}}
    req = handler.requests[-1]
    assert req["peer"]["uid"] == os.geteuid() and req["peer"]["pid"] == os.getpid()
    assert send_request(path, {"cmd": "pause"})["state"] == "PAUSED" and handler.paused
    assert send_request(path, {"cmd": "nope"})["code"] == "unknown_command"


@pytest.mark.parametrize("payload, fragment", [
    (b"this is not json\n", "not valid JSON"),
    (b"[1, 2]\n", "must be a JSON object"),
    (b'{"cmd": 3}\n', "'cmd' must be"),
    (b'{"cmd": "Pause; rm -rf /"}\n', "'cmd' must be"),
    (b'{"cmd": "status", "args": [1]}\n', "'args' must be a JSON object"),
    (b'{"cmd": "status", "extra": 1}\n', "unknown request key"),
    (b'{"cmd": "status", "v": 2}\n', "unsupported protocol version"),
    (b"\xff\xfe\n", "not valid JSON"),
])
def test_garbage_gets_a_clear_error_and_changes_nothing(running, payload, fragment):
    path, handler, _ = running
    resp = _raw(path, payload)
    assert resp["ok"] is False and resp["code"] == "bad_request" and fragment in resp["error"]
    assert handler.requests == []


def test_oversized_request_is_refused(running):
    path, handler, _ = running
    resp = _raw(path, b'{"cmd": "status", "args": {"x": "' + b"a" * (70 * 1024) + b'"}}\n')
    assert resp["ok"] is False and "exceeds 65536 bytes" in resp["error"]
    assert handler.requests == []


def test_request_without_newline_then_eof_is_accepted(running):
    path, handler, _ = running
    assert _raw(path, b'{"cmd": "status"}', shutdown=True)["ok"] is True


def test_silent_client_times_out_and_does_not_block_others(sockdir):
    handler = Recorder()
    path = os.path.join(sockdir, "ctl.sock")
    loop = Loop(ControlServer(path, handler, read_timeout_s=0.5))
    try:
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.settimeout(5)
        silent.connect(path)
        silent.sendall(b'{"cmd": "sta')  # never finishes
        t0 = time.monotonic()
        assert send_request(path, {"cmd": "status"})["ok"] is True  # served while the other one dangles
        assert time.monotonic() - t0 < 0.4
        answer = json.loads(silent.recv(4096))
        assert answer["code"] == "timeout" and "within 0.5 s" in answer["error"]
        silent.close()
    finally:
        loop.close()


def test_handler_exception_becomes_internal_error(running):
    path, _, _ = running
    resp = send_request(path, {"cmd": "boom"})
    assert resp == {"ok": False, "code": "internal", "error": "internal error handling 'boom': RuntimeError: handler bug"}
    assert send_request(path, {"cmd": "status"})["ok"] is True  # still serving


def test_client_errors_when_nothing_listens(sockdir):
    missing = os.path.join(sockdir, "none.sock")
    with pytest.raises(DaemonNotRunning, match="no control socket at"):
        send_request(missing, {"cmd": "status"})
    stale = os.path.join(sockdir, "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()  # file stays, nobody listens
    with pytest.raises(DaemonNotRunning, match="nothing is listening"):
        send_request(stale, {"cmd": "status"})


def test_client_times_out_on_a_hung_daemon(sockdir):
    path = os.path.join(sockdir, "ctl.sock")
    server = ControlServer(path, Recorder())  # never polled: a hung main loop
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlTimeout, match="did not answer within 0.3 s"):
            send_request(path, {"cmd": "status"}, timeout_s=0.3)
        assert time.monotonic() - t0 < 2
    finally:
        server.close()


def test_stale_socket_replaced_live_one_refused(sockdir):
    path = os.path.join(sockdir, "ctl.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    first = ControlServer(path, Recorder())  # stale file: replaced
    try:
        with pytest.raises(ControlSocketError, match=f"another ulyssesd is listening on {path}"):
            ControlServer(path, Recorder())
        assert os.path.exists(path)  # the refused second server did not remove the live socket
    finally:
        first.close()
    assert not os.path.exists(path)
    with open(path, "w") as f:
        f.write("not a socket")
    with pytest.raises(ControlSocketError, match="exists and is not a socket"):
        ControlServer(path, Recorder())


def test_close_does_not_unlink_a_newer_daemons_socket(sockdir):
    path = os.path.join(sockdir, "ctl.sock")
    old = ControlServer(path, Recorder())
    os.unlink(path)  # e.g. a new daemon replaced it
    new = ControlServer(path, Recorder())
    old.close()
    assert os.path.exists(path)
    new.close()
    assert not os.path.exists(path)


def test_path_too_long_is_a_clear_error(sockdir):
    with pytest.raises(ControlSocketError, match="AF_UNIX allows at most 107"):
        ControlServer(os.path.join(sockdir, "x" * 120 + ".sock"), Recorder())


def test_wakeup_ends_poll_early(sockdir):
    server = ControlServer(os.path.join(sockdir, "ctl.sock"), Recorder())
    try:
        threading.Timer(0.1, server.wakeup).start()
        t0 = time.monotonic()
        assert server.poll(5.0) == 0
        assert time.monotonic() - t0 < 2
        t0 = time.monotonic()
        server.poll(0.2)  # drained: a plain poll waits its timeout again
        assert time.monotonic() - t0 >= 0.19
    finally:
        server.close()


def test_authorizer_rules():
    me = os.geteuid()
    auth = PeerAuthorizer(group="root")  # gid 0 exists everywhere
    assert auth(Peer(1, 0, 0)) is None
    assert auth(Peer(1, me, 12345)) is None
    assert auth(Peer(1, 424242, 0)) is None  # peer's primary gid is the group
    assert auth(Peer(1, NOBODY, NOBODY)) == "permission denied: uid 65534 is not root or in group root"
    assert PeerAuthorizer(group=None, allowed_uids={NOBODY})(Peer(1, NOBODY, NOBODY)) is None
    # A missing group authorizes nobody by group (and does not crash).
    assert PeerAuthorizer(group="no-such-group-xyz")(Peer(1, NOBODY, NOBODY)) is not None


def _as_nobody(fn):
    """Run fn() in a forked child as uid/gid 65534; return its JSON-able result or exception text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = {"result": fn()}
            except Exception as exc:
                out = {"exc": type(exc).__name__, "msg": str(exc)}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    return r, pid


def _collect(r, pid, server=None, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server is not None:
            server.poll(0.05)
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01 if server is None else 0)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    return json.loads(data)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to fork a child as uid 65534")


@needs_root
def test_unauthorized_peer_is_refused_by_so_peercred(sockdir):
    handler = Recorder()
    path = os.path.join(sockdir, "ctl.sock")
    server = ControlServer(path, handler, group="ulyssesd-test-nonexistent")
    try:
        os.chmod(path, 0o666)  # open the file gate: the SO_PEERCRED gate alone must refuse
        r, pid = _as_nobody(lambda: send_request(path, {"cmd": "pause"}))
        out = _collect(r, pid, server)
        assert out["result"] == {"ok": False, "code": "permission_denied",
                                 "error": "permission denied: uid 65534 is not root or in group ulyssesd-test-nonexistent"}
        assert handler.requests == [] and handler.paused is False  # nothing changed
        # Positive control: the same uid allowed explicitly gets through.
        server.close()
        server = ControlServer(path, handler, group=None, allowed_uids={NOBODY})
        os.chmod(path, 0o666)
        r, pid = _as_nobody(lambda: send_request(path, {"cmd": "pause"}))
        assert _collect(r, pid, server)["result"]["state"] == "PAUSED"
        assert handler.requests[-1]["peer"]["uid"] == NOBODY
    finally:
        server.close()


@needs_root
def test_file_mode_0660_keeps_others_out(sockdir):
    path = os.path.join(sockdir, "ctl.sock")
    server = ControlServer(path, Recorder(), group=None)
    try:
        r, pid = _as_nobody(lambda: send_request(path, {"cmd": "status"}))
        out = _collect(r, pid, server)
        assert out["exc"] == ControlPermissionError.__name__ and "permission denied connecting to" in out["msg"]
    finally:
        server.close()


def test_parse_request_and_resolve_path(monkeypatch, tmp_path):
    assert parse_request(b'{"cmd":"ack","args":{"id":3}}') == ({"cmd": "ack", "args": {"id": 3}}, None)
    assert parse_request(b'{"cmd":"status"}') == ({"cmd": "status", "args": {}}, None)
    monkeypatch.delenv("ULYSSESD_SOCKET", raising=False)
    assert resolve_socket_path(tmp_path) == tmp_path / "ulyssesd.sock"
    assert str(resolve_socket_path()) == "/run/ulyssesd/ulyssesd.sock"
    monkeypatch.setenv("ULYSSESD_SOCKET", "/x/y.sock")
    assert str(resolve_socket_path(tmp_path)) == "/x/y.sock"
    assert str(resolve_socket_path(tmp_path, explicit="/a.sock")) == "/a.sock"


def test_find_socket_path_falls_back_to_the_units_socket(monkeypatch, tmp_path):
    import ulyssesd.daemon.control_socket as cs

    monkeypatch.delenv("ULYSSESD_SOCKET", raising=False)
    system = tmp_path / "run" / "ulyssesd.sock"
    monkeypatch.setattr(cs, "SYSTEM_SOCKET_PATH", str(system))
    assert find_socket_path(tmp_path) == tmp_path / "ulyssesd.sock"  # neither exists: the state dir's
    system.parent.mkdir()
    system.touch()
    assert find_socket_path(tmp_path) == system  # only the unit's exists
    (tmp_path / "ulyssesd.sock").touch()
    assert find_socket_path(tmp_path) == tmp_path / "ulyssesd.sock"  # the state dir's wins when present
    assert find_socket_path(tmp_path, explicit="/x.sock") == Path("/x.sock")


def test_connection_flood_gets_busy_not_a_hang(sockdir):
    path = os.path.join(sockdir, "ctl.sock")
    server = ControlServer(path, Recorder(), max_connections=2, read_timeout_s=5)
    socks = []
    try:
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(path)
            socks.append(s)
        server.poll(0.2)
        answer = json.loads(socks[2].recv(4096))
        assert answer["code"] == "busy" and "max 2" in answer["error"]
    finally:
        for s in socks:
            s.close()
        server.close()


def test_signal_wakeup_fd_ends_poll_like_the_main_loop_needs(sockdir):
    import signal

    server = ControlServer(os.path.join(sockdir, "ctl.sock"), Recorder())
    queued = []
    old_handler = signal.signal(signal.SIGUSR2, lambda signum, frame: queued.append(signum))  # only enqueue
    old_fd = signal.set_wakeup_fd(server.wakeup_fileno)
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        t0 = time.monotonic()
        server.poll(5.0)
        assert time.monotonic() - t0 < 2 and queued == [signal.SIGUSR2]
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR2, old_handler)
        server.close()
