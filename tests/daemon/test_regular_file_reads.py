"""Files a job or a user controls are read only when they are regular files (hostile round 6): a FIFO put at
a telemetry file's, a stack dump's, a log's or a checkpoint's path would block `open()` for ever and wedge the
daemon or `ulyssesctl`. It is reported as unreadable, never waited on.
And the stdout reader's line edges: a `\\r`-only progress redraw is read to its last step once the job has
ended; U+2028/U+2029 end lines."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from ulyssesd.daemon.core.files import _read_tail
from ulyssesd.daemon.job.checkpoint_files import whole_torch_file
from ulyssesd.daemon.safety.regular_file import NotRegularFile, open_regular, read_regular_text
from ulyssesd.daemon.telemetry.log_source import STDOUT_TELEMETRY_NAME, LogSource
from ulyssesd.daemon.telemetry.tail import recent_steps_from_telemetry
from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader


def _in_thread(fn):
    """Run fn in a daemon thread; its result, or a failure if it blocks (a FIFO open waits for a writer)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_catch(fn)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "blocked on a FIFO"
    return out[0]


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc


def test_a_fifo_is_refused_without_blocking_and_a_regular_file_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "telemetry.jsonl"
    os.mkfifo(fifo)
    got = _in_thread(lambda: open_regular(fifo))
    assert isinstance(got, NotRegularFile) and isinstance(got, OSError)
    assert "FIFO" in got.strerror and got.filename == str(fifo)
    assert isinstance(_in_thread(lambda: read_regular_text(tmp_path)), NotRegularFile)  # a directory
    regular = tmp_path / "a.txt"
    regular.write_text("hello\n")
    assert read_regular_text(regular) == "hello\n"
    with open_regular(regular) as fh:
        assert fh.read() == b"hello\n"
    with pytest.raises(ValueError):
        open_regular(regular, "wb")


def test_the_readers_of_job_controlled_files_say_unreadable_for_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "step_000500.pt"
    os.mkfifo(fifo)
    ok, why = _in_thread(lambda: whole_torch_file(fifo))
    assert not ok and "FIFO" in why
    assert _in_thread(lambda: _read_tail(fifo)) == ""
    os.mkfifo(tmp_path / "telemetry.jsonl")
    assert _in_thread(lambda: recent_steps_from_telemetry(str(tmp_path))) == []
    reader = TelemetryReader(tmp_path / "telemetry.jsonl")
    assert _in_thread(reader.read) == [] and reader.not_regular
    # Back to a regular file: read again.
    os.unlink(tmp_path / "telemetry.jsonl")
    (tmp_path / "telemetry.jsonl").write_text(json.dumps({"v": 1, "kind": "step", "time": 1.0, "step": 1,
                                                          "loss": 2.0}) + "\n")
    assert [r.step for r, _ in reader.read()] == [1] and not reader.not_regular


def _steps(run_dir: Path) -> list[int]:
    out = run_dir / STDOUT_TELEMETRY_NAME
    recs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return [r["step"] for r in recs if r.get("kind") == "step"]


def _log(run_dir: Path, data: bytes) -> None:
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "attempt-1.log").write_bytes(data)


def test_carriage_return_redraws_end_at_the_last_step_once_the_job_ended(tmp_path: Path) -> None:
    _log(tmp_path, b"".join(f"\rstep {s}/30 loss {3.0 - s / 100:.4f}".encode() for s in range(1, 31)))
    src = LogSource(tmp_path, 1, total_steps=30)
    src.pump(1.0)
    assert _steps(tmp_path)[-1] == 29  # the newest redraw may still be being written: it waits
    src.pump(2.0)
    assert _steps(tmp_path)[-1] == 29
    src.job_ended = True  # nothing more will come: the unterminated tail is the last line
    src.pump(3.0)
    assert _steps(tmp_path) == list(range(1, 31))
    assert src.offset == (tmp_path / "logs" / "attempt-1.log").stat().st_size


def test_unicode_line_separators_split_step_lines(tmp_path: Path) -> None:
    lines = [f"step {s}/30 loss {3.0 - s / 100:.4f}\u2028step {s + 1}/30 loss {3.0 - (s + 1) / 100:.4f}\n"
             for s in range(1, 31, 2)]
    _log(tmp_path, "".join(lines).encode())
    LogSource(tmp_path, 1, total_steps=30).pump(1.0)
    assert _steps(tmp_path) == list(range(1, 31))
