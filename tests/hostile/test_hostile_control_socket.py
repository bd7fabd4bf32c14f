"""The control socket under hostile clients (an outside check of daemon/control/ after its split): a request
sent in many small frames, a slowloris client trickling bytes, a flood of concurrent connections. Real unix
sockets, the real ControlServer polled by a thread that stands in for the daemon's main loop."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ulyssesd.daemon.control.client import send_request
from ulyssesd.daemon.control.server import ControlServer


class _Loop:
    """Polls the server in a thread, like the supervisor's main loop (poll doubles as its sleep)."""

    def __init__(self, server: ControlServer):
        self.server = server
        self.handled: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.server.poll(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


@pytest.fixture
def sockdir():
    path = tempfile.mkdtemp(prefix="uhs-")  # AF_UNIX paths are at most 107 bytes; tmp_path can be longer
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def serve(sockdir):
    loops: list[_Loop] = []

    def start(**kw) -> tuple[str, _Loop]:
        path = os.path.join(sockdir, "ctl.sock")
        box: list[_Loop] = []

        def handler(request: dict) -> dict:
            box[0].handled.append(request)
            return {"ok": True, "echo": request["args"]}

        loop = _Loop(ControlServer(path, handler, group=None, **kw))
        box.append(loop)
        loops.append(loop)
        return path, loop

    yield start
    for loop in loops:
        loop.close()


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def _answer(s: socket.socket) -> dict:
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return json.loads(buf)


def test_a_request_in_many_partial_frames_is_assembled_and_answered_once(serve):
    path, loop = serve(read_timeout_s=5.0)
    request = (json.dumps({"cmd": "status", "args": {"note": "x" * 3000}}) + "\n").encode()
    s = _connect(path)
    try:
        for i in range(0, len(request), 97):  # 97-byte frames with pauses: the server must not answer early
            s.sendall(request[i:i + 97])
            time.sleep(0.002)
        answer = _answer(s)
    finally:
        s.close()
    assert answer["ok"] is True and answer["echo"] == {"note": "x" * 3000}
    assert len(loop.handled) == 1
    # Healthy control: an incomplete frame that is then abandoned (EOF) is no request and is never handled.
    s = _connect(path)
    s.sendall(request[: len(request) // 2])
    s.shutdown(socket.SHUT_WR)
    assert _answer(s)["code"] == "bad_request"
    s.close()
    assert len(loop.handled) == 1


def test_a_slowloris_client_is_cut_off_at_the_read_timeout_however_it_trickles(serve):
    """The read deadline is set at accept and never extended by a trickled byte; meanwhile another client is
    served at once."""
    path, loop = serve(read_timeout_s=0.6)
    slow = _connect(path)
    stop = threading.Event()
    answer_at: list[float] = []

    def trickle() -> None:
        prefix = b'{"cmd": "status", "args": {"pad": "'
        t0 = time.monotonic()
        try:
            slow.sendall(prefix)
            while not stop.is_set() and time.monotonic() - t0 < 5:
                slow.sendall(b"a")
                time.sleep(0.05)
        except OSError:
            pass  # the server closed it: what must happen

    t0 = time.monotonic()
    th = threading.Thread(target=trickle)
    th.start()
    try:
        time.sleep(0.2)
        t1 = time.monotonic()
        assert send_request(path, {"cmd": "status", "args": {}})["ok"] is True
        other_s = time.monotonic() - t1
        timeout_answer = _answer(slow)
        answer_at.append(time.monotonic() - t0)
    finally:
        stop.set()
        th.join(10)
        slow.close()
    assert other_s < 0.5, f"a second client waited {other_s:.2f} s behind the slowloris"
    assert timeout_answer["code"] == "timeout"
    assert answer_at[0] < 2.0, f"the trickling client was held {answer_at[0]:.2f} s (read timeout 0.6 s)"
    assert len(loop.handled) == 1  # only the honest request


def test_a_flood_of_concurrent_connections_is_bounded_and_every_client_is_answered(serve):
    """300 clients at once against max_connections=16: each one gets an answer (ok or busy, never a hang or a
    reset), the server never holds more than its bound, no file descriptor leaks, and once the flood is over
    the next client is served at once."""
    path, loop = serve(read_timeout_s=2.0, max_connections=16)
    fds_before = len(os.listdir("/proc/self/fd"))
    peak = [0]
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            peak[0] = max(peak[0], len(loop.server._conns))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()

    def one(i: int) -> str:
        try:
            r = send_request(path, {"cmd": "status", "args": {"i": i}}, timeout_s=10)
        except Exception as exc:  # noqa: BLE001 - counted: a client that got no answer fails the test
            return f"error {type(exc).__name__}: {exc}"
        return "ok" if r.get("ok") else str(r.get("code"))

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=64) as pool:
        outcomes = list(pool.map(one, range(300)))
    flood_s = time.monotonic() - t0
    watching.set()
    watcher.join()
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    assert set(counts) <= {"ok", "busy"}, counts
    assert counts.get("ok", 0) >= 16 and peak[0] <= 16, (counts, peak)
    assert len(loop.handled) == counts["ok"]
    t1 = time.monotonic()
    assert send_request(path, {"cmd": "status", "args": {}})["ok"] is True
    after_s = time.monotonic() - t1
    assert after_s < 0.5
    time.sleep(0.2)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2, "file descriptors leaked"
    print(f"\n300 concurrent clients: {counts} in {flood_s:.2f} s; peak held {peak[0]}; next client {after_s*1000:.0f} ms")


def test_idle_connections_holding_every_slot_get_the_next_client_busy_at_once_not_a_hang(serve):
    """16 silent connections take every slot: a 17th client is told `busy` at once (never left waiting), and
    is served as soon as the silent ones time out."""
    path, _ = serve(read_timeout_s=1.0, max_connections=16)
    hogs = [_connect(path) for _ in range(16)]
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        busy = send_request(path, {"cmd": "status", "args": {}}, timeout_s=5)
        busy_s = time.monotonic() - t0
        assert busy["code"] == "busy" and busy_s < 0.5
        deadline = time.monotonic() + 5
        while (r := send_request(path, {"cmd": "status", "args": {}}, timeout_s=5)).get("code") == "busy":
            assert time.monotonic() < deadline, "still busy long after the hogs' read timeout"
            time.sleep(0.1)
        assert r["ok"] is True
        assert all(_answer(h)["code"] == "timeout" for h in hogs)
    finally:
        for h in hogs:
            h.close()


def test_ulyssesctl_pause_rides_out_a_burst_that_takes_every_slot(serve, tmp_path, capsys):
    """A mutating command that meets `busy` retries with backoff (bounded) instead of failing with exit 5:
    busy is answered before the daemon reads a byte, so the retry cannot apply the pause twice."""
    from ulyssesd.daemon.operator.ctl import main

    path, loop = serve(read_timeout_s=1.0, max_connections=4)
    hogs = [_connect(path) for _ in range(4)]
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        code = main(["--state-dir", str(tmp_path), "--socket", path, "pause", "--json"])
        took = time.monotonic() - t0
    finally:
        for h in hogs:
            h.close()
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"] is True, doc
    assert 0.5 < took < 5.0, f"took {took:.2f} s"  # waited out the hogs' 1 s read timeout, no longer
    assert [r["cmd"] for r in loop.handled] == ["pause"]  # applied exactly once
