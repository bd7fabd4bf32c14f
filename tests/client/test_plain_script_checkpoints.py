"""A user's plain PyTorch script (tests/client/plain_torch_job.py: its own log wording, `saved checkpoint
…/ckpt/step_000040`, its own step folders) under the real daemon (`ulyssesd run`, a process), zero-code:

attempt 1's update at step 50 blows up the weights (loss NaN) and the script saves the poisoned `step_000050`
before it prints the step's line → the daemon
rolls back to the last known-good checkpoint found on disk (step_000040, not step 0) and sets step_000050
aside → attempt 2 crashes at step 45 (unrelated) → attempt 3 again resumes step_000040 (never the poisoned
one) → an operator SIGKILLs the rank after step_000070 → attempt 4 resumes step_000070 → the run COMPLETES.
`status`, `incidents`, `report` and the store all say what each attempt resumed from. And a checkpoint dir
whose layout nothing recognises is an open incident naming the setting, never a silent "from scratch".
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ulyssesd.daemon.store import open_store

SCRIPT = Path(__file__).resolve().parent / "plain_torch_job.py"
CTL = Path(sys.executable).parent / "ulyssesctl"


def _toml(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"
    return repr(v)


def write_spec(path: Path, sections: dict) -> Path:
    path.write_text("\n".join(f"[{name}]\n" + "\n".join(f"{k} = {_toml(v)}" for k, v in body.items()) + "\n"
                              for name, body in sections.items()))
    return path


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _ctl(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CTL), "--state-dir", str(state), *args], capture_output=True, text=True, timeout=60)


def _rank_pids(ckpt: Path) -> list[int]:
    """The script's process (found the way an operator would: by its command line)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(SCRIPT) in cmd and str(ckpt) in cmd:
                pids.append(int(d.name))
    return pids


def _spec(tmp: Path) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    return write_spec(tmp / "run.toml", {
        "run": {"name": "plainckpt"},
        "job": {"kind": "command", "total_steps": 100, "checkpoint_dir": str(tmp / "ckpt"), "checkpoint_settle_s": 0.2,
                "command": [str(SCRIPT), "--ckpt-dir", "{checkpoint_dir}", "--steps", "100", "--save-every", "10",
                            "--resume", "{resume}"]},
        "telemetry": {"source": "stdout"},
        "launcher": {"kind": "local", "python": sys.executable,
                     "env": {"OMP_NUM_THREADS": "1", "PLAIN_STEP_SLEEP": "0.12", "PLAIN_NAN_AT": "50",
                             "PLAIN_CRASH_AT": "45", "FAULT_ATTEMPT_CRASH": "2"}},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.1, "stop_grace_s": 5.0,
                   "hang_grace_s": 2.0, "stack_dump_wait_s": 0.5, "backoff_base_s": 0.2, "backoff_max_s": 1.0,
                   "early_death_s": 1.0, "preflight": False},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 30.0},
        "remediation": {"known_good_steps": 2, "rollback_steps_back": 0, "grace_steps": 5, "severe_grace_steps": 5},
    })


