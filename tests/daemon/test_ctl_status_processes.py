"""`ulyssesctl status` shows the live attempt's launcher pid, process group and rank pids (what an operator
needs for py-spy, kill and nvidia-smi's pid column), from the daemon's rank watch when it answers, else from
this host's process table; nothing once the attempt ended. Real processes: a fake-job run under the
supervisor loop in-process, ulyssesctl reading the real store."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import psutil
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.operator.ctl_status import _processes_cell, job_processes
from ulyssesd.daemon.store.enums import RunState


def _status(capsys, sd) -> dict:
    capsys.readouterr()
    main([*sd, "status", "--json"])
    return json.loads(capsys.readouterr().out)


def _row(capsys, sd, key) -> str:
    capsys.readouterr()
    main([*sd, "status"])
    return next(line for line in capsys.readouterr().out.splitlines() if f" {key} " in line)


def test_status_names_the_attempts_group_and_ranks_and_nothing_once_it_ended(tmp_path, make_sup, capsys):
    sup = make_sup(fake_spec(tmp_path, steps=400, interval=50))
    sup.start()
    run_until(sup, lambda s: s.state == RunState.RUNNING and (s.last_step or 0) >= 3, timeout=60)
    sd = ["--state-dir", str(tmp_path / "state")]
    st = _status(capsys, sd)
    launcher = sup.job.pid
    assert st["launcher_pid"] == launcher and st["pgid"] == os.getpgid(launcher) == launcher
    assert st["job_host"] == socket.gethostname() and st["rank_pids_source"] == "process table"  # daemon not asked
    assert st["rank_pids"] and launcher not in st["rank_pids"]
    for pid in st["rank_pids"]:  # real, live training ranks of this attempt
        p = psutil.Process(pid)
        assert any("fakejob_ulysses" in part for part in p.cmdline()) and launcher in [a.pid for a in p.parents()]
    row = _row(capsys, sd, "job processes")
    assert f"pgid {launcher}" in row and str(st["rank_pids"][0]) in row, row

    # The daemon's own answer carries the same, as its rank watch's last scan found them.
    run_until(sup, lambda s: s.rank_watch.live, timeout=10)
    live = sup.status_dict()
    assert live["pgid"] == launcher and live["rank_pids"] == st["rank_pids"]

    assert sup.handle_command({"cmd": "stop"})["ok"]
    run_until(sup, lambda s: s.state == RunState.STOPPED, timeout=30)
    st = _status(capsys, sd)
    assert (st["pgid"], st["launcher_pid"], st["rank_pids"]) == (None, None, [])
    assert "(no live attempt)" in _row(capsys, sd, "job processes")
    assert sup.status_dict()["pgid"] is None and sup.status_dict()["rank_pids"] == []


def test_the_daemons_ranks_win_for_its_attempt_and_another_hosts_pids_are_not_scanned(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=400, interval=50))
    sup.start()
    run_until(sup, lambda s: s.state == RunState.RUNNING, timeout=60)
    attempt = sup.store.open_attempt(sup.run_id)
    launcher = {"module": "fakejob_ulysses"}
    d = job_processes(attempt, {"attempt": attempt.number, "rank_pids": [4242]}, launcher)
    assert (d["rank_pids"], d["rank_pids_source"]) == ([4242], "daemon")
    d = job_processes(attempt, {"attempt": attempt.number + 1, "rank_pids": [4242]}, launcher)  # not this attempt's
    assert d["rank_pids_source"] == "process table" and 4242 not in d["rank_pids"] and d["rank_pids"]
    elsewhere = dataclasses.replace(attempt, host="gpu-node-17")
    d = job_processes(elsewhere, None, launcher)
    assert d["pgid"] == attempt.pgid and d["rank_pids"] == [] and d["rank_pids_source"] is None
    assert "not scanned: on host gpu-node-17" in _processes_cell(d)
    recycled = dataclasses.replace(attempt, proc_start_time=attempt.proc_start_time - 3600)  # pid reused since
    d = job_processes(recycled, None, launcher)
    assert d["rank_pids"] == [] and "the launcher is gone" in _processes_cell(d)
