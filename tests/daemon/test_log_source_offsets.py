"""`[telemetry] source = "stdout"`: the log source's offsets file. It is replaced whole through a per-process
temp name (two writers never rename each other's half-written file), and not fsynced: a lost last offset
makes the next daemon re-read a few lines, and those yield no second record (the parser starts after the
attempt's last step already in the output file)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

from ulyssesd.daemon.telemetry.log_source import OFFSETS_NAME, STDOUT_TELEMETRY_NAME, LogSource


def _lines(first: int, last: int) -> str:
    return "".join(f"step={i} loss={3.0 - i / 100:.2f}\n" for i in range(first, last + 1))


def _steps(run_dir: Path) -> list[tuple[int, int]]:
    out = []
    for line in (run_dir / STDOUT_TELEMETRY_NAME).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "step":
            out.append((rec["attempt"], rec["step"]))
    return out


def test_a_lost_last_offset_rereads_lines_without_a_second_record(tmp_path):
    log = tmp_path / "logs" / "attempt-2.log"
    log.parent.mkdir()
    log.write_text(_lines(1, 5))
    src = LogSource(tmp_path, attempt=2)
    assert src.pump(now=1.0) == 5
    stale = (tmp_path / OFFSETS_NAME).read_text()
    with log.open("a") as fh:
        fh.write(_lines(6, 8))
    assert src.pump(now=2.0) == 3
    (tmp_path / OFFSETS_NAME).write_text(stale)  # the last offset write was lost (power loss, no fsync)
    with (tmp_path / STDOUT_TELEMETRY_NAME).open("a") as fh:
        fh.write('{"v": 1, "kind": "st')  # and the output's last append was torn

    again = LogSource(tmp_path, attempt=2)  # the next daemon: re-reads steps 6-8 from the stale offset
    assert again.offset == json.loads(stale)["2"]["offset"]
    assert again.pump(now=3.0) == 0 and again.parser.stats.dropped_repeated_step == 3
    with log.open("a") as fh:
        fh.write(_lines(9, 10))
    assert again.pump(now=4.0) == 2  # new lines still come through
    assert _steps(tmp_path) == [(2, s) for s in range(1, 11)]  # each step once, in order
    assert json.loads((tmp_path / OFFSETS_NAME).read_text())["2"]["offset"] == log.stat().st_size
    assert again.notices == []   # a stale offset is no problem: its bytes still match


def test_a_new_attempt_is_not_held_back_by_the_previous_attempts_steps(tmp_path):
    """The healthy case the resume rule must not break: attempt 3 resumes at step 4 (a rollback), below the
    steps attempt 2 left in the output file; its records are all emitted."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "attempt-2.log").write_text(_lines(1, 8))
    assert LogSource(tmp_path, attempt=2).pump(now=1.0) == 8
    (tmp_path / "logs" / "attempt-3.log").write_text(_lines(4, 6))
    assert LogSource(tmp_path, attempt=3).pump(now=2.0) == 3
    assert _steps(tmp_path)[-3:] == [(3, 4), (3, 5), (3, 6)]
    assert set(json.loads((tmp_path / OFFSETS_NAME).read_text())) == {"2", "3"}


def _writer(run_dir: str, attempt: int, rounds: int, errors) -> None:
    try:
        log = Path(run_dir) / "logs" / f"attempt-{attempt}.log"
        src = LogSource(Path(run_dir), attempt=attempt)
        for i in range(1, rounds + 1):
            with log.open("a") as fh:
                fh.write(f"step={i} loss=1.0\n")
            src.pump(now=float(i))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"attempt {attempt}: {exc!r}")


def test_two_writing_processes_never_leave_a_torn_offsets_file(tmp_path):
    """Two processes (an old daemon that has not noticed its successor, say) save offsets at once while a
    third reads: every read is whole JSON, neither writer fails, and no temp file is left behind."""
    (tmp_path / "logs").mkdir()
    for attempt in (1, 2):
        (tmp_path / "logs" / f"attempt-{attempt}.log").write_text("")
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), a, 300, errors)) for a in (1, 2)]
    for w in writers:
        w.start()
    torn = reads = 0
    path = tmp_path / OFFSETS_NAME
    while any(w.is_alive() for w in writers):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        reads += 1
        try:
            assert isinstance(json.loads(text), dict)
        except ValueError:
            torn += 1
        time.sleep(0.0005)
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    assert errors.empty(), errors.get()
    assert reads > 0 and torn == 0, (reads, torn)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert set(json.loads(path.read_text())) <= {"1", "2"}
