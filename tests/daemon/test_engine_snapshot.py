"""The engine snapshot saved with the telemetry cursor (daemon/telemetry/engine_snapshot.py), on the fake OS
with a real store and the real remediation engine.

A re-adopting daemon restores the engine from its snapshot and replays only the records after it; the engine
it gets judges what comes next exactly as the one a full replay builds (the same findings and decisions on a
loss spike, none on a healthy tail). A snapshot that does not fit (torn, made for another spec, past the
stored cursor, of a replaced telemetry file) is not used: the daemon says why and replays from the start.
"""

from __future__ import annotations

import json
import math

import pytest
from structlog.testing import capture_logs
from test_daemon_unit_fakeos import FakeOS, _emit, _sup

from ulyssesd.daemon.telemetry import engine_snapshot
from ulyssesd.daemon.telemetry.engine_snapshot import SnapshotPolicy
from ulyssesd.remediation.records import parse_line

DETECTORS = {"window": 40, "warmup_steps": 10, "hang_timeout_floor_s": 600.0}


def _line(fos, attempt: int, step: int, loss: float) -> str:
    return json.dumps({"v": 1, "kind": "step", "step": step, "loss": loss, "time": fos.time(), "attempt": attempt,
                       "step_time_s": 0.5 + 0.01 * (step % 3), "tokens": 4096, "grad_norm": 1.0 + 0.05 * (step % 7),
                       "samples": [step - 1, step]}) + "\n"


def _healthy_loss(step: int) -> float:
    return 3.0 * math.exp(-step / 3000) * (1 + 0.02 * math.sin(step * 1.7))


def _run_with_snapshot(tmp_path, steps: int = 600, after: int = 150):
    """A run whose daemon read `steps` records one tick at a time (snapshot saved at `steps`), then `after`
    more (after the snapshot: replayed on top of it), with a save at step 500; then the daemon "dies"."""
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=100_000, interval=100_000, detectors=DETECTORS)
    sup.start()
    sup.snapshots.policy = SnapshotPolicy(every_records=steps + 1, after_backlog_records=10**9)
    _emit(sup, kind="event", event="started", step=0)
    sup.tick()
    for s in range(1, steps + after + 1):
        fos.advance(0.5)
        with open(sup.telemetry_path, "a") as fh:
            fh.write(_line(fos, sup.attempt, s, _healthy_loss(s)))
        if s == 500:
            _emit(sup, kind="event", event="checkpoint_saved", step=500, tag="step-00000500")
        sup.tick()
    assert engine_snapshot.path_of(sup).is_file()
    head = json.loads(engine_snapshot.path_of(sup).read_bytes().split(b"\n", 1)[0])
    cursor = sup.store.get_telemetry_cursor(sup.run_id)
    assert 0 < head["offset"] < cursor.offset  # records after the snapshot are left for the replay
    sup.store.close()
    return fos, sup, head


def _adopt(tmp_path, fos, detectors=None):
    sup = _sup(tmp_path, fos, steps=100_000, interval=100_000, detectors=detectors or DETECTORS)
    sup.start()
    return sup


def _judge(engine, fos, attempt: int, first: int, n: int, spike: range) -> list[tuple]:
    """What the engine says about the next `n` records (a loss x8 over `spike`): findings and decisions."""
    out = []
    t = fos.time()
    for s in range(first, first + n):
        t += 0.5
        rec = parse_line(_line(fos, attempt, s, _healthy_loss(s) * (8.0 if s in spike else 1.0)))
        for o in engine.observe(rec, t):
            out.append((type(o).__name__, o.symptom, o.step, getattr(o, "action_kind", None),
                        getattr(o, "rollback_to_step", None)))
    return out


def test_readoption_from_the_snapshot_judges_as_a_full_replay_does(tmp_path):
    fos, first, head = _run_with_snapshot(tmp_path)
    with capture_logs() as logs:
        snap = _adopt(tmp_path, fos)
    assert snap.snapshots.restored_from == head["offset"]
    warmed = next(e for e in logs if e["event"] == "engine warmed from telemetry")
    after = first.telemetry_path.read_bytes()[head["offset"]:].count(b"\n")
    assert warmed["from_offset"] == head["offset"] and warmed["records"] == after < 200  # only those after it
    assert snap.last_step == 750 and snap.latest_ckpt == ("step-00000500", 500)
    snap.store.close()

    engine_snapshot.path_of(first).unlink()  # the same adoption without it: every record replayed
    full = _adopt(tmp_path, fos)
    assert full.snapshots.restored_from is None and full.last_step == 750

    assert snap.engine.known_good == full.engine.known_good == [("step-00000500", 500)]
    healthy = (_judge(snap.engine, fos, 1, 751, 100, range(0)), _judge(full.engine, fos, 1, 751, 100, range(0)))
    assert healthy == ([], [])
    spike = range(900, 930)
    got = _judge(snap.engine, fos, 1, 851, 120, spike)
    assert got == _judge(full.engine, fos, 1, 851, 120, spike)
    assert any(o[0] == "Finding" and o[1] == "loss_spike" for o in got)
    assert any(o[0] == "Decision" for o in got)  # the spike is acted on, by both the same way


