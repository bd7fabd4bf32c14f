"""`ulyssesctl logs` against hostile log files and run ids (an outside check): a 50 MiB line with no newline,
binary garbage, a log truncated while `-f` follows it, a run id that is a path. Real files, a real store, the
real `ulyssesctl` process where time or memory is the point."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from ulyssesd.daemon.operator import ctl_logs
from ulyssesd.daemon.operator.ctl import main

CTL = Path(sys.executable).parent / "ulyssesctl"


@pytest.fixture
def state_dir(tmp_path) -> Path:
    """A state dir with one run `r1` (one attempt, its log `[rank0]:hello` / `[rank1]:world`)."""
    from ulyssesd.daemon.store import open_store

    sd = tmp_path / "state"
    run_dir = sd / "runs" / "r1"
    (run_dir / "logs").mkdir(parents=True)
    with open_store(sd / "ulyssesd.db") as store:
        store.create_run("r1", run_dir=run_dir, spec={"train": {"steps": 10}})
        store.add_attempt("r1", command=["train"])
    (run_dir / "logs" / "attempt-1.log").write_bytes(b"[rank0]:hello\n[rank1]:world\n")
    return sd


def _log(sd: Path) -> Path:
    return sd / "runs" / "r1" / "logs" / "attempt-1.log"


def test_a_huge_line_without_newline_streams_in_bounded_memory():
    """The line reader holds at most about MAX_PIECE of one line (it held the whole line, re-copied per
    64 KiB chunk: quadratic, 41 s and 230 MB RSS for a 50 MiB line on the 2-core box)."""
    size = 24 * ctl_logs.MAX_PIECE
    fh = io.BytesIO(b"x" * size)
    tracemalloc.start()
    try:
        total = sum(len(piece) for piece in ctl_logs._lines(fh, bytearray(), final=True))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == size
    assert peak < 4 * ctl_logs.MAX_PIECE, f"peak {peak} bytes for a {size}-byte line"
    # Healthy input is unchanged: ordinary lines come out whole, one item per line.
    assert list(ctl_logs._lines(io.BytesIO(b"a\nbb\n\nccc"), bytearray(), final=True)) == [b"a\n", b"bb\n", b"\n", b"ccc"]


def test_the_pieces_of_an_overlong_line_go_with_its_rank():
    big = b"y" * (3 * ctl_logs.MAX_PIECE + 17)
    data = b"[rank1]:" + big + b"\n[rank0]:short\n[rank0]:" + big + b"\n[rank1]:end\n"
    for rank, want in ((1, big + b"\nend\n"), (0, b"short\n" + big + b"\n")):
        seen = [False]
        got = b"".join(ctl_logs.rank_filter(ctl_logs._lines(io.BytesIO(data), bytearray(), True), rank, seen))
        assert got == want and seen[0]


def test_logs_of_a_50_mib_line_and_its_last_line_are_fast(state_dir, tmp_path):
    """The real command on a 50 MiB line with no newline: whole, and `-n 1`, each well under the 41 s / 36 s
    the quadratic reader and the byte-by-byte backward scan took."""
    blob = os.urandom(64) * (50 * (1 << 20) // 64)
    _log(state_dir).write_bytes(blob.replace(b"\n", b"."))
    for extra in (["--raw"], ["--raw", "-n", "1"], []):
        out = tmp_path / "out.bin"
        t0 = time.monotonic()
        with out.open("wb") as fh:
            proc = subprocess.run([str(CTL), "--state-dir", str(state_dir), "logs", "r1", *extra], stdout=fh,
                                  stderr=subprocess.PIPE, timeout=120)
        took = time.monotonic() - t0
        assert proc.returncode == 0 and proc.stderr == b""
        if "--raw" in extra:
            assert out.stat().st_size == len(blob)
        else:  # controls shown as text: longer, and no ESC byte reaches the reader
            assert out.stat().st_size > len(blob) and b"\x1b" not in out.read_bytes()
        assert took < 20, f"logs {extra} took {took:.1f} s"


def test_binary_garbage_is_passed_through_and_rank_refuses_it_cleanly(state_dir, capsysbinary):
    garbage = bytes(range(256)) * 64 + b"\xff\xfe\x00[rank0"  # no valid prefix anywhere, NULs, invalid UTF-8
    _log(state_dir).write_bytes(garbage)
    sd = ["--state-dir", str(state_dir)]
    assert main([*sd, "logs", "r1", "--raw"]) == 0
    assert capsysbinary.readouterr().out == garbage  # byte for byte, like cat
    assert main([*sd, "logs", "r1"]) == 0
    shown = capsysbinary.readouterr().out  # the default: every control visible, nothing else changed
    assert not any(c in shown for c in b"\x00\x07\x1b\x7f") and b"\\x1b" in shown and b"\\x00" in shown
    assert main([*sd, "logs", "r1", "--rank", "0"]) == 2
    captured = capsysbinary.readouterr()
    assert captured.out == b"" and b"no rank-prefixed lines" in captured.err and b"Traceback" not in captured.err


@pytest.mark.parametrize("bad", ["0", "-1", "x", "1.5"])
def test_bad_attempt_and_rank_values_are_usage_errors(state_dir, bad, capsys):
    sd = ["--state-dir", str(state_dir)]
    for opt in ("--attempt", "--rank", "-n"):
        if opt == "--rank" and bad == "0":
            continue  # rank 0 is valid
        assert main([*sd, "logs", "r1", opt, bad]) == 2
        err = capsys.readouterr().err
        assert opt in err and "Traceback" not in err


def test_huge_attempt_and_rank_values_are_answered_not_crashed(state_dir, capsys):
    sd = ["--state-dir", str(state_dir)]
    assert main([*sd, "logs", "r1", "--attempt", str(10**30)]) == 4
    assert "no log of attempt 1000000000000000000000000000000" in capsys.readouterr().err
    assert main([*sd, "logs", "r1", "--rank", str(10**30)]) == 0  # labelled log, no line of that rank: empty
    assert capsys.readouterr().out == ""
    assert main([*sd, "logs", "r1", "-n", str(10**30)]) == 0  # more lines than the file has: the whole file
    assert capsys.readouterr().out == "[rank0]:hello\n[rank1]:world\n"


def test_a_run_id_that_is_a_path_never_reads_outside_the_state_dir(tmp_path, capsys):
    """Without a database the command reads `runs/<RUN>/logs` directly; `../../x` or `/abs` must not escape."""
    outside = tmp_path / "outside"
    (outside / "logs").mkdir(parents=True)
    (outside / "logs" / "attempt-1.log").write_text("SECRET\n")
    sd = tmp_path / "a" / "state"
    (sd / "runs" / "ok" / "logs").mkdir(parents=True)
    (sd / "runs" / "ok" / "logs" / "attempt-1.log").write_text("fine\n")
    for run_id in ("../../../outside", str(outside), "..", "ok/../../../../outside"):
        assert main(["--state-dir", str(sd), "logs", run_id]) == 2
        captured = capsys.readouterr()
        assert "SECRET" not in captured.out and "(no '/', no '..')" in captured.err
    assert main(["--state-dir", str(sd), "logs", "ok"]) == 0  # a plain name still reads its run dir
    assert capsys.readouterr().out == "fine\n"


def test_follow_survives_truncation_mid_line_and_ends_with_the_attempt(state_dir, capsysbinary, monkeypatch):
    """The log is truncated while `-f` holds a partial line: what was pending is dropped (it is gone from the
    file), the new content is printed from the start, and the exit file ends the follow."""
    monkeypatch.setattr(ctl_logs, "FOLLOW_POLL_S", 0.02)
    log = _log(state_dir)
    log.write_bytes(b"[rank0]:one\n[rank0]:partial-no-newline")
    run_dir = state_dir / "runs" / "r1"

    def writer() -> None:
        time.sleep(0.3)
        with log.open("r+b") as fh:
            fh.truncate(0)
        time.sleep(0.2)
        with log.open("ab") as fh:
            fh.write(b"[rank0]:after-truncate\n")
        time.sleep(0.2)
        (run_dir / "attempts").mkdir(exist_ok=True)
        (run_dir / "attempts" / "1.exit").write_text("{}")

    t = threading.Thread(target=writer)
    t.start()
    code = ctl_logs.print_log([log], 0, None, True, run_dir, 1, None)
    t.join()
    assert code == 0
    assert capsysbinary.readouterr().out == b"one\nafter-truncate\n"


def test_follow_of_a_deleted_log_keeps_its_open_file_and_ends_with_the_attempt(state_dir, capsysbinary, monkeypatch):
    monkeypatch.setattr(ctl_logs, "FOLLOW_POLL_S", 0.02)
    log = _log(state_dir)
    run_dir = state_dir / "runs" / "r1"
    writer_fh = log.open("ab")

    def writer() -> None:
        time.sleep(0.2)
        log.unlink()  # an operator's cleanup; the job still holds the file open and writes on
        writer_fh.write(b"[rank0]:still-written\n")
        writer_fh.flush()
        time.sleep(0.2)
        (run_dir / "attempts").mkdir(exist_ok=True)
        (run_dir / "attempts" / "1.exit").write_text("{}")

    t = threading.Thread(target=writer)
    t.start()
    try:
        code = ctl_logs.print_log([log], None, None, True, run_dir, 1, None)
    finally:
        t.join()
        writer_fh.close()
    assert code == 0
    assert capsysbinary.readouterr().out == b"[rank0]:hello\n[rank1]:world\n[rank0]:still-written\n"


def test_a_logs_dir_that_is_a_symlink_loop_is_not_found_not_a_traceback(state_dir, capsys):
    logs = state_dir / "runs" / "r1" / "logs"
    for f in logs.iterdir():
        f.unlink()
    logs.rmdir()
    logs.symlink_to(logs)  # logs -> logs: ELOOP on every access
    assert main(["--state-dir", str(state_dir), "logs", "r1"]) == 4
    err = capsys.readouterr().err
    assert "no attempt logs" in err and "Traceback" not in err
