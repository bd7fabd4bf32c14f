"""Scheduler jobs run on the caller's thread, coalesced; the telemetry reader never crashes."""

from __future__ import annotations

import json
import os
import threading

from ulyssesd.daemon.core.housekeeping import LoopScheduler
from ulyssesd.daemon.telemetry.telemetry_reader import Cursor, TelemetryReader


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


# ------------------------------------------------------------- hostile telemetry (issue 13 regressions)
def test_reader_skips_a_5_mib_line_across_several_batches_and_never_rereads_it(tmp_path):
    from ulyssesd.daemon.telemetry.telemetry_reader import MAX_BATCH_BYTES

    p = tmp_path / "telemetry.jsonl"
    huge = b'{"kind": "event", "event": "x", "blob": "' + b"a" * (5 << 20) + b'"}'
    p.write_bytes(_line(kind="step", step=1, loss=2.0) + huge[: 3 << 20])  # the job is mid-write
    r = TelemetryReader(p)
    assert [x[0].step for x in r.read()] == [1]
    start = r.cursor.offset
    assert r.read() == [] and r.cursor.offset == start  # 3 MiB of an unfinished line: nothing yet
    with open(p, "ab") as fh:
        fh.write(huge[3 << 20:] + b"\n" + _line(kind="step", step=2, loss=1.9))
    assert len(huge) > MAX_BATCH_BYTES  # the line is longer than one read: the old reader stopped here forever
    got = []
    for _ in range(4):
        got += [x[0].step for x in r.read()]
    assert got == [2] and r.garbage_lines == 1
    assert r.cursor.offset == os.path.getsize(p)
    # A restart from the persisted cursor starts after the skipped line, not at it.
    r2 = TelemetryReader(p, Cursor(r.cursor.inode, start + len(huge) + 1))
    assert [x[0].step for x in r2.read()] == [2] and r2.garbage_lines == 0


def test_reader_reports_poison_lines_with_their_byte_offset_and_goes_on(tmp_path):
    p = tmp_path / "telemetry.jsonl"
    poison = [
        b'{"kind": "step", "step": 18446744073709551616, "loss": 1.0}',  # 2^64: OverflowError in the store
        b'{"kind": "step", "step": 1, "loss": 1.0, "note": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # RecursionError
        b'{"kind": "event", "event": "x", "deep": ' + b"[" * 200 + b"]" * 200 + b"}",  # fine for json, not for us
        b'{"kind": "step", "step": 3, "loss": 1.0, "time": "inf"}',  # the detectors' clock
    ]
    data = b"".join(line + b"\n" for line in poison)
    p.write_bytes(data + _line(kind="step", step=7, loss=1.5))
    r = TelemetryReader(p)
    assert [x[0].step for x in r.read()] == [7]
    assert r.garbage_lines == 4 and r.cursor.offset == os.path.getsize(p)
    offsets = [0]
    for line in poison[:-1]:
        offsets.append(offsets[-1] + len(line) + 1)
    logged = r.garbage_samples  # what the warning log lines carry
    assert [offset for offset, _ in logged] == offsets
    assert "64-bit integer range" in logged[0][1] and "nests deeper" in logged[1][1]
    assert "nests deeper" in logged[2][1] and "finite" in logged[3][1]


def _fake_sup(tmp_path, fos=None):
    from test_daemon_unit_fakeos import FakeOS, _sup

    sup = _sup(tmp_path, fos or FakeOS())
    sup.start()
    return sup


