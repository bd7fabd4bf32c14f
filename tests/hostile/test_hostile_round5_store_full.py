"""The state dir's disk fills under a running supervisor (the probe: a 9 MiB state dir). Before, the store
write failed, its recovery failed too, the run sat RUNNING with no job and `stop` answered `internal`
(`IllegalTransition RUNNING -> STOPPED`); freeing space relaunched nothing. Now the supervisor says so in
`status`, leaves the job alone, retries with backoff, accepts `stop`, and goes on once space is back.

A real full file system: a 9 MiB tmpfs mounted over the state dir (needs CAP_SYS_ADMIN; skipped elsewhere),
the fake job (tests/daemon/fakejob_ulysses.py) writing its telemetry there too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from uls_daemon_helpers import fake_spec  # noqa: E402

from ulyssesd.daemon.host.process import RealOS  # noqa: E402
from ulyssesd.daemon.safety import store_health  # noqa: E402
from ulyssesd.daemon.spec import load_run_spec  # noqa: E402
from ulyssesd.daemon.store import open_store  # noqa: E402
from ulyssesd.daemon.store.enums import RunState  # noqa: E402
from ulyssesd.daemon.supervisor import Supervisor  # noqa: E402


@pytest.fixture
def small_state_dir(tmp_path):
    mnt = tmp_path / "state"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    with filler.open("wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


def _ticks(sup: Supervisor, seconds: float, until=lambda s: False) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until(sup):
        sup.tick()
        time.sleep(0.05)


def _start(tmp_path: Path) -> Supervisor:
    spec = load_run_spec(fake_spec(tmp_path, steps=40, interval=1000, step_s=0.1))
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS())
    sup.start()
    _ticks(sup, 60, lambda s: (s.last_step or 0) >= 5)
    return sup


def _kill(sup: Supervisor) -> None:
    if sup.job is not None:
        sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)


def test_a_full_state_dir_is_reported_the_job_left_alone_and_the_run_goes_on_once_freed(small_state_dir, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(store_health, "MAX_S", 2.0)
    sup = _start(tmp_path)
    try:
        filler = _fill(small_state_dir)
        _ticks(sup, 8)
        st = sup.handle_command({"cmd": "status"})["status"]
        assert st["store"]["writable"] is False and "full" in st["store"]["error"], st["store"]
        assert sup.state not in (RunState.FAILED, RunState.STOPPED, RunState.COMPLETED), sup.state
        assert sup.job is not None  # the job (or its unprocessed exit) is kept, nothing relaunched or failed
        os.unlink(filler)  # space is back
        _ticks(sup, 120, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED))
        assert sup.state == RunState.COMPLETED, sup.state
        assert sup.handle_command({"cmd": "status"})["status"]["store"]["writable"] is True
        assert sup.store.get_run(sup.run_id).state == RunState.COMPLETED
        first = sup.store.list_attempts(sup.run_id)[0]  # the exit kept while the store was full keeps its code
        assert first.returncode is not None or first.signal is not None, first
    finally:
        _kill(sup)


def test_stop_is_accepted_while_the_store_cannot_be_written_and_stored_once_it_can(small_state_dir, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr(store_health, "MAX_S", 2.0)
    sup = _start(tmp_path)
    try:
        filler = _fill(small_state_dir)
        _ticks(sup, 6)
        answer = sup.handle_command({"cmd": "stop"})
        assert answer.get("ok") is True, answer  # the probe: internal, IllegalTransition RUNNING -> STOPPED
        _ticks(sup, 30, lambda s: s.state == RunState.STOPPED)
        assert sup.state == RunState.STOPPED
        assert sup.store_health.pending_states  # not stored yet: the disk is still full
        os.unlink(filler)
        _ticks(sup, 30, lambda s: not s.store_health.pending_states)
        assert sup.store.get_run(sup.run_id).state == RunState.STOPPED
    finally:
        _kill(sup)


def test_ulyssesctl_status_shows_a_store_that_cannot_be_written():
    from rich.console import Console

    from ulyssesd.daemon.operator.ctl_status import render_status

    d = {"run_id": "r1", "state": "RUNNING", "state_reason": None, "daemon": "running", "daemon_pid": 7,
         "attempt": 1, "restarts": 0, "operator_relaunches": 0, "step": 5, "loss": 2.0, "tokens_per_s": None,
         "mem_max_allocated_gib": None, "latest_checkpoint": None, "known_good_checkpoint": None,
         "config_version": 1, "config_diff_from_v1": {}, "open_incidents": 0, "open_incident_list": [],
         "run_dir": "/x", "daemon_state": "STOPPED",
         "store": {"writable": False, "error": "OperationalError: database or disk is full", "since_s": 12.0,
                   "next_retry_s": 3.0, "note": "free space there"}}
    console = Console(record=True, width=300)
    console.print(render_status(d))
    text = console.export_text()
    assert "NOT WRITABLE" in text and "database or disk is full" in text and "the daemon's state: STOPPED" in text
    d["store"] = {"writable": True}
    console = Console(record=True, width=300)
    console.print(render_status(d))
    assert "NOT WRITABLE" not in console.export_text()


def test_only_a_store_that_cannot_take_writes_enters_the_degraded_mode(tmp_path):
    import errno
    import sqlite3

    from sqlalchemy.exc import OperationalError

    full = OperationalError("INSERT ...", {}, sqlite3.OperationalError("database or disk is full"))
    assert store_health.is_store_write_error(full)
    assert store_health.is_store_write_error(OSError(errno.ENOSPC, "No space left on device"))
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("writing the attempt row failed") from inner
    except RuntimeError as chained:
        assert store_health.is_store_write_error(chained)
    # A bug is a bug: the step guard's incident and step_error_limit still apply to it.
    for exc in (ValueError("bad"), OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: runs")),
                OSError(errno.ENOENT, "No such file")):
        assert not store_health.is_store_write_error(exc)
    store_health.probe_state_dir(tmp_path)  # a writable dir: no error, no file left
    assert not list(tmp_path.iterdir())
