"""A telemetry backlog (the daemon was down, or the job outran it) is read on within a tick, batch after batch,
each batch's cursor stored after its records were acted upon; a daemon SIGKILLed inside a batch loses no record
and doubles none when the next one adopts the run (resuming from the engine snapshot the killed one saved)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_daemon_unit_fakeos import FakeOS, _sup
from uls_daemon_helpers import fake_spec

from ulyssesd.daemon.core import commands, decisions
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState

HERE = Path(__file__).resolve().parent


def _backlog(n: int, attempt: int = 1, invalid_every: int = 0) -> str:
    """`n` healthy steps at one time (the fake clock does not move); every `invalid_every`-th step a job's
    `checkpoint_invalid` event, which the daemon records as one incident at that step."""
    out = []
    for s in range(1, n + 1):
        out.append({"v": 1, "kind": "step", "step": s, "loss": 3.0 - 1e-5 * s, "time": 1_000_000.0,
                    "attempt": attempt, "step_time_s": 0.1, "samples": [s - 1, s]})
        if invalid_every and s % invalid_every == 0:
            out.append({"v": 1, "kind": "event", "event": "checkpoint_invalid", "step": s, "time": 1_000_000.0,
                        "attempt": attempt, "tag": f"step-{s}", "reason": "bench"})
    return "".join(json.dumps(d) + "\n" for d in out)


def _start_with_backlog(tmp_path, n):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=10 * n, interval=10 * n, detectors={"hang_timeout_floor_s": 600.0})
    sup.start()
    with sup.telemetry_path.open("a") as fh:
        fh.write(json.dumps({"v": 1, "kind": "event", "event": "started", "step": 0, "attempt": 1,
                             "time": 1_000_000.0}) + "\n")
    sup.tick()  # STARTING -> RUNNING (a state change ends a tick's drain: the tick's other steps see it first)
    with sup.telemetry_path.open("a") as fh:
        fh.write(_backlog(n))
    sup.reader.max_batch_bytes = 4096  # a few dozen records a batch
    stored = []
    real = sup.store.set_telemetry_cursor
    sup.store.set_telemetry_cursor = lambda *a, **kw: stored.append(kw["offset"]) or real(*a, **kw)
    return sup, stored


def test_a_backlog_is_read_to_its_end_in_one_tick_each_batch_stored(tmp_path):
    sup, stored = _start_with_backlog(tmp_path, 400)
    size = sup.telemetry_path.stat().st_size
    sup.tick()
    assert sup.reader.cursor.offset == size and sup.last_step == 400
    assert len(stored) > 5 and stored == sorted(stored) and stored[-1] == size  # batch after batch, in order
    assert sup.store.get_telemetry_cursor(sup.run_id).offset == size


def test_without_a_drain_budget_a_tick_reads_one_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(decisions, "DRAIN_BUDGET_S", 0.0)  # the old pace: the rest waits for the next ticks
    sup, stored = _start_with_backlog(tmp_path, 400)
    sup.tick()
    assert len(stored) == 1 and sup.reader.cursor.offset < sup.telemetry_path.stat().st_size
    for _ in range(200):
        sup.tick()
    assert sup.last_step == 400  # nothing lost at the slower pace either


class _BusyClock(FakeOS):
    """Each monotonic read is 0.25 s later: a backlog's batches take time, so the tick's drain budget ends."""

    def monotonic(self):
        self.m += 0.25
        return self.m


def test_status_answers_and_stop_works_while_a_backlog_drains(tmp_path):
    fos = _BusyClock()
    fos.term_behaviour = "exit0"  # the job saves and exits on the stop's SIGTERM
    sup = _sup(tmp_path, fos, steps=10**6, interval=10**6, detectors={"hang_timeout_floor_s": 600.0})
    sup.start()
    with sup.telemetry_path.open("a") as fh:
        fh.write(json.dumps({"v": 1, "kind": "event", "event": "started", "step": 0, "attempt": 1,
                             "time": 1_000_000.0}) + "\n" + _backlog(3000))
    sup.reader.max_batch_bytes = 8 << 10  # ~50 records a batch: 60 batches, a few a tick
    size = sup.telemetry_path.stat().st_size
    answers = []

    def poll(timeout):  # the control socket's turn between ticks: a status, then a stop while behind
        st = commands.handle(sup, {"cmd": "status"})
        answers.append((st["ok"], st["status"]["step"], sup.reader.cursor.offset))
        if len(answers) == 4:
            answers.append(commands.handle(sup, {"cmd": "stop"}))

    assert sup.run_forever(poll) == RunState.STOPPED
    during = [a for a in answers[:4] if a[2] < size]
    assert len(during) == 4 and all(ok for ok, _, _ in during)  # answered between batches of the backlog
    assert [step for _, step, _ in during] == sorted(step for _, step, _ in during) and during[-1][1] > 0
    assert answers[4]["ok"], answers[4]  # the stop was taken while records were still unread


@pytest.mark.slow
def test_a_daemon_killed_inside_a_batch_loses_and_doubles_nothing(tmp_path):
    spec = fake_spec(tmp_path, steps=10**6, interval=10**6, detectors={"hang_timeout_floor_s": 600.0})
    n, every = 3000, 7
    (tmp_path / "backlog.jsonl").write_text(
        json.dumps({"v": 1, "kind": "event", "event": "started", "step": 0, "attempt": 1, "time": 1_000_000.0})
        + "\n" + _backlog(n, invalid_every=every))
    worker = [sys.executable, str(HERE / "backlog_worker.py"), str(spec)]
    first = subprocess.Popen([*worker, "first", "4"], stdout=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:  # its log lines, until it is inside its 5th batch (or exits)
            if line.startswith(("MID-BATCH", "DONE")):
                break
        assert line.startswith("MID-BATCH"), line
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait(timeout=60)
    db = tmp_path / "state" / "ulyssesd.db"
    store = open_store(db, readonly=True)
    run = store.list_runs()[0]
    cursor = store.get_telemetry_cursor(run.id)
    tel = Path(run.run_dir) / "telemetry.jsonl"
    # Killed inside a batch: incidents of records past the stored cursor are already in the store.
    before = store.list_incidents(run.id, symptom="checkpoint_corrupt")
    events_read = tel.read_bytes()[:cursor.offset].count(b'"checkpoint_invalid"')  # those the cursor covers
    assert cursor.offset < tel.stat().st_size and len(before) == events_read + 1, (cursor, len(before), line)
    store.close()
    again = subprocess.run([*worker, "again", "0"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    done = again.stdout.splitlines()[-1].split()
    assert done[:4] == ["DONE", str(tel.stat().st_size), str(tel.stat().st_size), str(n)]
    # The adopting daemon resumed from the engine snapshot the killed one saved (at a stored cursor, before it).
    assert done[5] != "None" and 0 < int(done[5]) <= cursor.offset, done
    store = open_store(db, readonly=True)
    steps = sorted(i.step for i in store.list_incidents(run.id, symptom="checkpoint_corrupt"))
    assert steps == list(range(every, n + 1, every))  # every one, each once
    assert store.get_telemetry_cursor(run.id).offset == tel.stat().st_size
    store.close()
