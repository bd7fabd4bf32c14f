"""Re-adoption: the daemon dies (SIGKILL) mid-run, the job keeps training, a new daemon picks it up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState


def _daemon(spec, log):
    env = dict(os.environ)
    return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _try_store(db):
    """The store once the daemon has created its schema (the file appears a moment before)."""
    from ulyssesd.daemon.store.errors import StoreError

    try:
        return open_store(db, readonly=True) if db.exists() else None
    except StoreError:
        return None


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run_dir):
    p = run_dir / "telemetry.jsonl"
    if not p.exists():
        return -1
    steps = [json.loads(x).get("step", -1) for x in p.read_text().splitlines() if '"kind": "step"' in x]
    return max(steps, default=-1)


@pytest.mark.slow
def test_sigkill_daemon_job_survives_new_daemon_readopts(tmp_path):
    spec = fake_spec(tmp_path, steps=70, interval=10, faults=[{"kind": "nan_loss", "at_step": 35}], step_s=0.1)
    log = tmp_path / "daemon.log"
    d1 = _daemon(spec, log)
    db = tmp_path / "state" / "ulyssesd.db"
    store = _wait(lambda: _try_store(db), 60, "database")
    run = _wait(lambda: store.latest_run(), 30, "run row")
    run_dir = tmp_path / "state" / "runs" / run.id
    _wait(lambda: _steps(run_dir) >= 8, 60, "training progress")
    job_pid = store.list_attempts(run.id)[0].pid
    d1.send_signal(signal.SIGKILL)
    d1.wait(10)
    # The job keeps training with no daemon at all, past the NaN step.
    s0 = _steps(run_dir)
    _wait(lambda: _steps(run_dir) >= 38, 60, "training without a daemon")
    assert _steps(run_dir) > s0 and psutil.pid_exists(job_pid)
    d2 = _daemon(spec, log)
    try:
        assert d2.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if d2.poll() is None:
            d2.kill()
    store = open_store(db, readonly=True)
    run = store.get_run(run.id)
    assert run.state == RunState.COMPLETED, log.read_text()[-3000:]
    atts = store.list_attempts(run.id)
    assert atts[0].pid == job_pid  # attempt 1 was re-adopted, not relaunched
    nan = [i for i in store.list_incidents(run.id) if i.symptom.value == "nan_loss"]
    assert len(nan) == 1 and nan[0].attempt == 1 and nan[0].step == 35, [(i.symptom, i.step) for i in nan]
    inc = store.get_incident(nan[0].id)
    assert inc.actions and inc.actions[0].kind.value == "rollback_skip"
    assert "data.skip_ranges" in inc.actions[0].config_diff
    assert len([r for r in store.list_runs()]) == 1  # the second daemon did not start a second run


def test_cursor_replay_after_daemon_crash_doubles_nothing(tmp_path, make_sup):
    """A daemon that died after recording incidents but before persisting its cursor re-reads those
    records; the store's dedup key makes the replay idempotent."""
    spec = fake_spec(tmp_path, steps=40, interval=10, faults=[{"kind": "loss_spike", "at_step": 12, "steps": 6,
                                                               "magnitude": 30.0}])
    sup = make_sup(spec)
    sup.start()
    run_until(sup, lambda s: len(s.store.list_incidents(s.run_id)) >= 1 or s.state == RunState.COMPLETED, timeout=60)
    before = [(i.attempt, i.symptom.value, i.step) for i in sup.store.list_incidents(sup.run_id)]
    assert before
    job = sup.job
    # Simulate the crash window: cursor persisted at 0, daemon gone; a new daemon adopts.
    sup.store.set_telemetry_cursor(sup.run_id, path=str(sup.telemetry_path), inode=sup.reader.cursor.inode, offset=0)
    sup.job = None
    sup2 = make_sup(spec)
    sup2.start()
    assert sup2.run_id == sup.run_id and sup2.job is not None and sup2.job.pid == job.pid
    run_until(sup2, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=90)
    after = [(i.attempt, i.symptom.value, i.step) for i in sup2.store.list_incidents(sup2.run_id)]
    assert after[: len(before)] == before
    assert len(after) == len(set(after))
