"""A store that survives damage (store/recovery/): real SQLite files damaged the ways an operator or a
disk does it — random bytes, truncation, emptied to 0 bytes, deleted while open — and real run
directories (config files, checkpoint tags with manifests, telemetry) to re-derive from."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import IncidentStatus, RunState, Symptom
from ulyssesd.daemon.store.recovery import (
    UnknownRunDirs,
    list_backups,
    mend_replaced_file,
    open_daemon_store,
    probe_db_file,
    refuse_unknown_run_dirs,
    write_backup,
)
from ulyssesd.training import checkpoint as ck

RUN = "run-a"


def _tag(ckpt_dir: Path, step: int, loss: float) -> str:
    tag = ck.tag_for_step(step)
    d = ckpt_dir / tag
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(os.urandom(2048))
    ck.write_manifest(d, step, loss, samples_seen=step * 4, config_version=1)
    return tag


def _steps(path: Path, start: int, stop: int) -> None:
    with path.open("a") as fh:
        for s in range(start, stop):
            fh.write(json.dumps({"kind": "step", "step": s, "loss": 2.0, "time": 1.0e9 + s}) + "\n")


def _state_with_run(tmp_path: Path):
    """A state dir whose store knows RUN at step 10 (v1, one checkpoint, cursor at step 9); backed up."""
    state = tmp_path / "state"
    run_dir = state / "runs" / RUN
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    (run_dir / "configs" / "v1.json").write_text(json.dumps({"train": {"lr": 1e-3}}))
    (run_dir / "logs" / "attempt-1.log").write_text("attempt 1\n")
    _steps(run_dir / "telemetry.jsonl", 0, 10)
    _tag(run_dir / "checkpoints", 5, 2.5)
    store = open_store(state / "ulyssesd.db")
    store.create_run(RUN, spec={}, run_dir=str(run_dir), state=RunState.RUNNING)
    store.add_config_version(RUN, {"train": {"lr": 1e-3}, "launcher": {"env": {}}}, reason="initial", version=1)
    store.add_attempt(RUN, command=["x"], number=1)
    store.upsert_checkpoint(RUN, "step-00000005", 5, loss=2.5)
    tel = run_dir / "telemetry.jsonl"
    store.set_telemetry_cursor(RUN, path=tel, inode=tel.stat().st_ino, offset=tel.stat().st_size, last_step=9)
    backup = write_backup(store, state / "backups")
    return state, run_dir, store, backup


def _advance_run_dir(run_dir: Path) -> None:
    """What the run did after the backup: v2, a newer checkpoint, attempt 2 (ended), 20 more steps."""
    (run_dir / "configs" / "v2.json").write_text(json.dumps({"train": {"lr": 5e-4}}))
    _tag(run_dir / "checkpoints", 20, 2.1)
    (run_dir / "logs" / "attempt-2.log").write_text("attempt 2\n")
    (run_dir / "attempts").mkdir(exist_ok=True)
    (run_dir / "attempts" / "1.exit").write_text(json.dumps({"returncode": 1, "signal": None, "ended": 1.0}))
    _steps(run_dir / "telemetry.jsonl", 10, 30)


def _random_bytes(db: Path) -> None:
    with db.open("r+b") as fh:
        fh.seek(0)
        fh.write(os.urandom(4096))


def _truncate(db: Path) -> None:
    os.truncate(db, db.stat().st_size // 2 + 100)


def _empty(db: Path) -> None:
    os.truncate(db, 0)


def test_probe_healthy_and_pending_wal_is_fine(tmp_path):
    store = open_store(tmp_path / "x.db")
    store.create_run("r", spec={}, run_dir="/r")  # sits in the -wal, not checkpointed yet
    assert Path(f"{tmp_path / 'x.db'}-wal").stat().st_size > 0
    assert probe_db_file(tmp_path / "x.db") is None
    assert probe_db_file(tmp_path / "missing.db") is None
    store.close()


@pytest.mark.parametrize("damage,expect", [(_random_bytes, "not an SQLite database"),
                                           (_truncate, "truncated"), (_empty, "empty (0 bytes)")])
def test_probe_names_the_damage(tmp_path, damage, expect):
    store = open_store(tmp_path / "x.db")
    for i in range(50):
        store.create_run(f"r{i}", spec={"pad": "x" * 2000}, run_dir="/r")
    store.maintenance()  # checkpoint: the rows are in the main file
    store.close()
    damage(tmp_path / "x.db")
    assert expect in (probe_db_file(tmp_path / "x.db") or "")


def test_probe_finds_damaged_pages_behind_a_sound_header(tmp_path):
    store = open_store(tmp_path / "x.db")
    for i in range(200):
        store.create_run(f"r{i}", spec={"pad": "x" * 2000}, run_dir="/r")
    store.maintenance()
    store.close()
    with (tmp_path / "x.db").open("r+b") as fh:  # page 1 (header, schema) intact, data pages garbage
        fh.seek(8192)
        fh.write(os.urandom(64 * 1024))
    problem = probe_db_file(tmp_path / "x.db")
    assert problem and ("quick_check" in problem or "malformed" in problem), problem


def test_backups_are_atomic_private_and_bounded(tmp_path):
    os.umask(0)
    try:
        store = open_store(tmp_path / "state" / "ulyssesd.db")
        store.create_run("r", spec={}, run_dir="/r")
        stop = threading.Event()

        def writer():  # the daemon keeps writing while the backup runs
            i = 0
            while not stop.is_set():
                store.record_incident("r", attempt=1, symptom="crash", step=i)
                i += 1

        t = threading.Thread(target=writer)
        t.start()
        try:
            made = [write_backup(store, tmp_path / "state" / "backups", keep=3) for _ in range(5)]
        finally:
            stop.set()
            t.join()
        kept = list_backups(tmp_path / "state" / "backups")
        assert kept == sorted(made[-3:], reverse=True)
        assert not list((tmp_path / "state" / "backups").glob(".*tmp"))
        for b in kept:
            assert stat.S_IMODE(b.stat().st_mode) == 0o640 and probe_db_file(b) is None
            assert open_store(b, readonly=True).get_run("r").id == "r"
        assert stat.S_IMODE((tmp_path / "state" / "backups").stat().st_mode) == 0o750
        assert stat.S_IMODE((tmp_path / "state" / "ulyssesd.db").stat().st_mode) == 0o640
        assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o750
    finally:
        os.umask(0o022)


@pytest.mark.parametrize("damage", [_random_bytes, _truncate, _empty], ids=["random-bytes", "truncated", "emptied"])
def test_damaged_db_restored_from_backup_and_run_rederived(tmp_path, damage):
    state, run_dir, store, backup = _state_with_run(tmp_path)
    _advance_run_dir(run_dir)
    store.maintenance()
    store.close()
    db = state / "ulyssesd.db"
    damage(db)
    said: list[str] = []
    opened = open_daemon_store(db, state, say=said.append)
    st = opened.store
    assert opened.restore is not None and opened.restore.backup == str(backup)
    assert any("damaged" in m for m in said)
    # the damaged file is kept for a human, not overwritten
    assert any(Path(p).name.startswith("ulyssesd.db.damaged-") for p in opened.restore.damaged_kept_as)
    assert [c.version for c in st.list_config_versions(RUN)] == [1, 2]
    assert st.get_config_version(RUN).config["train"]["lr"] == 5e-4
    assert [c.tag for c in st.list_checkpoints(RUN)] == ["step-00000005", "step-00000020"]
    assert st.latest_checkpoint(RUN).loss == pytest.approx(2.1)
    atts = st.list_attempts(RUN)
    assert [a.number for a in atts] == [1, 2]
    assert atts[0].ended_at is not None and atts[0].returncode == 1  # from attempts/1.exit
    cur = st.get_telemetry_cursor(RUN)
    tel = run_dir / "telemetry.jsonl"
    assert (cur.offset, cur.last_step, cur.inode) == (tel.stat().st_size, 29, tel.stat().st_ino)
    (inc,) = st.list_incidents(RUN, symptom=Symptom.store_damaged)
    assert inc.status == IncidentStatus.resolved and inc.step == 29 and inc.attempt == 2
    assert backup.name in inc.summary and "2 checkpoint" not in inc.summary  # one new tag re-derived
    assert inc.evidence["checkpoints"] == ["step-00000020"] and inc.evidence["config_versions"] == [2]
    assert stat.S_IMODE(db.stat().st_mode) == 0o640
    # a second start finds a sound file: no second recovery, no second incident
    st.close()
    again = open_daemon_store(db, state)
    assert again.restore is None and len(again.store.list_incidents(RUN, symptom="store_damaged")) == 1
    again.store.close()


def test_healthy_db_is_left_alone(tmp_path):
    state, run_dir, store, _ = _state_with_run(tmp_path)
    store.close()
    opened = open_daemon_store(state / "ulyssesd.db", state)
    assert opened.restore is None and opened.incidents == []
    assert not list(state.glob("ulyssesd.db.damaged-*"))
    opened.store.close()


def test_emptied_db_without_backup_refuses_a_fresh_run_beside_the_old_one(tmp_path):
    state, run_dir, store, backup = _state_with_run(tmp_path)
    store.close()
    backup.unlink()
    _empty(state / "ulyssesd.db")
    opened = open_daemon_store(state / "ulyssesd.db", state)
    # no sound backup: an empty store, and the run directory is not adopted behind the operator's back
    assert opened.restore is not None and opened.restore.backup is None
    assert opened.store.list_runs() == []
    with pytest.raises(UnknownRunDirs, match=f"--run-id {RUN}"):
        refuse_unknown_run_dirs(opened.store, state, "fresh", None)
    opened.store.close()


def test_missing_db_with_backups_is_restored(tmp_path):
    state, run_dir, store, backup = _state_with_run(tmp_path)
    store.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{state / 'ulyssesd.db'}{suffix}").unlink(missing_ok=True)
    opened = open_daemon_store(state / "ulyssesd.db", state)
    assert opened.restore.backup == str(backup) and "missing" in opened.restore.problem
    assert opened.store.get_run(RUN).state == RunState.RUNNING
    opened.store.close()


def test_completed_run_dir_is_adopted_as_completed_not_relaunched(tmp_path):
    state, run_dir, store, backup = _state_with_run(tmp_path)
    store.close()
    (run_dir / "attempts").mkdir()
    (run_dir / "attempts" / "1.exit").write_text(json.dumps({"returncode": 0, "signal": None, "ended": 2.0}))
    with (run_dir / "telemetry.jsonl").open("a") as fh:
        fh.write(json.dumps({"kind": "event", "event": "exiting", "reason": "completed", "step": 9}) + "\n")
    st = open_store(tmp_path / "other.db")  # a database that never knew the run (e.g. --run-id adoption)
    from ulyssesd.daemon.store.recovery import adopt_run_dir, rederive_run, settle_adopted_state

    run = adopt_run_dir(st, run_dir, RUN, spec_path=None)
    what = rederive_run(st, RUN, run_dir)
    settle_adopted_state(st, run, what)
    assert st.get_run(RUN).state == RunState.COMPLETED and what["completed"]
    st.close()


def test_unknown_run_dirs_refused_with_how_to_adopt_or_archive(tmp_path):
    state = tmp_path / "state"
    (state / "runs" / "old-run").mkdir(parents=True)
    store = open_store(state / "ulyssesd.db")  # a sound database that does not know old-run
    with pytest.raises(UnknownRunDirs) as exc:
        refuse_unknown_run_dirs(store, state, "new-run", "/etc/run.toml")
    msg = str(exc.value)
    assert "old-run" in msg and "--run-id old-run" in msg and "mv " in msg and "archive" in msg
    store.create_run("old-run", spec={}, run_dir=str(state / "runs" / "old-run"))
    refuse_unknown_run_dirs(store, state, "new-run", "/etc/run.toml")  # known now: no refusal
    store.close()


@pytest.mark.parametrize("also_wal", [False, True], ids=["db-only", "db-wal-shm"])
def test_db_deleted_mid_run_is_recreated_from_the_open_connection(tmp_path, also_wal):
    db = tmp_path / "state" / "ulyssesd.db"
    store = open_store(db)
    store.create_run("r", spec={}, run_dir="/r")
    assert mend_replaced_file(store) is None  # healthy: nothing done
    store.record_incident("r", attempt=1, symptom="crash", step=1)
    for suffix in ("", "-wal", "-shm") if also_wal else ("",):
        Path(f"{db}{suffix}").unlink()
    assert "deleted" in store.file_problem()
    problem = mend_replaced_file(store)
    assert problem and "deleted" in problem
    assert store.file_problem() is None
    store.record_incident("r", attempt=1, symptom="crash", step=2)  # goes to the new, visible file
    reader = open_store(db, readonly=True)
    assert [i.step for i in reader.list_incidents("r")] == [1, 2]
    assert stat.S_IMODE(db.stat().st_mode) == 0o640
    reader.close()
    store.close()


def test_db_replaced_mid_run_keeps_the_foreign_file(tmp_path):
    db = tmp_path / "state" / "ulyssesd.db"
    store = open_store(db)
    store.create_run("r", spec={}, run_dir="/r")
    os.replace(tmp_path / "state" / "ulyssesd.db", tmp_path / "moved.db")
    db.write_bytes(b"someone else's file")
    assert "replaced" in mend_replaced_file(store)
    assert [p.read_bytes() for p in db.parent.glob("ulyssesd.db.foreign-*")] == [b"someone else's file"]
    assert open_store(db, readonly=True).get_run("r").id == "r"
    store.close()


def test_restored_mid_restart_state_does_not_kill_the_newer_live_attempt(tmp_path, monkeypatch):
    """The backup says RESTARTING (attempt 1); since then attempt 2 was launched and trains. After the
    restore the run is RUNNING with attempt 2 live, so re-adoption keeps the job instead of "finishing"
    the restart by killing it."""
    from ulyssesd.daemon.store.recovery import rederive

    state, run_dir, store, backup = _state_with_run(tmp_path)
    store.set_run_state(RUN, RunState.RESTARTING, "restart")
    backup.unlink()
    write_backup(store, state / "backups")
    store.close()
    (run_dir / "logs" / "attempt-2.log").write_text("attempt 2\n")
    (run_dir / "attempts").mkdir()
    (run_dir / "attempts" / "1.exit").write_text(json.dumps({"returncode": -15, "signal": 15, "ended": 1.0}))
    monkeypatch.setattr(rederive, "find_live_job", lambda rid, rdir, n: (os.getpid(), 123.0) if n == 2 else None)
    _random_bytes(state / "ulyssesd.db")
    st = open_daemon_store(state / "ulyssesd.db", state).store
    assert st.get_run(RUN).state == RunState.RUNNING
    att = st.open_attempt(RUN)
    assert (att.number, att.pid, att.proc_start_time) == (2, os.getpid(), 123.0)
    assert st.get_attempt(RUN, 1).ended_at is not None
    st.close()


def test_telemetry_end_skips_a_torn_or_hostile_last_line(tmp_path):
    from ulyssesd.daemon.store.recovery import telemetry_end

    tel = tmp_path / "telemetry.jsonl"
    _steps(tel, 1, 8)
    healthy = telemetry_end(tel)
    assert healthy is not None and healthy[1:] == (tel.stat().st_size, 7)
    # A line nested 100k deep (json.loads raises RecursionError, not ValueError), then a torn line: the
    # cursor goes after the deep line (it is complete) and the last step is still the last real one.
    with tel.open("ab") as fh:
        fh.write(b"[" * 100_000 + b"]" * 100_000 + b"\n")
        fh.write(b'{"kind": "step", "step": 9, "lo')
    inode, offset, last_step = telemetry_end(tel)
    assert (inode, last_step) == (tel.stat().st_ino, 7)
    assert offset == tel.stat().st_size - len(b'{"kind": "step", "step": 9, "lo')


def test_adopting_a_run_dir_whose_spec_is_a_fifo_does_not_hang(tmp_path):
    from ulyssesd.daemon.store.recovery import adopt_run_dir

    run_dir = tmp_path / "runs" / RUN
    run_dir.mkdir(parents=True)
    os.mkfifo(run_dir / "spec.toml")  # open() for reading would block until a writer appears
    st = open_store(tmp_path / "other.db")
    done: list = []
    worker = threading.Thread(target=lambda: done.append(adopt_run_dir(st, run_dir, RUN, spec_path=None)),
                              daemon=True)
    worker.start()
    worker.join(20)
    assert done, "adopt_run_dir blocked on a FIFO spec.toml"
    assert done[0].spec == {} and done[0].state == RunState.STARTING
    st.close()
