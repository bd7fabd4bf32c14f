"""Re-adoption that cannot kill a live job by mistake (a restarted daemon once read `alive: false` 10 ms before
the job's next line, ended the attempt "exit status unknown" and relaunched a healthy job).

The stress test restarts the supervisor hundreds of times (a new Supervisor over the same store and run: what a
restarted daemon builds) while a user's script prints a line every few milliseconds, and requires zero false
"gone": the one attempt stays open, nothing is relaunched. The process check is made to fail on half of the
restarts (a start time that does not match, as a clock step or a psutil rounding gives), so the other signs
(fresh output, the attempt's processes) must carry the verdict. A job that really died is still found gone."""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_hostile_round5_daemon import command_spec

from ulyssesd.daemon.host.process import JobHandle, RealOS
from ulyssesd.daemon.safety import liveness
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.supervisor import Supervisor

pytestmark = pytest.mark.slow
RESTARTS = int(os.environ.get("ULYSSESD_READOPT_RESTARTS", "200"))


class SkewedOS(RealOS):
    """The real OS whose process check misreads the wrapper's start time (by 2 s) when `skew` is set."""

    skew = False

    def _same_process(self, job: JobHandle):  # type: ignore[override]
        if self.skew:
            job = JobHandle(job.pid, job.start_time + 2.0)
        return super()._same_process(job)


def _adopt(spec, run_id: str, skew: bool) -> Supervisor:
    os_ = SkewedOS()
    os_.skew = skew
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), os_, run_id=run_id)
    sup.start()
    return sup


def _leave(sup: Supervisor) -> None:
    """The daemon goes away, the job stays (a restart)."""
    if sup.scheduler is not None:
        sup.scheduler.shutdown()
    sup.store.close()


def test_hundreds_of_daemon_restarts_against_a_chatty_job_never_call_it_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(liveness, "CONFIRM_S", 0.5)
    spec_path = command_spec(tmp_path, ["--steps", "1000000", "--sleep", "0.004"])
    spec = load_run_spec(spec_path)
    first = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS())
    first.start()
    deadline = time.monotonic() + 60
    while (first.last_step or 0) < 5:
        assert time.monotonic() < deadline
        first.tick()
        time.sleep(0.02)
    run_id, job = first.run_id, first.job
    assert job is not None
    _leave(first)
    false_gone = overruled = 0
    try:
        for i in range(RESTARTS):
            sup = _adopt(spec, run_id, skew=i % 2 == 1)
            # Every tenth restart (a skewed one) stays twice the confirmation window: only the other signs
            # (the output growing, the attempt's processes) can keep the verdict from "gone" there.
            hold = time.monotonic() + (2 * liveness.CONFIRM_S if i % 10 == 5 else 0.03)
            while True:
                sup.tick()
                time.sleep(0.01)
                if time.monotonic() >= hold:
                    break
            if sup.job is None or sup.attempt != 1 or sup.state not in (RunState.RUNNING, RunState.STARTING):
                false_gone += 1
            overruled += sup.gone_check.overruled
            _leave(sup)
        store = open_store(spec.daemon.resolved_db_path(), readonly=True)
        attempts = store.list_attempts(run_id)
        assert false_gone == 0 and len(attempts) == 1 and attempts[0].ended_at is None, (false_gone, attempts)
        assert overruled > 0  # the held restarts were decided by the other signs, not by the window alone
        # Still alive and printing after the restarts.
        assert os.kill(job.pid, 0) is None
        # The healthy opposite: a job that really died is found gone (and relaunched) within the window.
        sup = _adopt(spec, run_id, skew=False)
        os.killpg(job.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while sup.attempt == 1:
            assert time.monotonic() < deadline, "a dead job was never found gone"
            sup.tick()
            time.sleep(0.05)
        assert sup.store.list_attempts(run_id)[0].ended_at is not None
        if sup.job is not None:
            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
    finally:
        try:
            os.killpg(job.pgid, signal.SIGKILL)
        except OSError:
            pass
