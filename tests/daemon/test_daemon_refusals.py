"""Bad inputs get a clear error and change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from uls_daemon_helpers import fake_spec

from ulyssesd.daemon.store import open_store


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def _request_as_uid(sock: str, payload: dict, uid: int) -> dict:
    """Fork, drop to `uid`, send one request over the socket with the stdlib only, return the answer."""
    import socket as _socket

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            c = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            c.settimeout(10)
            c.connect(sock)
            c.sendall((json.dumps(payload) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
            os.write(w, data or b'{"ok": null, "error": "no answer"}')
        except BaseException as exc:  # noqa: BLE001
            os.write(w, json.dumps({"ok": None, "error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    buf = b""
    while chunk := os.read(r, 65536):
        buf += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(buf)


def test_malformed_spec_clear_error_nothing_created(tmp_path):
    spec = fake_spec(tmp_path)
    spec.write_text(spec.read_text().replace("[train]\n", "[train]\nstepz = 5\nseq_len = -3\n"))
    r = _run(["run", "--spec", str(spec)])
    assert r.returncode == 2, r.stderr
    assert "train.stepz" in r.stderr and "train.seq_len" in r.stderr
    assert not (tmp_path / "state").exists()


def test_unparseable_toml_clear_error(tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text("[train\nsteps = 3\n")
    r = _run(["run", "--spec", str(spec), "--state-dir", str(tmp_path / "state")])
    assert r.returncode == 2 and "bad.toml" in r.stderr
    assert not (tmp_path / "state").exists()


def test_unusable_checkpoint_dir_refused_before_anything_starts(tmp_path):
    not_a_dir = tmp_path / "ckpts"
    not_a_dir.write_text("I am a file")
    spec = fake_spec(tmp_path)
    spec.write_text(spec.read_text().replace("[checkpoint]\n", f'[checkpoint]\ndir = "{not_a_dir}"\n'))
    r = _run(["run", "--spec", str(spec)])
    assert r.returncode == 2, r.stderr
    assert "checkpoint.dir" in r.stderr and "not a directory" in r.stderr
    assert not (tmp_path / "state" / "ulyssesd.db").exists()
    assert not_a_dir.read_text() == "I am a file"


def test_ctl_readonly_commands_without_daemon_or_database(tmp_path):
    from ulyssesd.daemon.operator.ctl import main

    assert main(["--state-dir", str(tmp_path), "status"]) == 20  # no database: a store code, not "not found"
    assert main(["--state-dir", str(tmp_path), "pause"]) == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_unauthorized_socket_peer_is_refused_and_nothing_changes(tmp_path):
    spec = fake_spec(tmp_path, steps=2000, interval=100, daemon={"socket_group": ""})
    log = open(tmp_path / "daemon.log", "wb")
    d = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = tmp_path / "state" / "ulyssesd.daemon.json"
        deadline = time.monotonic() + 60
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert info.exists()
        sock = __import__("json").loads(info.read_text())["socket"]
        os.chmod(os.path.dirname(sock), 0o755)
        os.chmod(sock, 0o666)  # let the file gate pass: the peer-credential check must still refuse
        out = _request_as_uid(sock, {"cmd": "stop"}, 65534)
        assert out.get("ok") is False and "permission" in json.dumps(out), out
        store = open_store(tmp_path / "state" / "ulyssesd.db", readonly=True)
        run = store.latest_run()
        assert run.state.value in ("STARTING", "RUNNING")
        # the authorized owner (root) is still served
        from ulyssesd.daemon.control.client import send_request
        assert send_request(sock, {"cmd": "stop"})["ok"]
        assert d.wait(60) == 0
        assert open_store(tmp_path / "state" / "ulyssesd.db", readonly=True).latest_run().state.value == "STOPPED"
    finally:
        if d.poll() is None:
            d.kill()