@pytest.mark.slow   # ~60-90 s: four attempts of a real script at 0.12 s a step
def test_plain_script_nan_rollback_crash_and_sigkill_resume_from_the_right_checkpoints(tmp_path):
    spec = _spec(tmp_path)
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def status() -> dict:
            res = _ctl(state, "status", "--json")
            return json.loads(res.stdout) if res.returncode == 0 else {}

        # The operator's SIGKILL: on attempt 3, once step_000070 exists and training went past it.
        wait_for(lambda: (s := status()).get("attempt") == 3 and (s.get("step") or 0) >= 72
                 and (ckpt / "step_000070").is_dir(), 150, "attempt 3 past step 72")
        newest_before_kill = max(p.name for p in ckpt.iterdir() if re.fullmatch(r"step_\d{6}", p.name))
        pids = _rank_pids(ckpt)
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert daemon.wait(timeout=120) == 0, (tmp_path / "daemon.log").read_text()[-3000:]
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
        for pid in _rank_pids(ckpt):
            os.kill(pid, signal.SIGKILL)
        log.close()

    store = open_store(state / "ulyssesd.db", readonly=True)
    try:
        run = store.latest_run()
        assert run.state.value == "COMPLETED", run.state_reason
        attempts = store.list_attempts(run.id)
        resumed = [a.resumed_from for a in attempts]
        assert resumed == [None, "step_000040", "step_000040", newest_before_kill], resumed
        assert newest_before_kill >= "step_000070"
        incidents = store.list_incidents(run.id, with_actions=True)
        nan = [i for i in incidents if i.symptom.value == "nan_loss"]
        assert nan and nan[0].attempt == 1, [(i.symptom.value, i.attempt) for i in incidents]
        rollback = [a for a in nan[0].actions if (a.parameters or {}).get("rollback_to_step") is not None]
        assert rollback and rollback[0].parameters["rollback_to_step"] == 40, nan[0].actions
        assert not [i for i in incidents if i.symptom.value == "no_progress"]
        ck = {c.tag: c for c in store.list_checkpoints(run.id, include_pruned=True)}
        assert ck["step_000050"].valid and ck["step_000050"].attempt == 3  # the new trajectory's save, not the set-aside one
    finally:
        store.close()

    # What each attempt was given is what it says it loaded (its own log line).
    run_dir = Path(run.run_dir)
    for n, tag in ((2, "step_000040"), (3, "step_000040"), (4, newest_before_kill)):
        text = (run_dir / "logs" / f"attempt-{n}.log").read_text()
        assert f"resumed from {ckpt / tag} at step {int(tag[5:])}" in text, text[:500]
    # The poisoned save is set aside (kept as evidence), its weights NaN; the new trajectory's save is clean.
    aside = [p for p in ckpt.iterdir() if p.name.startswith("step_000050.rolledback-")]
    assert len(aside) == 1, sorted(p.name for p in ckpt.iterdir())
    assert math.isnan(torch.load(aside[0] / "model.pt")["0.weight"].flatten()[0].item())
    assert torch.isfinite(torch.load(ckpt / "step_000050" / "model.pt")["0.weight"]).all()
    assert torch.isfinite(torch.load(ckpt / "step_000100" / "model.pt")["0.weight"]).all()

    # The operator's views tell the same story.
    st = json.loads(_ctl(state, "status", "--json").stdout)
    assert st["state"] == "COMPLETED" and st["resumed_from"] == newest_before_kill, st
    assert st["latest_checkpoint"] == "step_000100", st
    assert st["step"] == 100 and isinstance(st["loss"], float), st   # from the stdout-parsed records
    text = _ctl(state, "status").stdout
    assert f"resumed from {newest_before_kill}" in text, text
    inc = _ctl(state, "incidents").stdout
    assert "step_000040" in inc, inc
    out = tmp_path / "report.html"
    assert _ctl(state, "report", run.id, "--out", str(out)).returncode == 0
    page = out.read_text()
    for tag in ("step_000040", newest_before_kill):
        assert f"<td>{tag}</td>" in page


_UNKNOWN_LAYOUT_JOB = """
import sys, time, pathlib
out = pathlib.Path(sys.argv[1]) / "weights"
out.mkdir(parents=True, exist_ok=True)
for step in range(1, 400):
    (out / "final.npz").write_bytes(b"x" * 64)   # its own format, no step in the name: nothing to resume from
    print(f"step {step} | loss: {1.0 / step:.4f}", flush=True)
    time.sleep(0.05)
"""


