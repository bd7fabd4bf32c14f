"""Helpers of the client tests: run a real Supervisor over a spec file until the run ends (bounded)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from ulyssesd.daemon.host.process import RealOS
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.supervisor import Supervisor

DONE = (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


def run_supervised(spec_path: Path, timeout: float = 240.0) -> tuple[Supervisor, list[str]]:
    """Start the run and tick until it is COMPLETED/FAILED/STOPPED; no job survives the call."""
    spec = load_run_spec(spec_path)
    say: list[str] = []
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(), say=say.append)
    sup.start()
    deadline = time.monotonic() + timeout
    try:
        while sup.state not in DONE:
            assert time.monotonic() < deadline, f"state={sup.state} step={sup.last_step}: {say[-10:]}"
            sup.tick()
            time.sleep(0.05)
    finally:
        if sup.job is not None:
            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
    return sup, say
