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

from ulyssesd.daemon.control.client import send_request
from ulyssesd.daemon.control.paths import find_socket_path, resolve_socket_path
from ulyssesd.daemon.control.peers import Peer, PeerAuthorizer
from ulyssesd.daemon.control.protocol import (
    ControlPermissionError,
    ControlSocketError,
    ControlTimeout,
    DaemonNotRunning,
    parse_request,
)
from ulyssesd.daemon.control.server import ControlServer

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
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered (e.g. refused at accept) and closed before reading it all: read the answer
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
    # A short message, no exception text (it may carry paths or internals); the daemon log has the traceback.
    assert resp == {"ok": False, "code": "internal",
                    "error": "internal error handling 'boom' (RuntimeError); see the daemon log"}
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
    import ulyssesd.daemon.control.paths as cs

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


# ------------------------------------------------------------------ hostile input (issue 13 regressions)
def test_deeply_nested_request_is_bad_request_and_the_server_lives(running):
    path, handler, _ = running
    for depth in (50_000 // 2, 9):  # json.loads alone would raise RecursionError on the first
        body = b'{"cmd": "status", "args": {"x": ' + b"[" * depth + b"]" * depth + b"}}\n"
        resp = _raw(path, body)
        assert resp["code"] == "bad_request" and "nests deeper than 8 levels" in resp["error"]
    assert handler.requests == []
    # Healthy control: a request at the allowed depth still goes through.
    assert send_request(path, {"cmd": "status", "args": {"x": [[[[1]]]]}})["ok"] is True


def test_unauthorized_peer_is_refused_before_anything_is_read(sockdir, monkeypatch):
    import ulyssesd.daemon.control.server as cs

    parsed = []
    monkeypatch.setattr(cs, "parse_request", lambda *a: parsed.append(a) or pytest.fail("parsed a refused peer"))
    handler = Recorder()
    path = os.path.join(sockdir, "ctl.sock")
    me = os.geteuid()
    # An authorizer that rejects the test's own uid stands in for a foreign local user.
    loop = Loop(ControlServer(path, handler, authorize=lambda peer: f"permission denied: uid {peer.uid} (test)"
                              if peer.uid == me else None))
    try:
        deep = b'{"cmd": "pause", "args": ' + b"[" * 40_000 + b"]" * 40_000 + b"}\n"
        resp = _raw(path, deep[:60_000])
        assert resp == {"ok": False, "code": "permission_denied", "error": f"permission denied: uid {me} (test)"}
        assert _raw(path, b'{"cmd": "pause"}\n')["code"] == "permission_denied"
        assert parsed == [] and handler.requests == [] and handler.paused is False
        assert loop.server.refused == 2
    finally:
        loop.close()


def test_authorizer_that_raises_refuses_and_the_server_lives(sockdir):
    def broken(peer):
        raise OSError("NSS lookup timed out")

    path = os.path.join(sockdir, "ctl.sock")
    loop = Loop(ControlServer(path, Recorder(), authorize=broken))
    try:
        resp = send_request(path, {"cmd": "status"})
        assert resp["code"] == "permission_denied" and "cannot check uid" in resp["error"]
        assert "NSS" not in resp["error"]
        assert send_request(path, {"cmd": "status"})["code"] == "permission_denied"  # still serving
    finally:
        loop.close()


@pytest.mark.parametrize("deadline, fragment", [
    ("soon", "'deadline' must be epoch seconds"), (True, "'deadline' must be epoch seconds"),
    (10**400, "'deadline' must be epoch seconds"), ([1], "'deadline' must be epoch seconds"),
])
def test_bad_deadline_is_bad_request(running, deadline, fragment):
    path, handler, _ = running
    line = b'{"cmd": "pause", "deadline": ' + json.dumps(deadline).encode() + b"}\n"
    resp = _raw(path, line)
    assert resp["code"] == "bad_request" and fragment in resp["error"]
    assert handler.requests == [] and not handler.paused


def test_request_past_its_deadline_is_never_applied(sockdir):
    handler = Recorder()
    path = os.path.join(sockdir, "ctl.sock")
    server = ControlServer(path, handler)  # not polled while the client waits: a stopped or busy main loop
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlTimeout, match="will not apply it later"):
            send_request(path, {"cmd": "pause"}, timeout_s=0.3, with_deadline=True)
        waited = time.monotonic() - t0
        assert 0.3 + 2.0 - 0.1 <= waited < 0.3 + 2.0 + 1.5  # the deadline plus the answer grace
        assert server.poll(0.5) == 1  # the loop wakes up and handles the queued request...
        assert handler.requests == [] and handler.paused is False  # ...without applying it
        # Positive control: a request handled before its deadline is applied and its answer arrives.
        loop = Loop(server)
        try:
            assert send_request(path, {"cmd": "pause"}, timeout_s=2.0, with_deadline=True)["state"] == "PAUSED"
            assert handler.paused and "deadline" not in handler.requests[-1]
        finally:
            loop.stop.set()
            loop.thread.join(5)
    finally:
        server.close()