def test_supervisor_survives_poison_telemetry_and_a_restart_does_not_reread_it(tmp_path):
    from test_daemon_unit_fakeos import _emit, _steps

    from ulyssesd.daemon.store.enums import RunState

    sup = _fake_sup(tmp_path)
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 3)
    with open(sup.telemetry_path, "ab") as fh:
        fh.write(b'{"kind": "step", "step": 18446744073709551616, "loss": 1.0}\n')
        fh.write(b'{"kind": "event", "event": "x", "n": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n")
        fh.write(b'{"kind": "event", "event": "x", "blob": "' + b"a" * (5 << 20) + b'"}\n')
    for _ in range(4):
        sup.tick()
    assert sup.state == RunState.RUNNING and sup.reader.garbage_lines == 3
    end = os.path.getsize(sup.telemetry_path)
    cur = sup.store.get_telemetry_cursor(sup.run_id)
    assert cur.offset == end  # persisted past the bad lines, though they produced no record
    _steps(sup, 4, 5)
    assert sup.last_step == 5
    # A new daemon re-adopts from the stored cursor: its reader starts after the poison (its engine warm-up
    # reads the processed part again, through the same bounded reader), and nothing fails.
    sup2 = _fake_sup(tmp_path, sup.os)
    assert sup2.run_id == sup.run_id and sup2.state == RunState.RUNNING and sup2.last_step == 5
    assert sup2.reader.garbage_lines == 0
    _steps(sup2, 6, 6)
    assert sup2.last_step == 6


def test_a_record_whose_handling_raises_is_logged_counted_and_skipped(tmp_path, monkeypatch):
    from test_daemon_unit_fakeos import _emit, _steps

    sup = _fake_sup(tmp_path)
    _emit(sup, kind="event", event="started", step=0)
    from ulyssesd.daemon.core import decisions

    real = decisions.on_event

    def flaky(sup_, rec):
        if rec.event == "checkpoint_saved":
            raise RuntimeError("store hiccup")
        return real(sup_, rec)

    monkeypatch.setattr(decisions, "on_event", flaky)
    _emit(sup, kind="event", event="checkpoint_saved", step=0, tag="step-00000000")
    _steps(sup, 1, 2)  # the records after it are still handled
    assert sup.record_errors == 1 and sup.last_step == 2
    assert sup.status_dict()["telemetry_record_errors"] == 1


def test_ack_with_a_bad_id_is_bad_request_and_a_handler_error_is_clean(tmp_path, monkeypatch):
    sup = _fake_sup(tmp_path)
    for bad in ("x", 1.5, None, True, [1], -3, 2**64):
        resp = sup.handle_command({"cmd": "ack", "args": {"id": bad}})
        assert resp["ok"] is False and resp["code"] == "bad_request" and "'args.id'" in resp["error"], resp
    assert sup.handle_command({"cmd": "ack", "args": {"id": 99}}) == {
        "ok": False, "code": "not_found", "error": "no incident 99"}
    resp = sup.handle_command({"cmd": "ack", "args": {"id": 1, "by": {"x": 1}}})
    assert resp["code"] == "bad_request" and "'args.by'" in resp["error"]

    def broken(*a, **k):
        raise OSError("disk I/O error at /secret/ulyssesd.db")

    monkeypatch.setattr(sup.store, "ack_incident", broken)
    resp = sup.handle_command({"cmd": "ack", "args": {"id": 1}})
    assert resp == {"ok": False, "code": "internal", "error": "internal error handling 'ack' (OSError); see the daemon log"}
    assert sup.handle_command({"cmd": "status"})["ok"] is True


def _hostile_records(rng, n: int, start_step: int):
    """Records that pass the parser's bounds but sit at their edges (fixed seed: the same every run)."""
    edge = [0, 0.0, -0.0, 5e-324, 1e300, -1e300, "nan", "inf", "-inf", -1, 2**62, 1.0, 2.0, 1e-9, None]
    ints = [None, 0, 1, -1, 2**63 - 1, -(2**63), 7]
    fields = ["grad_norm", "lr", "loss_scale", "step_time_s", "step_time_max_s", "tokens_per_s",
              "mem_allocated_gib", "mem_max_allocated_gib", "mem_reserved_gib"]
    for i in range(n):
        if rng.random() < 0.15:
            yield {"kind": "event", "event": rng.choice(["checkpoint_saved", "checkpoint_invalid", "fault_injected",
                                                         "control_applied", "checkpoint_saving", "x"]),
                   "step": rng.choice([start_step + i, 0, 2**63 - 1]), "tag": rng.choice(["step-00000010", 3, "", None]),
                   "reason": rng.choice(["bad", None, 1.5]), "deep": [[[[rng.random()]]]]}
            continue
        rec = {"kind": "step", "step": rng.choice([start_step + i, start_step + i, 0, 2**63 - 1]),
               "loss": rng.choice([*edge[:-1], 2.0, 2.0, 2.0])}
        for name in rng.sample(fields, rng.randrange(len(fields))):
            rec[name] = rng.choice(edge)
        for name in rng.sample(["slowest_rank", "tokens", "mem_max_rank", "config_version"], rng.randrange(3)):
            rec[name] = rng.choice(ints)
        if rng.random() < 0.3:
            rec["skipped"] = rng.choice([True, False])
        if rng.random() < 0.2:
            rec["samples"] = [rng.choice(ints[1:]), rng.choice(ints[1:])]
        yield rec


def test_a_live_tick_handles_thousands_of_edge_records_without_an_internal_error(tmp_path):
    """The whole tick (reader, engine, decisions, store writes) on 2,000 records at the edges of the bounds, in
    observe-only mode so the run keeps going: no record may raise inside the supervisor (record_errors stays 0:
    the per-record guard is a last resort, not the way these are handled)."""
    import random

    from test_daemon_unit_fakeos import FakeOS, _emit, _sup

    from ulyssesd.daemon.store.enums import RunState

    sup = _sup(tmp_path, FakeOS(), remediation={"mode": "observe"})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    rng = random.Random(1307)
    for batch in range(40):
        with open(sup.telemetry_path, "a") as fh:
            for rec in _hostile_records(rng, 50, batch * 50 + 1):
                fh.write(json.dumps({"v": 1, "attempt": sup.attempt, "time": sup.os.time(), **rec}) + "\n")
        sup.os.advance(1.0)
        sup.tick()
    assert sup.record_errors == 0
    assert sup.reader.garbage_lines == 0  # all inside the bounds: every one reached the engine
    assert sup.store.list_incidents(sup.run_id)  # and they did trip detectors (observe-only incidents)
    assert sup.state in (RunState.RUNNING, RunState.REMEDIATING), sup.state
    assert sup.store.get_telemetry_cursor(sup.run_id).offset == os.path.getsize(sup.telemetry_path)
    assert sup.handle_command({"cmd": "status"})["ok"] is True
