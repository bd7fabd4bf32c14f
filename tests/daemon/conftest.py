"""Fixtures of the supervisor tests; helpers live in uls_daemon_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def make_sup(tmp_path):
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    made = []

    def make(spec_path: Path, events: list | None = None, run_id: str | None = None, os_=None):
        spec = load_run_spec(spec_path)
        store = open_store(spec.daemon.resolved_db_path())
        sup = Supervisor(spec, store, os_ or RealOS(), run_id=run_id,
                         say=(events.append if events is not None else None))
        made.append(sup)
        return sup

    yield make
    # No test may leave a job behind.
    for sup in made:
        if sup.job is not None:
            import signal as _s
            pids = sup.os.job_pids(sup.job, sup.marker())
            sup.os.signal_pids(pids, _s.SIGKILL)