def test_expired_answer_names_the_lateness(running):
    path, handler, _ = running
    resp = _raw(path, json.dumps({"cmd": "pause", "deadline": time.time() - 30}).encode() + b"\n")
    assert resp["code"] == "expired" and "after its deadline" in resp["error"] and "not applied" in resp["error"]
    assert handler.requests == []


_CHILD_DAEMON = r"""
import json, sys
from ulyssesd.daemon.control.server import ControlServer
path, applied = sys.argv[1], sys.argv[2]
def handler(req):
    if req["cmd"] != "status":
        with open(applied, "a") as fh:
            fh.write(req["cmd"] + "\n")
    return {"ok": True, "status": {"state": "RUNNING"}}
server = ControlServer(path, handler, group=None)
print("ready", flush=True)
while True:
    server.poll(0.05)
"""


def test_sigstopped_daemon_status_says_not_responding_and_a_timed_out_pause_is_never_applied(sockdir, tmp_path):
    """A real process serves the socket; SIGSTOP it: `ulyssesctl status` must not say "not running", and a
    pause the client gave up on must not be carried out after SIGCONT."""
    import signal
    import subprocess
    import sys

    from ulyssesd.daemon.operator.ctl import EXIT_NOT_RESPONDING, main
    from ulyssesd.daemon.store import open_store

    path = os.path.join(sockdir, "ctl.sock")
    applied = tmp_path / "applied.txt"
    applied.touch()
    child = subprocess.Popen([sys.executable, "-c", _CHILD_DAEMON, path, str(applied)], stdout=subprocess.PIPE,
                             text=True)
    state = tmp_path / "state"
    state.mkdir()
    try:
        assert child.stdout.readline().strip() == "ready"
        db = state / "ulyssesd.db"
        with open_store(db) as store:
            store.create_run("r1", run_dir=str(state / "runs" / "r1"))
        (state / "ulyssesd.daemon.json").write_text(json.dumps(
            {"pid": child.pid, "socket": path, "run_id": "r1", "db": str(db)}))
        sd = ["--state-dir", str(state)]

        def status():
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = main([*sd, "status", "--json"])
            return code, json.loads(buf.getvalue())

        code, st = status()  # healthy control: the live daemon answers
        assert code == 0 and st["daemon"] == "running"
        os.kill(child.pid, signal.SIGSTOP)
        try:
            code, st = status()
            assert code == EXIT_NOT_RESPONDING and st["daemon"] == "not responding (stopped or busy)"
            assert st["daemon_pid"] == child.pid
            with pytest.raises(ControlTimeout, match="will not apply it later"):
                send_request(path, {"cmd": "pause"}, timeout_s=0.3, with_deadline=True)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.5)  # the woken loop now handles the queued pause: refused as expired
        assert send_request(path, {"cmd": "status"})["ok"] is True
        assert applied.read_text() == ""
        assert send_request(path, {"cmd": "pause"}, timeout_s=5, with_deadline=True)["ok"] is True
        assert applied.read_text() == "pause\n"  # positive control: an in-time pause is applied
        child.kill()
        child.wait(5)
        code, st = status()  # process gone, socket file left behind: "not running"
        assert code == 0 and st["daemon"] == "not running"
    finally:
        child.kill()
        child.wait(5)


def test_status_survives_a_poisoned_telemetry_tail_and_daemon_info(tmp_path):
    """`ulyssesctl status` reads the telemetry tail and the daemon info file itself: hostile content there
    (a 50,000-deep line, a JSON list as the info file) must not give a traceback."""
    import contextlib
    import io

    from ulyssesd.daemon.operator.ctl import main
    from ulyssesd.daemon.store import open_store

    state = tmp_path / "state"
    run_dir = state / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "telemetry.jsonl").write_bytes(b'{"kind": "step", "step": 4, "loss": 1.5}\n'
                                              + b"[" * 50_000 + b"]" * 50_000 + b"\n")
    with open_store(state / "ulyssesd.db") as store:
        store.create_run("r1", run_dir=str(run_dir))
    (state / "ulyssesd.daemon.json").write_text("[1, 2]")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--state-dir", str(state), "status", "--json"]) == 0
    st = json.loads(buf.getvalue())
    assert st["step"] == 4 and st["daemon"] == "not running"


def test_a_refused_client_still_sending_gets_the_answer_not_epipe(sockdir):
    """Refused at accept, the connection stays open (unread) a moment: a plain client that sends its request
    after the server has already answered gets the answer, not a broken pipe."""
    path = os.path.join(sockdir, "ctl.sock")
    server = ControlServer(path, Recorder(), authorize=lambda peer: "permission denied: test")
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        assert server.poll(0.5) == 1  # accepted, refused and answered before the client sent anything
        s.sendall(b'{"cmd": "stop"}\n' * 100)  # would raise BrokenPipeError if the server had closed
        assert json.loads(s.recv(4096))["code"] == "permission_denied"
        assert s.recv(4096) == b""  # then EOF: the server half-closed
        s.close()
        time.sleep(1.1)
        server.poll(0)
        assert server._lingering == []  # closed after the linger time
    finally:
        server.close()
