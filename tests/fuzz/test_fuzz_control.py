"""Fuzz: the control protocol. parse_request never raises and only lets well-formed envelopes through; a live
ControlServer (real unix socket, polled on this thread like the main loop) answers every request with one JSON
object carrying a known code, never lets an unauthorized peer's bytes reach the handler, and survives a
handler that raises."""

from __future__ import annotations

import json
import math
import os
import socket

from fuzz_helpers import MIN_CASES, fuzz_settings, variants
from fuzz_strategies import control_requests
from hypothesis import given, settings

from ulyssesd.daemon.control.protocol import CMD_RE, parse_request
from ulyssesd.daemon.control.server import ControlServer

# Real socket round trips cost ~1 ms each: the volume (MIN_CASES) is parse_request's above, in-process; the
# live server gets a fifth of it through the socket, with the same hostile requests.
LIVE_CASES = MIN_CASES // 5
LIVE_SETTINGS = settings(fuzz_settings(1), max_examples=int(LIVE_CASES / 2.5 * 1.1) + 1)

CODES = {"bad_request", "permission_denied", "expired", "busy", "timeout", "internal", "unknown_command"}


def _check_parse(line: bytes) -> dict | None:
    request, problem = parse_request(line)
    if problem is None:
        assert set(request) <= {"cmd", "args", "deadline"} and CMD_RE.match(request["cmd"])
        assert isinstance(request["args"], dict)
        assert "deadline" not in request or math.isfinite(request["deadline"])
        return request
    assert isinstance(problem, str) and 0 < len(problem) < 1000  # a short message naming the problem
    return None


def test_parse_request_never_raises_and_passes_only_valid_envelopes():
    cases = [0]

    @fuzz_settings(cases_per_example=6)
    @given(line=control_requests())
    def run(line):
        for v in variants(line):
            _check_parse(v)
            cases[0] += 1

    run()
    assert cases[0] >= MIN_CASES


class _Handler:
    def __init__(self):
        self.seen = 0

    def __call__(self, request):
        self.seen += 1
        if request["cmd"] == "boom":
            raise RuntimeError("handler bug /secret/path")
        if request["cmd"] == "ack":
            return {"ok": True, "id": request["args"].get("id")}
        if request["cmd"] in ("status", "pause"):
            return {"ok": True, "state": "RUNNING"}
        return {"ok": False, "code": "unknown_command", "error": f"unknown command {request['cmd']!r}"}


def _roundtrip(server: ControlServer, path: str, line: bytes) -> dict:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(5)
    try:
        client.connect(path)  # the listen backlog holds it until the poll below accepts
        client.sendall(line + b"\n")
        for _ in range(50):
            if server.poll(0.1):
                break
        buf = b""
        while b"\n" not in buf:
            chunk = client.recv(65536)
            if not chunk:
                break
            buf += chunk
    finally:
        client.close()
    return json.loads(buf)


def test_live_server_answers_every_request_with_a_known_code_and_stays_up(sockdir):
    handler = _Handler()
    path = os.path.join(sockdir, "ctl.sock")
    me = os.getpid()
    refused = {"on": False}  # flipped per case: the same socket, with the test's uid refused or allowed
    server = ControlServer(path, handler, group=None,
                           authorize=lambda peer: "permission denied: test" if refused["on"] else None)
    cases = [0]
    try:
        @LIVE_SETTINGS
        @given(line=control_requests())
        def run(line):
            for i, v in enumerate(variants(line, n_cuts=1, n_flips=1)):
                refused["on"] = (len(v) + i) % 7 == 0
                before = handler.seen
                resp = _roundtrip(server, path, v)
                assert isinstance(resp, dict) and isinstance(resp.get("ok"), bool)
                if refused["on"]:
                    assert resp["code"] == "permission_denied" and handler.seen == before  # never handled
                elif not resp["ok"]:
                    assert resp["code"] in CODES and isinstance(resp["error"], str)
                    assert "secret" not in resp["error"]  # no exception text leaks
                    if resp["code"] == "internal":
                        assert "see the daemon log" in resp["error"]
                if handler.seen > before:
                    assert _check_parse(v) is not None  # only valid envelopes reach the handler
                cases[0] += 1

        run()
        refused["on"] = False
        assert server.poll(0) == 0 and not server._conns  # nothing left dangling
        assert _roundtrip(server, path, b'{"cmd": "status"}')["ok"] is True  # still serving
        assert me == os.getpid()
    finally:
        server.close()
    assert cases[0] >= LIVE_CASES
