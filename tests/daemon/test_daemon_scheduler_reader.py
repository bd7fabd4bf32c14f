"""Scheduler jobs run on the caller's thread, coalesced; the telemetry reader never crashes."""

from __future__ import annotations

import json
import os
import threading

from ulyssesd.daemon.scheduler import LoopScheduler
from ulyssesd.daemon.telemetry_reader import Cursor, TelemetryReader


def test_scheduler_coalesces_and_runs_on_the_loop_thread():
    sched = LoopScheduler(use_thread=False)
    seen: list[int] = []
    sched.add("a", 1.0, lambda: seen.append(threading.get_ident()))
    sched.add("boom", 1.0, lambda: 1 / 0)
    for _ in range(5):  # a slow loop: the trigger fired 5 times, the job runs once
        sched.enqueue("a")
    sched.enqueue("boom")
    ran = sched.run_due()
    assert ran.count("a") == 1 and seen == [threading.get_ident()]
    assert sched.errors == {"boom": 1} and sched.run_due() == []


def test_scheduler_with_apscheduler_thread_enqueues_only():
    sched = LoopScheduler()
    hits: list[int] = []
    sched.add("tick", 0.05, lambda: hits.append(threading.get_ident()))
    sched.start()
    try:
        import time

        time.sleep(0.5)
        assert hits == []  # nothing ran on APScheduler's thread
        sched.run_due()
        assert hits == [threading.get_ident()]
    finally:
        sched.shutdown()


def _line(**d):
    return (json.dumps({"v": 1, **d}) + "\n").encode()


def test_reader_partial_line_garbage_truncation_and_replacement(tmp_path):
    p = tmp_path / "telemetry.jsonl"
    p.write_bytes(_line(kind="step", step=1, loss=2.0) + b'{"kind": "step", "st')
    r = TelemetryReader(p)
    got = r.read()
    assert [x[0].step for x in got] == [1]
    off = r.cursor.offset
    with open(p, "ab") as fh:  # the rest of the partial line + garbage + a valid line
        fh.write(b'ep": 2, "loss": 1.5}\n' + b"\x00\xffnot json\n" + _line(kind="event", event="started"))
    got = r.read()
    assert [type(x[0]).__name__ for x in got] == ["StepRecord", "EventRecord"] and r.garbage_lines == 1
    assert r.cursor.offset == os.path.getsize(p) > off
    # resume from a stored cursor: nothing is re-read
    r2 = TelemetryReader(p, Cursor(r.cursor.inode, r.cursor.offset))
    assert r2.read() == []
    # truncated file: start over
    p.write_bytes(_line(kind="step", step=9, loss=1.0))
    assert [x[0].step for x in r2.read()] == [9]
    # replaced file (new inode): start over
    q = tmp_path / "new.jsonl"
    q.write_bytes(_line(kind="step", step=1, loss=3.0) + _line(kind="step", step=2, loss=3.0))
    os.replace(q, p)
    assert [x[0].step for x in r2.read()] == [1, 2]
