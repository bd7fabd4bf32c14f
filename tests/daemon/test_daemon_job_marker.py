"""The attempt marker keeps two daemons apart whose runs share a name and a start second."""

from __future__ import annotations

import os
import subprocess
import sys

from ulyssesd.daemon.host.process import JobHandle, RealOS
from ulyssesd.daemon.job.launcher import JOB_MARKER_ENV, build_launch, job_marker
from ulyssesd.daemon.spec import LauncherSection


def test_same_run_id_in_two_state_dirs_gives_two_markers(tmp_path):
    a, b = tmp_path / "a" / "runs" / "r-20261129-120000", tmp_path / "b" / "runs" / "r-20261129-120000"
    launcher = LauncherSection(kind="local")
    pa = build_launch(launcher, run_id="r-20261129-120000", run_dir=a, attempt=1, config_version=1, base_env={})
    pb = build_launch(launcher, run_id="r-20261129-120000", run_dir=b, attempt=1, config_version=1, base_env={})
    assert pa.marker != pb.marker and pa.env[JOB_MARKER_ENV] == pa.marker[1]
    assert pa.marker == job_marker("r-20261129-120000", a, 1)  # what the supervisor recomputes on re-adoption
    assert job_marker("r-20261129-120000", a, 2) != pa.marker


def test_marker_scan_finds_only_its_own_daemons_processes(tmp_path):
    mine, other = job_marker("r", tmp_path / "a", 1), job_marker("r", tmp_path / "b", 1)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, JOB_MARKER_ENV: m[1]}, start_new_session=True)
             for m in (mine, other)]
    try:
        found = RealOS().job_pids(JobHandle(2**22 + 12345, 0.0), mine)  # no live root: the marker scan alone
        assert procs[0].pid in found and procs[1].pid not in found
    finally:
        for p in procs:
            p.kill()
            p.wait()
