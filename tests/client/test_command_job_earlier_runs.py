"""Checkpoints already in a command job's checkpoint_dir when its run starts (a spec re-run in place, a shared
folder) are another run's lineage: a relaunch of this run never resumes them (an outside-in run resumed the
previous run's step 100 after a crash at step 50 and "completed" 50 steps short), the first launch says what it
found and what it did, and `[job] resume_first = true` continues from them instead. Real daemon, real job
processes, real SQLite. Also: `status`'s checkpoint-disk row reads the job's checkpoint_dir."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from ulyssesd.daemon.store import open_store

JOB = """
import pathlib, re, sys, time
ck, attempt = pathlib.Path(sys.argv[1]), int(sys.argv[2])
resume = sys.argv[4] if len(sys.argv) > 4 else ""
ck.mkdir(parents=True, exist_ok=True)
start = int(re.search(r"(\\d+)", pathlib.Path(resume).name).group(1)) if resume else 0
print(f"resumed from {resume or 'nothing'} at step {start}", flush=True)
for step in range(start + 1, 41):
    print(f"step {step} | loss: {1.0 / step:.4f}", flush=True)
    time.sleep(0.03)
    if step % 10 == 0:
        (ck / f"step_{step:06d}.pt").write_bytes(b"weights of this run" * 10)  # a legacy (non-zip) save
    if attempt == 1 and step == 25:
        sys.exit(1)
"""


def _write_spec(path: Path, tmp: Path, script: Path, resume_first: bool) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    path.write_text(f"""
[run]
name = "rerun"
[job]
kind = "command"
checkpoint_dir = "ckpt"
checkpoint_settle_s = 0.2
resume_first = {str(resume_first).lower()}
total_steps = 40
command = [{json.dumps(str(script))}, "{{checkpoint_dir}}", "{{attempt}}", "--resume", "{{resume}}"]
[telemetry]
source = "stdout"
[launcher]
kind = "local"
python = {json.dumps(sys.executable)}
[daemon]
state_dir = {json.dumps(str(tmp / "state"))}
socket_path = {json.dumps(str(sock))}
tick_s = 0.1
preflight = false
[detectors]
hang_timeout_floor_s = 30.0
""")
    return path


def _run(tmp: Path, resume_first: bool):
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.supervisor import Supervisor

    script = tmp / "job.py"
    script.write_text(JOB)
    spec = load_run_spec(_write_spec(tmp / "run.toml", tmp, script, resume_first))
    store = open_store(spec.daemon.resolved_db_path())
    sup = Supervisor(spec, store, RealOS())
    said: list[str] = []
    say = sup.say
    sup.say = lambda msg, *a, **k: (said.append(msg), say(msg, *a, **k))[1]
    sup.start()
    try:
        deadline = time.monotonic() + 60
        while sup.state.value not in ("COMPLETED", "FAILED", "STOPPED"):
            assert time.monotonic() < deadline, (sup.state, sup.last_step)
            sup.tick()
            time.sleep(0.05)
        attempts = {a.number: a.resumed_from for a in store.list_attempts(sup.run_id)}
        return sup, store, attempts, said
    finally:
        if sup.job is not None:
            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)


def _old_checkpoints(ck: Path) -> None:
    ck.mkdir()
    for step in (20, 100):   # the previous run's (its 100 is the end of a longer run)
        (ck / f"step_{step:06d}.pt").write_bytes(b"weights of the previous run" * 10)
        os.utime(ck / f"step_{step:06d}.pt", (time.time() - 600, time.time() - 600))


def test_a_relaunch_resumes_this_runs_checkpoint_not_the_previous_runs(tmp_path):
    from ulyssesd.daemon.host.disk_budget import disk_status

    _old_checkpoints(tmp_path / "ckpt")
    sup, store, attempts, said = _run(tmp_path, resume_first=False)
    try:
        assert sup.state.value == "COMPLETED", sup.state_reason if hasattr(sup, "state_reason") else sup.state
        assert attempts[1] in (None, "none"), attempts                 # the first launch starts from the start
        assert attempts[2] == "step_000020.pt", attempts               # this run's save before the crash at 25
        assert sup.last_step == 40
        loud = [m for m in said if "from before this run" in m]
        assert loud and "step_000100.pt" in loud[0] and "resume_first = true" in loud[0], said
        # the previous run's files stay where they were (never deleted); this run's step_000020 replaced its own
        assert (tmp_path / "ckpt" / "step_000100.pt").read_bytes().startswith(b"weights of the previous run")
        bounds = json.loads((sup.run_dir / "rollback-bounds.json").read_text())
        assert bounds[0]["why"] == "before_run"
        # `status`'s checkpoint disk row: the job's checkpoint_dir, not {run_dir}/checkpoints
        d = disk_status(store, store.get_run(sup.run_id))
        assert d is not None and Path(d["dir"]) == (tmp_path / "ckpt").resolve(), d
    finally:
        store.close()


def test_resume_first_continues_from_the_checkpoints_already_there(tmp_path):
    # The counter-case, the documented setting: the first launch is given the newest one there (step 100,
    # past the job's 40 steps: it exits at once), no warning, no bound.
    _old_checkpoints(tmp_path / "ckpt")
    sup, store, attempts, said = _run(tmp_path, resume_first=True)
    try:
        assert attempts[1] == "step_000100.pt", attempts
        assert not [m for m in said if "from before this run" in m], said
        assert not (sup.run_dir / "rollback-bounds.json").exists()
    finally:
        store.close()