def test_a_checkpoint_dir_that_never_yields_a_checkpoint_is_an_open_incident_naming_the_setting(tmp_path):
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.supervisor import Supervisor

    script = tmp_path / "job.py"
    script.write_text(_UNKNOWN_LAYOUT_JOB)
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    spec_path = write_spec(tmp_path / "run.toml", {
        "run": {"name": "unknownckpt"},
        "job": {"kind": "command", "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_settle_s": 0.2,
                "checkpoint_unknown_after_s": 1.5, "command": [str(script), "{checkpoint_dir}"]},
        "telemetry": {"source": "stdout"},
        "launcher": {"kind": "local", "python": sys.executable},
        "daemon": {"state_dir": str(tmp_path / "state"), "socket_path": str(sock), "tick_s": 0.1, "preflight": False},
    })
    spec = load_run_spec(spec_path)
    store = open_store(spec.daemon.resolved_db_path())
    sup = Supervisor(spec, store, RealOS())
    sup.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sup.ckpt_watch_incident is None:
            sup.tick()
            time.sleep(0.05)
        assert sup.ckpt_watch_incident is not None, sup.state
        open_inc = [i for i in store.list_incidents(sup.run_id, status="open") if i.id == sup.ckpt_watch_incident]
        assert open_inc and open_inc[0].symptom.value == "checkpoint_corrupt"   # `status` lists open incidents
        assert "checkpoint_pattern" in open_inc[0].summary and "weights" in open_inc[0].summary
        assert store.latest_checkpoint(sup.run_id) is None   # and nothing was invented
    finally:
        if sup.job is not None:
            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
        store.close()


def test_a_new_daemon_keeps_the_known_good_checkpoints_it_found_on_disk(tmp_path):
    """Daemon A finds step_000010 and step_000020 on disk (known good after 2 clean steps); it dies; daemon B
    re-adopts the live job: it does not report them again, its engine has them as rollback targets, and the
    job's later saves are still found; the run completes in one attempt."""
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.supervisor import Supervisor

    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    spec_path = write_spec(tmp_path / "run.toml", {
        "run": {"name": "readoptckpt"},
        "job": {"kind": "command", "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_settle_s": 0.15,
                "command": [str(SCRIPT), "--ckpt-dir", "{checkpoint_dir}", "--steps", "40", "--save-every", "10",
                            "--resume", "{resume}"]},
        "telemetry": {"source": "stdout"},
        "launcher": {"kind": "local", "python": sys.executable,
                     "env": {"OMP_NUM_THREADS": "1", "PLAIN_STEP_SLEEP": "0.08"}},
        "daemon": {"state_dir": str(tmp_path / "state"), "socket_path": str(sock), "tick_s": 0.1, "preflight": False},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 30.0},
        "remediation": {"known_good_steps": 2},
    })
    spec = load_run_spec(spec_path)
    store = open_store(spec.daemon.resolved_db_path())
    a = Supervisor(spec, store, RealOS())
    a.start()
    job = None
    try:
        deadline = time.monotonic() + 90
        while not {"step_000010", "step_000020"} <= {t for t, _ in a.engine.known_good}:
            assert time.monotonic() < deadline, (a.state, a.last_step, a.engine.known_good)
            a.tick()
            time.sleep(0.05)
        job = a.job
        b = Supervisor(spec, store, RealOS())   # daemon A is gone (never ticked again); B re-adopts its run
        b.start()
        assert b.job is not None and b.attempt == 1
        b.tick()
        assert {"step_000010", "step_000020"} <= {t for t, _ in b.engine.known_good}
        while b.state.value not in ("COMPLETED", "FAILED"):
            assert time.monotonic() < deadline + 60, (b.state, b.last_step)
            b.tick()
            time.sleep(0.05)
        job = b.job
        assert b.state.value == "COMPLETED"
        tags = [c.tag for c in store.list_checkpoints(b.run_id)]
        assert tags == sorted(set(tags)) and {"step_000030", "step_000040"} <= set(tags), tags
        assert [x.resumed_from for x in store.list_attempts(b.run_id)] == [None]
    finally:
        if job is not None:
            a.os.signal_pids(a.os.job_pids(job, a.marker()), signal.SIGKILL)
        store.close()
