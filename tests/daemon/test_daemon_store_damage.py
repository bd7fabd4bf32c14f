"""A live daemon (real process, the fake job) whose database is deleted mid-run, then overwritten with
random bytes while the daemon is down: the run still COMPLETES, the same job is re-adopted, both
recoveries are incidents, nothing is lost. Then an emptied database with no backup: a fresh run beside the
old run directory is refused (exit 13) with how to adopt or archive it, and `--run-id` adopts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec
from uls_daemon_helpers import wait_for as _wait

from ulyssesd.daemon.core import housekeeping
from ulyssesd.daemon.store import open_store


def _daemon(spec: Path, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec), *extra],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "telemetry.jsonl").read_text().splitlines()
    except OSError:
        return -1
    return max((json.loads(x)["step"] for x in lines if '"kind": "step"' in x), default=-1)


def _damaged(db: Path, run_id: str) -> list:
    return open_store(db, readonly=True).list_incidents(run_id, symptom="store_damaged")


@pytest.mark.slow
def test_db_deleted_then_corrupted_run_still_completes(tmp_path):
    spec = fake_spec(tmp_path, steps=120, interval=10, step_s=0.1, daemon={"backup_every_s": 1.0})
    state = tmp_path / "state"
    db = state / "ulyssesd.db"
    log = tmp_path / "daemon.log"
    d1 = _daemon(spec, log)
    d2 = None
    try:
        run = _wait(lambda: open_store(db, readonly=True).latest_run(), 60, "run row")
        run_dir = state / "runs" / run.id
        _wait(lambda: _steps(run_dir) >= 15 and list((state / "backups").glob("ulyssesd-*.db")), 60, "progress")
        job_pid = open_store(db, readonly=True).list_attempts(run.id)[0].pid

        for suffix in ("", "-wal", "-shm"):  # deleted under the running daemon
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        (inc,) = _wait(lambda: _damaged(db, run.id), 30, "deletion noticed")
        assert "deleted" in inc.summary and inc.status.value == "resolved"
        assert open_store(db, readonly=True).list_attempts(run.id)[0].pid == job_pid  # history kept

        time.sleep(1.5)  # a backup holding the deletion incident
        os.kill(d1.pid, signal.SIGKILL)
        d1.wait(10)
        with db.open("r+b") as fh:  # random bytes while no daemon runs
            fh.write(os.urandom(8192))
        d2 = _daemon(spec, log)
        assert d2.wait(120) == 0, log.read_text()[-3000:]
    finally:
        for d in (d1, d2):
            if d is not None and d.poll() is None:
                os.killpg(d.pid, signal.SIGKILL)
    st = open_store(db, readonly=True)
    run = st.get_run(run.id)
    assert run.state.value == "COMPLETED", log.read_text()[-3000:]
    atts = st.list_attempts(run.id)
    assert atts[0].pid == job_pid  # the same job was re-adopted after the restore, not relaunched
    incs = st.list_incidents(run.id, symptom="store_damaged")
    assert len(incs) == 2 and "restored backup" in incs[1].summary, [i.summary for i in incs]
    assert list(state.glob("ulyssesd.db.damaged-*"))
    assert len(st.list_runs()) == 1

    # Emptied, and no backup left: a fresh run beside the old directory is refused (13) ...
    st.close()
    for b in (state / "backups").glob("*"):
        b.unlink()
    os.truncate(db, 0)
    spec2 = fake_spec(tmp_path, steps=20, interval=10, name="fresh")
    r = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec2)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 13, r.stderr
    assert f"--run-id {run.id}" in r.stderr and "archive" in r.stderr and "Traceback" not in r.stderr
    # ... and `--run-id` adopts it: it had completed, so it is recorded COMPLETED, not relaunched.
    r = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec), "--run-id", run.id],
                       capture_output=True, text=True, timeout=120)
    st = open_store(db, readonly=True)
    assert st.get_run(run.id).state.value == "COMPLETED", r.stderr[-2000:]
    assert st.latest_checkpoint(run.id) is not None
    assert len(st.list_incidents(run.id, symptom="store_damaged")) == 1


def test_failed_integrity_check_mid_run_is_an_incident(tmp_path, make_sup, monkeypatch):
    from ulyssesd.daemon.store.records import MaintenanceResult

    spec = fake_spec(tmp_path, steps=5)
    sup = make_sup(spec)
    sup.start()
    housekeeping.maintenance(sup)  # healthy: nothing recorded
    assert sup.store.list_incidents(sup.run_id, symptom="store_damaged") == []
    bad = MaintenanceResult(ok=False, integrity=["*** in database main ***", "Page 7: btreeInitPage() returns error"],
                            wal_busy=0, wal_frames=0, wal_checkpointed=0, db_bytes=0, wal_bytes_before=0,
                            wal_bytes_after=0, seconds=0.0)
    monkeypatch.setattr(sup.store, "maintenance", lambda **kw: bad)
    housekeeping.maintenance(sup)
    (inc,) = sup.store.list_incidents(sup.run_id, symptom="store_damaged")
    assert "btreeInitPage" in inc.summary and inc.severity.value == "critical"


@pytest.mark.parametrize("damage", ["header", "emptied", "unsalvageable"])
def test_db_damaged_under_the_running_daemon_is_recovered_in_place(tmp_path, make_sup, monkeypatch, damage):
    from uls_daemon_helpers import run_until

    from ulyssesd.daemon.store.enums import RunState
    from ulyssesd.daemon.store.recovery import write_backup

    spec = fake_spec(tmp_path, steps=60, interval=10, step_s=0.05)
    events: list[str] = []
    sup = make_sup(spec, events=events)
    sup.start()
    run_until(sup, lambda s: (s.last_step or 0) >= 12, timeout=60)
    write_backup(sup.store, tmp_path / "state" / "backups")
    run_until(sup, lambda s: (s.last_step or 0) >= 25, timeout=60)
    db = sup.store.path
    if damage == "emptied":
        os.truncate(db, 0)
    else:
        with open(db, "r+b") as fh:
            fh.write(os.urandom(4096))
    if damage == "unsalvageable":  # the open connection cannot be copied either: the newest backup is used
        def broken(dest):
            raise OSError("simulated: the open connection reads garbage too")
        monkeypatch.setattr(sup.store, "backup_into", broken)
    sup.tick()
    (inc,) = sup.store.list_incidents(sup.run_id, symptom="store_damaged")
    assert inc.evidence["damaged_kept_as"], inc.summary
    if damage == "unsalvageable":
        assert "recovered from" in inc.summary and "backups/ulyssesd-" in inc.summary and "not in the store" in inc.summary
        monkeypatch.undo()
    else:
        assert "recovered from the daemon's open connection, nothing lost" in inc.summary
    assert any("WARNING" in e for e in events)
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=90)
    assert sup.state == RunState.COMPLETED
    reader = open_store(db, readonly=True)  # the file at the path is sound and holds the end of the run
    assert reader.get_run(sup.run_id).state == RunState.COMPLETED
    assert reader.latest_checkpoint(sup.run_id).step == 60
    assert len(reader.list_incidents(sup.run_id, symptom="store_damaged")) == 1


@pytest.mark.slow
def test_damaged_pages_under_a_live_daemon_lose_nothing(tmp_path):
    """Random bytes over every page but the header while the daemon runs. In WAL mode the daemon's pages
    usually live in the WAL and its cache, so it may never read a damaged one and finish normally (its
    backups, copied through its connection, stay sound); if it does read one it exits 14 with one line, the
    job keeps training, and the restart (what systemd does) restores the newest backup. Either way the
    completed run is what the next start finds, on the same job."""
    from ulyssesd.daemon.store.recovery import open_daemon_store

    spec = fake_spec(tmp_path, steps=150, interval=10, step_s=0.1, daemon={"backup_every_s": 1.0})
    state = tmp_path / "state"
    db = state / "ulyssesd.db"
    log = tmp_path / "daemon.log"
    d1 = _daemon(spec, log)
    d2 = None
    try:
        run = _wait(lambda: open_store(db, readonly=True).latest_run(), 60, "run row")
        run_dir = state / "runs" / run.id
        _wait(lambda: _steps(run_dir) >= 15 and list((state / "backups").glob("ulyssesd-*.db")), 60, "progress")
        job_pid = open_store(db, readonly=True).list_attempts(run.id)[0].pid
        with db.open("r+b") as fh:  # page 1 (header) intact: the per-tick header check cannot see it
            page = int.from_bytes(fh.read(18)[16:18], "big")
            size = db.stat().st_size
            fh.seek(page)
            fh.write(os.urandom(max(size - page, 8 * page)))
        rc = d1.wait(120)
        text = log.read_text()
        assert rc in (0, 14) and "Traceback" not in text, text[-3000:]
        if rc == 14:
            assert "exiting 14" in text
            d2 = _daemon(spec, log)
            assert d2.wait(120) == 0, log.read_text()[-3000:]
    finally:
        for d in (d1, d2):
            if d is not None and d.poll() is None:
                os.killpg(d.pid, signal.SIGKILL)
    opened = open_daemon_store(db, state)  # the next start: probe, restore if the file is damaged
    st = opened.store
    assert st.get_run(run.id).state.value == "COMPLETED"
    assert st.list_attempts(run.id)[0].pid == job_pid
    st.close()


def test_damage_found_by_the_loop_exits_14_with_one_line(tmp_path, monkeypatch, capsys):
    import sqlite3

    from ulyssesd.daemon import cli
    from ulyssesd.daemon.supervisor import Supervisor

    def damaged(self, poll=None):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(Supervisor, "run_forever", damaged)
    spec = fake_spec(tmp_path, steps=2000, step_s=0.2)
    try:
        assert cli.run_daemon(str(spec), preflight=False) == cli.EXIT_STORE_DAMAGED
    finally:
        st = open_store(tmp_path / "state" / "ulyssesd.db", readonly=True)
        for a in st.list_attempts(st.latest_run().id):  # the job keeps running by design: end it here
            try:
                os.killpg(a.pgid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
    err = capsys.readouterr().err
    assert "damaged" in err and "exiting 14" in err and "Traceback" not in err
    assert not list((tmp_path / "state" / "backups").glob("ulyssesd-*.db"))  # no backup of a damaged store
