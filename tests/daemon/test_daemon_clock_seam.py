"""The supervisor's loop keeps time only through its OS seam: on a fake OS it never reads the host's monotonic
clock and never sleeps on the host (what a simulated week in a minute needs). The host clock
(daemon/clock.SystemClock) is replaced by one that records who read it and refuses a sleep; the fake OS
advances its own clock. The store is opened with the fake OS as its clock (`open_store(..., clock=)`), so its row
stamps read no host clock either."""

from __future__ import annotations

import sys
import time

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup

from ulyssesd.daemon import clock
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.store.enums import RunState

S = RunState


@pytest.fixture
def host_clock_reads(monkeypatch):
    """Every read of the host's clocks, as (clock, reading module); a sleep on them fails the test there."""
    reads: list[tuple[str, str]] = []
    real = {"time": time.time, "monotonic": time.monotonic}

    def read(name):
        def f(self, *a):
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__") == clock.__name__:
                frame = frame.f_back
            reads.append((name, frame.f_globals.get("__name__", "?")))
            if name == "sleep":
                raise AssertionError("the loop slept on the host clock")
            return real[name]()
        return f

    for name in ("time", "monotonic", "sleep"):
        monkeypatch.setattr(clock.SystemClock, name, read(name))
    return reads


def test_the_seam_is_what_the_finder_patches(host_clock_reads):
    # Negative control: the patched host clock does see a read that goes around the fake OS.
    clock.SYSTEM.monotonic()
    clock.utc_now()
    assert host_clock_reads == [("monotonic", __name__), ("time", __name__)]
    with pytest.raises(AssertionError, match="slept"):
        clock.SYSTEM.sleep(0.0)


STORE_STAMPS: set[tuple[str, str]] = set()  # the store stamps rows on the clock it was opened with: the fake one


def test_a_hang_and_its_relaunch_run_on_the_fake_clock_alone(tmp_path, host_clock_reads):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"stack_dump_wait_s": 2.0, "hang_grace_s": 5.0},
               detectors={"hang_timeout_floor_s": 10.0})
    sup.start()
    first = sup.job
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    for _ in range(40):  # hang: dumps, TERM, KILL, relaunch, each on fake seconds
        if sup.attempt == 2:
            break
        fos.advance(1.0)
        sup.tick()
    assert sup.attempt == 2 and sup.job is not None and sup.job.pid != first.pid
    assert set(host_clock_reads) <= STORE_STAMPS, host_clock_reads


def test_early_deaths_back_off_on_the_fake_clock_alone(tmp_path, host_clock_reads):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"backoff_base_s": 2.0, "backoff_max_s": 100.0, "early_death_s": 30.0},
               remediation={"max_restarts_per_hour": 20, "no_progress_restarts": 20, "max_crash_restarts": 3})
    sup.start()
    for _ in range(200):
        if sup.state == S.FAILED:
            break
        if sup.job is not None and fos.is_alive(sup.job):
            fos.advance(1.0)
            fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
        sup.tick()
        if sup.state == S.BACKOFF:
            fos.advance(0.5)
    assert sup.state == S.FAILED and len(fos.spawns) >= 3
    assert set(host_clock_reads) <= STORE_STAMPS, host_clock_reads


def test_wall_clock_steps_are_no_hang_and_a_real_stall_still_is(tmp_path):
    """The engine's clock is the steady wall clock (daemon/clock.SteadyWall): an hour's forward step of the wall
    clock while the job trains is no hang, nor a backward one that would delay the hang finding; a stall of the
    monotonic clock past the timeout still is (simulator seed 118)."""
    fos = FakeOS()
    sup = _sup(tmp_path, fos, detectors={"hang_timeout_floor_s": 60.0})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    fos.t += 3600.0  # NTP or an operator steps the wall clock; monotonic time does not move
    for _ in range(5):
        fos.advance(1.0)
        sup.tick()
    assert sup.attempt == 1 and sup.state == S.RUNNING
    assert not [i for i in sup.store.list_incidents(sup.run_id) if i.symptom == "hang"]
    fos.t -= 7200.0  # a backward step: the silence that follows is still measured on monotonic time
    for _ in range(90):
        fos.advance(1.0)
        sup.tick()
    assert [i for i in sup.store.list_incidents(sup.run_id) if i.symptom == "hang"]
