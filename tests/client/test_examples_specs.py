"""The examples' ready run specs (examples/*/run.toml): each loads with the daemon's spec loader and names its
own script; the DeepSpeed attach() example then runs under the daemon on the CPU (two gloo ranks under
torchrun): its total comes from its telemetry, an operator restart saves a checkpoint with a manifest on
SIGTERM and the next attempt resumes from it ({resume}), and the run completes."""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import pytest

from ulyssesd.daemon.host.process import RealOS
from ulyssesd.daemon.job.command import render_command
from ulyssesd.daemon.operator.ctl_status import status_data
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.supervisor import Supervisor

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
S = RunState


@pytest.mark.parametrize(("example", "launcher", "ranks"), [("print_logs", "local", 1),
                                                             ("deepspeed_attach", "torchrun", 2),
                                                             ("hf_trainer", "local", 1)])
def test_each_examples_spec_loads_and_runs_its_own_script(example, launcher, ranks, tmp_path):
    spec = load_run_spec(EXAMPLES / example / "run.toml")
    job = spec.job_section
    assert job.kind == "command" and job.command[0] == str(EXAMPLES / example / "train.py")
    assert Path(job.command[0]).is_file()
    assert spec.launcher.kind == launcher and spec.launcher.world_size == ranks
    assert spec.daemon.preflight is False  # the planner plans the built-in GPT only
    assert spec.launcher.env["DS_ACCELERATOR"] == "cpu"  # runs on this CPU box as shipped
    argv = render_command(job, run_dir=tmp_path, attempt=1, config_version=1)
    assert "{" not in " ".join(argv)  # every placeholder filled; an empty {resume} dropped with its option
    assert "--resume-from" not in argv and "--resume" not in argv


def test_a_command_jobs_resume_placeholder_names_the_newest_complete_save(tmp_path):
    from ulyssesd.client import write_manifest

    spec = load_run_spec(EXAMPLES / "deepspeed_attach" / "run.toml")
    ckpt = tmp_path / "checkpoints" / "step-00000012"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"x")
    write_manifest(ckpt, 12)
    argv = render_command(spec.job_section, run_dir=tmp_path, attempt=2, config_version=1)
    at = argv.index("--resume-from")
    assert argv[at + 1] == str(ckpt) and argv[argv.index("--save-dir") + 1] == str(tmp_path / "checkpoints")


def _supervisor(spec_path: Path, tmp: Path) -> Supervisor:
    spec = load_run_spec(spec_path)
    spec.daemon.state_dir = str(tmp / "state")
    spec.daemon.socket_path = str(Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock")
    spec.daemon.tick_s = 0.1
    return Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS())


@pytest.mark.slow
def test_deepspeed_attach_runs_under_the_daemon_restarts_from_its_sigterm_save_and_completes(tmp_path, monkeypatch):
    from ulyssesd.daemon.operator.ctl_common import CTX

    sup = _supervisor(EXAMPLES / "deepspeed_attach" / "run.toml", tmp_path)
    monkeypatch.setattr(CTX, "state_dir", tmp_path / "state", raising=False)  # what `ulyssesctl --state-dir` sets
    sup.start()
    restarted_at: int | None = None
    most_ranks = 0
    mid: dict | None = None
    deadline = time.monotonic() + 240
    try:
        while sup.state not in (S.COMPLETED, S.FAILED, S.STOPPED):
            assert time.monotonic() < deadline, f"state={sup.state} step={sup.last_step}"
            sup.tick()
            if sup.job is not None:
                most_ranks = max(most_ranks, len(sup.rank_watch.live))
            if restarted_at is None and sup.state == S.RUNNING and (sup.last_step or 0) >= 15:
                mid = status_data(sup.store, sup.store.get_run(sup.run_id))
                assert sup.handle_command({"cmd": "restart"})["ok"]
                restarted_at = sup.last_step
            time.sleep(0.05)
    finally:
        if sup.job is not None:
            import signal

            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
    assert sup.state == S.COMPLETED and sup.last_step == 60, sup.state
    assert most_ranks == 2  # the rank watch saw both torchrun ranks of the user's script
    # The total is the script's (--steps 60 through Reporter.set_total_steps), not [train] steps (100 by default).
    assert mid is not None and mid["total_steps"] == 60 and mid["total_steps_source"] == "job telemetry"
    assert 0.2 < mid["progress"] < 1.0
    attempts = sup.store.list_attempts(sup.run_id)
    assert [a.number for a in attempts] == [1, 2]
    for n in (1, 2):  # no JIT build of DeepSpeed's CPU shm all-reduce (60-90 s on a cold extension cache)
        log = (sup.run_dir / "logs" / f"attempt-{n}.log").read_text()
        assert not re.search(r"deepspeed_shm_comm|Building extension module|built successfully", log), n
    saves = sorted(p.name for p in (sup.run_dir / "checkpoints").iterdir() if p.is_dir())  # not DeepSpeed's `latest`
    assert saves and all((sup.run_dir / "checkpoints" / s / "manifest.json").is_file() for s in saves)
    # Attempt 2 resumed from the SIGTERM save: its first step record continues after it, not from step 1.
    import json

    steps2 = [r["step"] for r in map(json.loads, sup.telemetry_path.read_text().splitlines())
              if r.get("kind") == "step" and r.get("attempt") == 2]
    saved_step = int(saves[-1].split("-")[-1])
    assert restarted_at is not None and saved_step >= restarted_at
    assert steps2[0] == saved_step + 1 and steps2[-1] == 60, (saved_step, steps2[:3])


def test_the_printed_logs_example_declares_its_total_as_its_scripts_steps():
    spec = load_run_spec(EXAMPLES / "print_logs" / "run.toml")
    cmd = spec.job_section.command
    assert spec.job_section.total_steps == int(cmd[cmd.index("--steps") + 1])  # its lines carry no total


@pytest.mark.slow
def test_hf_trainer_runs_under_the_daemon_as_shipped_and_reports_its_max_steps(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from ulyssesd.daemon.operator.ctl_common import CTX

    sup = _supervisor(EXAMPLES / "hf_trainer" / "run.toml", tmp_path)
    monkeypatch.setattr(CTX, "state_dir", tmp_path / "state", raising=False)
    sup.start()
    deadline = time.monotonic() + 240
    while sup.state not in (S.COMPLETED, S.FAILED, S.STOPPED):
        assert time.monotonic() < deadline, f"state={sup.state} step={sup.last_step}"
        sup.tick()
        time.sleep(0.05)
    assert sup.state == S.COMPLETED and sup.last_step == 40 and sup.attempt == 1
    st = status_data(sup.store, sup.store.get_run(sup.run_id))
    assert (st["total_steps"], st["total_steps_source"]) == (40, "job telemetry")  # the Trainer's max_steps
    saves = sorted(p.name for p in (sup.run_dir / "checkpoints").iterdir() if p.is_dir())
    # Retention applies to a command job's own checkpoints ([checkpoint] keep_last, default 3): the newest three
    # stay; checkpoint-10 goes once a pass has run after checkpoint-40 (or stays if the run ended first).
    assert saves[-3:] == [f"checkpoint-{n}" for n in (20, 30, 40)], saves
    assert set(saves) <= {f"checkpoint-{n}" for n in (10, 20, 30, 40)}, saves
    assert all((sup.run_dir / "checkpoints" / s / "manifest.json").is_file() for s in saves)
