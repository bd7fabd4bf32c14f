"""`ulyssesd demo` is watchable live: it prints the exact `ulyssesctl --state-dir … status --watch` command,
and that command, run as printed while the demo runs, follows the demo's run (daemon running, steps moving).
The real demo code (run_demo, in a subprocess) with the fake job in place of the 2-rank torchrun job, so the
test takes seconds; the real job's demo is tests/daemon/test_daemon_e2e_real.py (slow)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from uls_daemon_helpers import HERE, write_spec

BIN = Path(sys.executable).parent
DEMO = ("import sys; from ulyssesd.daemon import demo; demo.DEMO_SPEC = open(sys.argv[1]).read(); "
        "sys.exit(demo.run_demo(work_dir=sys.argv[2]))")


def _fake_demo_spec(path: Path) -> Path:
    """The demo's spec with the fake job; [daemon] without state_dir/socket_path: the demo puts them in."""
    return write_spec(path, {
        "run": {"name": "demo"},
        "launcher": {"kind": "local", "module": "fakejob_ulysses",
                     "env": {"PYTHONPATH": str(HERE), "FAKEJOB_STEP_S": "0.1"}},
        "daemon": {"tick_s": 0.1, "stop_grace_s": 5.0, "early_death_s": 3.0, "preflight": False},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 5.0},
        "train": {"steps": 120, "micro_batch_size": 1},
        "checkpoint": {"interval_steps": 50},
    })


def _read_until(proc: subprocess.Popen, pattern: str, timeout_s: float) -> re.Match:
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"{pattern!r} not printed; the demo said: {''.join(seen)[-3000:]}")


def test_the_printed_watch_command_follows_the_demo_live(tmp_path):
    spec = _fake_demo_spec(tmp_path / "fake-demo.toml")
    work = Path(tempfile.mkdtemp(prefix="uls-demo-", dir="/tmp"))  # short: the control socket lives in it
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("ULYSSESD_SOCKET", None)
    demo = subprocess.Popen([sys.executable, "-c", DEMO, str(spec), str(work)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        command = _read_until(demo, r"watch live \(another terminal\): (\S*ulyssesctl .*status --watch)\s*$", 60)[1]
        argv = shlex.split(command)
        assert argv[1] == "--state-dir" and Path(argv[2]) == work / "state", argv
        # As printed, through this PATH: the bare name only if PATH finds this installation's ulyssesctl, else
        # its full path (`make demo` does not activate the venv, so a bare name was "command not found").
        found = shutil.which(argv[0], path=env.get("PATH"))
        assert found and Path(found).resolve() == (BIN / "ulyssesctl").resolve(), (argv[0], env.get("PATH"))
        watch = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            lines = [watch.stdout.readline() for _ in range(3)]  # what `| head -3` sees
        finally:
            watch.kill()
            watch.wait(10)
        assert all(line.endswith("\n") for line in lines), (lines, watch.stderr.read())
        assert all("daemon running" in line and " RUNNING " in line for line in lines), lines
        steps = [int(re.search(r" step (\d+)/120 ", line)[1]) for line in lines]
        assert steps == sorted(steps) and steps[-1] > steps[0], steps  # live: the steps move between refreshes
        assert demo.wait(120) == 0
        out = demo.stdout.read()
        assert "COMPLETED" in out, out[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    # The demo is over: its info file is gone and ulyssesctl no longer takes it for a live daemon.
    assert not (work / "state" / "ulyssesd.daemon.json").exists()
    res = subprocess.run([str(BIN / "ulyssesctl"), "--state-dir", str(work / "state"), "status", "--json"],
                         capture_output=True, text=True, timeout=60, env=env)
    shutil.rmtree(work, ignore_errors=True)
    assert res.returncode == 0 and '"daemon": "not running"' in res.stdout and '"COMPLETED"' in res.stdout, res


def test_the_printed_command_is_the_bare_name_only_when_path_finds_it(monkeypatch):
    from ulyssesd.daemon.demo import ulyssesctl_command

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # `make demo`: the venv is not activated
    assert ulyssesctl_command() == str(BIN / "ulyssesctl")
    monkeypatch.setenv("PATH", f"{BIN}:/usr/bin:/bin")  # an activated venv, or a pip install on PATH
    assert ulyssesctl_command() == "ulyssesctl"
