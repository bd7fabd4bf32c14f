"""Hardening round 3's probes against single surfaces (issue "the chatty hang, the odd line, the full disk,
the lost socket"): the stack reader on text with no thread header and on any text at all, `ulyssesctl logs`
and terminal escapes, the Reporter's torn tail, a deleted control socket, the daemon's own adoption command
(its run lock taken twice), 3,000 slow connections to the metrics port, one 200 MB JSONL line and a
SIGKILLed `ulysses-preprocess`. Each reproduces the probe as it was reported."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from ulyssesd.daemon.control import server as control_server
from ulyssesd.daemon.control.client import send_request
from ulyssesd.daemon.control.server import ControlServer
from ulyssesd.daemon.host.locks import InstanceLocks, LockHeld
from ulyssesd.daemon.host.metrics import Metrics
from ulyssesd.daemon.operator.ctl import main as ctl_main
from ulyssesd.remediation.hang_stacks import read_hang, read_rank

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------- the chatty hang
CHATTY = "".join(f"[rank0]: NCCL WARN waiting for peer, retrying... ({i})\n" for i in range(200))


def test_a_chatty_hang_log_with_no_thread_header_is_read_not_raised():
    # The probe: a job stalled in a collective keeps logging; the excerpt has no faulthandler header.
    r = read_hang({}, unattributed=CHATTY)
    assert r.label is None and r.ranks and "no rank is inside a collective" in r.summary
    r = read_hang({0: CHATTY, 1: "  File \"/x/torch/distributed/c10d.py\", line 3 in all_reduce\n"})
    assert r.label == "nccl_timeout" and r.waited_for == (0,)  # frames without a header still count
    # The healthy case is unchanged: a real dump is still read.
    dump = ("Current thread 0x00007f948af76140 (most recent call first):\n"
            '  File "/s/torch/distributed/distributed_c10d.py", line 4000 in all_reduce\n'
            '  File "/s/ulyssesd/training/train.py", line 420 in step\n')
    assert read_rank(dump, 0).in_collective


def test_stack_reading_never_raises_on_any_text():
    """A property test: random mixes of thread headers, frames, garbage and NULs never raise."""
    pieces = ["Current thread 0x00007f (most recent call first):\n", "Thread 0xdead (most recent call first):\n",
              '  File "/a/torch/distributed/x.py", line 1 in all_reduce\n', '  File "/a/ulyssesd/training/t.py", '
              'line 9 in loop\n', '  File "', 'line x in\n', "NCCL WARN retrying\n", "\x00\xff\ufffd", "\n", "",
              "  <no Python frame>\n", "Thread 0x", "(most recent call first):"]
    rng = random.Random(31)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        per_rank = {rng.randint(-2, 4): text for _ in range(rng.randint(0, 3))}
        r = read_hang(per_rank, unattributed=text[::-1])
        assert r.label in (None, "nccl_timeout") and isinstance(r.summary, str)
        read_rank(text, None)
    for _ in range(500):  # raw random characters
        text = "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 300)))
        read_hang({0: text}, unattributed=text)


# ---------------------------------------------------------------------------------- ulyssesctl logs
def test_logs_show_terminal_escapes_as_text_never_executed(tmp_path, capsysbinary):
    state = tmp_path / "state"
    logs = state / "runs" / "r1" / "logs"
    logs.mkdir(parents=True)
    hostile = (b"\x1b]0;pwned title\x07step 1 loss 2.0\n"  # window title
               b"\x1b[2J\x1b[Hcleared\n"  # clear screen, cursor home
               b"\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\\n"  # hyperlink
               b"real line\roverwritten\n"  # a carriage return hiding what was printed
               + "\u009b31mC1 CSI\n".encode() + "caf\u00e9 \u2713 ok\ttab\r\n".encode())
    (logs / "attempt-1.log").write_bytes(hostile)
    assert ctl_main(["--state-dir", str(state), "logs", "r1"]) == 0
    out = capsysbinary.readouterr().out
    assert b"\x1b" not in out and b"\x07" not in out and b"\x9b" not in out
    assert b"\\x1b]0;pwned title\\x07step 1 loss 2.0\n" in out and b"real line\\roverwritten\n" in out
    assert "caf\u00e9 \u2713 ok\ttab\r\n".encode() in out  # text, tabs and CRLF endings untouched
    assert ctl_main(["--state-dir", str(state), "logs", "r1", "--raw"]) == 0
    assert capsysbinary.readouterr().out == hostile


# ------------------------------------------------------------------------------------- torn writes
_KILLED_WRITER = """
import os, sys, time
from ulyssesd.client.reporter import Reporter, ReporterConfig
r = Reporter(sys.argv[1], attempt=int(sys.argv[2]), rank=0, config=ReporterConfig(synchronous=True))
r.step(1, 2.5)
# What a kill mid-write leaves: the first bytes of a record, no newline.
r._fh.write('{"v": 1, "kind": "step", "time": 1.0, "attempt": %s, "st' % sys.argv[2])
r._fh.flush()
os.kill(os.getpid(), 9)
"""


def test_a_reporter_killed_mid_line_does_not_cost_the_next_attempt_its_first_record(tmp_path):
    from ulyssesd.client.reporter import Reporter, ReporterConfig
    from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader

    path = tmp_path / "telemetry.jsonl"
    p = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path), "1"], capture_output=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not path.read_bytes().endswith(b"\n")  # the probe's torn tail
    r = Reporter(path, attempt=2, rank=0, config=ReporterConfig(synchronous=True))
    assert r.repaired_tail
    r.event("started", 0)
    r.step(1, 2.4)
    r.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[1].startswith(b'{"v": 1, "kind": "step"') and not lines[1].endswith(b"}")  # the fragment alone
    records = [rec for rec, _ in TelemetryReader(path).read()]
    assert [(getattr(x, "attempt", None), getattr(x, "step", None)) for x in records] == [(1, 1), (2, 0), (2, 1)]
    # A healthy file is not touched: no blank line is added before the next append.
    size = path.stat().st_size
    r = Reporter(path, attempt=3, rank=0, config=ReporterConfig(synchronous=True))
    assert not r.repaired_tail and path.stat().st_size == size
    r.close()


# ------------------------------------------------------------------------------ the lost socket
def test_a_deleted_control_socket_is_bound_again_on_the_next_check(monkeypatch):
    monkeypatch.setattr(control_server, "SOCKET_CHECK_S", 0.2)
    path = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    server = ControlServer(path, lambda req: {"ok": True, "pong": req["cmd"]}, group=None)
    stop = threading.Event()
    loop = threading.Thread(target=lambda: [server.poll(0.05) for _ in iter(stop.is_set, True)], daemon=True)
    loop.start()
    try:
        assert send_request(str(path), {"cmd": "status"})["pong"] == "status"
        os.unlink(path)  # a tmp cleaner, an operator's rm
        deadline = time.monotonic() + 5
        while not path.exists():
            assert time.monotonic() < deadline, "socket not recreated"
            time.sleep(0.05)
        assert send_request(str(path), {"cmd": "status"})["pong"] == "status"
        assert server.rebinds == 1 and oct(path.stat().st_mode & 0o777) == oct(0o660)
        # A path taken by something else is never replaced.
        os.unlink(path)
        path.write_text("not ours")
        time.sleep(0.6)
        assert path.read_text() == "not ours" and server.rebinds == 1
    finally:
        stop.set()
        loop.join(5)
        server.close()


# ------------------------------------------------------------------------------- adoption, twice
def test_the_run_lock_taken_again_by_the_same_daemon_is_not_another_ulyssesd(tmp_path):
    """The adoption command the daemon prints (`--run-id X` of a run directory the store lost) locked the
    run twice (adopt_run_dir, then adopt) and failed against its own lock; another process still cannot."""
    state, run_dir = tmp_path / "state", tmp_path / "state" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    locks = InstanceLocks(state, {"state_dir": str(state)})
    locks.lock_state_dir()
    locks.lock_run(run_dir, "r1")
    locks.lock_run(run_dir, "r1")  # the second call is a no-op, not LockHeld
    assert len(locks.held) == 2
    other = InstanceLocks(state / "x")
    with pytest.raises(LockHeld):
        other.lock_run(run_dir, "r1")
    probe = subprocess.run([sys.executable, "-c", (
        "import sys; from pathlib import Path; from ulyssesd.daemon.host.locks import InstanceLocks, LockHeld\n"
        "try:\n InstanceLocks(Path(sys.argv[1])).lock_run(Path(sys.argv[2]), 'r1')\n"
        "except LockHeld as e:\n print('held', e); sys.exit(12)\n"), str(state), str(run_dir)],
        capture_output=True, text=True, timeout=60)
    assert probe.returncode == 12 and f"pid {os.getpid()}" in probe.stdout
    locks.release()


# --------------------------------------------------------------------------------------- metrics
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_slow_connections_to_the_metrics_port_do_not_make_threads_and_scrapes_recover():
    port = _free_port()
    m = Metrics(port=port)
    before = threading.active_count()
    assert m.start()
    conns: list[socket.socket] = []
    try:
        m.update(step=5)
        started = threading.active_count()
        assert started - before <= 1 + 4 + 1  # the accept thread and at most the worker pool
        for _ in range(3000):  # the probe: 3,000 slow connections that send one byte and then nothing
            try:
                c = socket.create_connection(("127.0.0.1", port), timeout=2)
                c.send(b"G")
                conns.append(c)
            except OSError:
                break  # the listen backlog is full: that is the bound working
        time.sleep(0.5)
        assert threading.active_count() - before <= 1 + 4 + 1, threading.active_count()
        assert m._server is not None and m._server.refused > 0
        for c in conns:
            c.close()
        conns.clear()
        deadline = time.monotonic() + 30
        while True:  # the slow ones time out (request_timeout_s) and a scrape is answered again
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "metrics never answered again"
                time.sleep(0.5)
        assert "ulyssesd_step 5.0" in body
        # A slowloris scrape (one byte every 0.5 s) is cut off at the request timeout, not held forever.
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        t0 = time.monotonic()
        try:
            for ch in b"GET /metrics HTTP/1.1\r\n":
                s.send(bytes([ch]))
                time.sleep(0.5)
        except OSError:
            pass
        assert time.monotonic() - t0 < 9
        s.close()
    finally:
        for c in conns:
            c.close()
        m.close()


# ---------------------------------------------------------------------------------- preprocessing
def _tokenizer(tmp: Path) -> Path:
    from ulyssesd.training.data.tokenizer import train_bpe

    tok = tmp / "tok.json"
    train_bpe(iter(["hello world, a small corpus of words"] * 50), 300, special_tokens=["<|endoftext|>"]).save(tok)
    return tok


def test_one_huge_jsonl_line_is_a_clear_error_with_bounded_memory(tmp_path):
    tok = _tokenizer(tmp_path)
    data = tmp_path / "in.jsonl"
    with data.open("w") as fh:
        fh.write(json.dumps({"text": "ok first document"}) + "\n")
        fh.write('{"text": "' + "a" * (40 << 20) + '"}\n')  # 40 MB on one line (the probe's was 200 MB)
        fh.write(json.dumps({"text": "ok last document"}) + "\n")
    cmd = [sys.executable, "-m", "ulyssesd.training.data.preprocess", "--tokenizer", str(tok), "--output-prefix",
           str(tmp_path / "out"), "--workers", "1", "--no-progress", "--max-document-mb", "8", str(data)]
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    err = proc.stderr.read().decode()
    assert proc.returncode == 1, err
    assert f"{data}:2: a line longer than {8 << 20} bytes" in err and "--max-document-mb" in err, err
    assert peak < 400 << 20, f"peak RSS {peak >> 20} MiB"
    # Lines under the bound are fine (the healthy case), also a 1 MiB one.
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "b " * (1 << 19)}) + "\n")
    ok = subprocess.run([*cmd[:-1], str(small)], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and "wrote 2 documents" in ok.stdout, ok.stderr
    bad = subprocess.run([*cmd[:-3], "--max-document-mb", "nan", str(data)], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--max-document-mb" in bad.stderr


def test_a_sigkilled_preprocess_leaves_no_worker_behind(tmp_path):
    tok = _tokenizer(tmp_path)
    data = tmp_path / "in.jsonl"
    with data.open("w") as fh:
        for i in range(300_000):
            fh.write(json.dumps({"text": f"document number {i} hello world again and again"}) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "ulyssesd.training.data.preprocess", "--tokenizer", str(tok),
                             "--output-prefix", str(tmp_path / "out"), "--workers", "2", "--chunk-mb", "0.5",
                             "--no-progress", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    workers: list[psutil.Process] = []
    while len(workers) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "workers never started"
        workers = [c for c in parent.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"workers left running: {[p.pid for p in alive]}"