def _torn(path, head):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _past_cursor(path, head):
    body = path.read_bytes().split(b"\n", 1)[1]
    path.write_bytes(json.dumps({**head, "offset": head["offset"] + 10**9}).encode() + b"\n" + body)


def _other_file(path, head):
    body = path.read_bytes().split(b"\n", 1)[1]
    path.write_bytes(json.dumps({**head, "inode": head["inode"] + 1}).encode() + b"\n" + body)


@pytest.mark.parametrize("spoil, why", [(_torn, "unreadable"), (_past_cursor, "past the stored cursor"),
                                        (_other_file, "another run or telemetry file"), (None, "another engine")])
def test_a_snapshot_that_does_not_fit_is_said_and_the_replay_starts_at_the_beginning(tmp_path, spoil, why):
    fos, first, head = _run_with_snapshot(tmp_path, steps=300, after=20)
    if spoil is not None:
        spoil(engine_snapshot.path_of(first), head)
    # None: the operator changed the detectors' window before the restart (another engine than the snapshot's)
    with capture_logs() as logs:
        sup = _adopt(tmp_path, fos, {**DETECTORS, "window": 60} if spoil is None else None)
    assert sup.snapshots.restored_from is None
    said = [e for e in logs if e["event"].startswith("engine snapshot not used")]
    assert len(said) == 1 and why in said[0]["reason"] and said[0]["log_level"] == "warning"
    warmed = next(e for e in logs if e["event"] == "engine warmed from telemetry")
    assert warmed["from_offset"] == 0 and warmed["records"] == 321  # every record, the started event included
    assert sup.last_step == 320 and sup.engine.last_step == 320


def test_no_snapshot_is_ever_ahead_of_the_stored_cursor_and_a_drained_backlog_is_saved(tmp_path, monkeypatch):
    # A backlog read in several batches: each snapshot is written after its batch's cursor was stored, at it.
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=100_000, interval=100_000, detectors=DETECTORS)
    sup.start()
    sup.reader.max_batch_bytes = 64 << 10
    seen = []
    real = engine_snapshot.save

    def watched(run, inode, offset):
        seen.append((offset, run.store.get_telemetry_cursor(run.run_id).offset))
        return real(run, inode, offset)

    monkeypatch.setattr(engine_snapshot, "save", watched)
    sup.snapshots.policy = SnapshotPolicy(every_records=400, after_backlog_records=50)
    with open(sup.telemetry_path, "a") as fh:  # ~360 records a batch: saved every second batch, and at the end
        fh.write("".join(_line(fos, sup.attempt, s, _healthy_loss(s)) for s in range(1, 2001)))
    while sup.reader.cursor.offset < sup.telemetry_path.stat().st_size:
        sup.tick()
    assert len(seen) >= 3 and all(offset == stored for offset, stored in seen)
    assert seen[-1][0] == sup.telemetry_path.stat().st_size  # the drained backlog's end is saved


def test_a_steady_run_saves_every_n_records_not_on_every_small_batch(tmp_path, monkeypatch):
    # A job read a few records a tick (never a backlog): saved once per `every_records`, whatever the ticks.
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=100_000, interval=100_000, detectors=DETECTORS)
    sup.start()
    saved = []
    real = engine_snapshot.save
    monkeypatch.setattr(engine_snapshot, "save", lambda run, inode, offset: saved.append(offset) or real(run, inode,
                                                                                                         offset))
    sup.snapshots.policy = SnapshotPolicy(every_records=250, after_backlog_records=50)
    for s in range(1, 601, 3):
        fos.advance(1.5)
        with open(sup.telemetry_path, "a") as fh:
            fh.write("".join(_line(fos, sup.attempt, k, _healthy_loss(k)) for k in range(s, s + 3)))
        sup.tick()
    assert sup.last_step == 600 and len(saved) == 2  # at 252 and 504 records (3 a batch)
