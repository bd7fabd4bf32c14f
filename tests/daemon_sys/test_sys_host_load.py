"""The OS seam's host scan (slow-step evidence) with the real psutil: a CPU hog is seen, with its pid and its
command line; the slow-step evidence built from it names the hog and leaves the daemon itself out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

from ulyssesd.daemon.core.decisions import host_evidence
from ulyssesd.daemon.host.process import HostLoad, RealOS


def _hog():
    return subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 20\nwhile time.time() < t: pass",
                             "cpu-hog-marker"])


def test_real_host_load_sees_a_cpu_hog():
    hog = _hog()
    try:
        time.sleep(0.3)
        load = RealOS().host_load()
        assert isinstance(load, HostLoad) and len(load.load_avg) == 3 and (load.cpu_count or 0) >= 1
        (row,) = [r for r in load.processes if r[1] == hog.pid]
        assert row[0] > 20.0, row  # a busy loop: far above idle
        assert "cpu-hog-marker" in row[2]
        assert load.processes == sorted(load.processes, reverse=True)
    finally:
        hog.kill()
        hog.wait()


class _FakeLoadOS:
    def __init__(self, rows):
        self.rows = rows

    def host_load(self):
        return HostLoad([3.0, 2.0, 1.0], 2, self.rows)


def test_slow_step_evidence_names_other_hogs_not_the_job_or_the_daemon():
    rows = [(99.0, 4242, "hog"), (50.0, os.getpid(), "ulyssesd"), (10.0, 77, "job rank")]
    sup = SimpleNamespace(last_step_record=None, job=object(), os=_FakeLoadOS(rows), marker=lambda: None)
    sup.os.job_pids = lambda job, marker=None: [77]
    ev = host_evidence(sup)
    assert ev["load_avg"] == [3.0, 2.0, 1.0] and ev["cpu_count"] == 2
    assert ev["top_other_processes"] == [{"pid": 4242, "cpu_percent": 99.0, "cmd": "hog"}]
    assert ev["job_cpu_percent"] == {77: 10.0}


def test_quiet_host_gives_no_suspects():
    sup = SimpleNamespace(last_step_record=None, job=None, os=_FakeLoadOS([]), marker=lambda: None)
    ev = host_evidence(sup)
    assert ev["top_other_processes"] == [] and ev["job_cpu_percent"] == {}
