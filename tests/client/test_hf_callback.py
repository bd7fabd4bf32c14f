"""The HF Trainer integration: a real Trainer run (tiny GPT-2 from a config, no download) writes step records
and manifests through UlyssesCallback. Skips cleanly when transformers (the `hf` extra) is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"


def test_trainer_run_reports_steps_and_manifests(tmp_path):
    from ulyssesd.client import validate_manifest

    env = {**os.environ, "ULYSSESD_RUN_DIR": str(tmp_path), "RANK": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE), "--output-dir", str(tmp_path / "out"), "--max-steps", "20"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21)) and all("grad_norm" in r for r in steps)
    saved = [r for r in recs if r.get("event") == "checkpoint_saved"]
    assert [r["tag"] for r in saved] == ["checkpoint-10", "checkpoint-20"]
    assert validate_manifest(tmp_path / "out" / "checkpoint-20") == (True, "ok")
    assert recs[-1]["event"] == "exiting" and recs[-1]["reason"] == "completed"


def _daemon_run(tmp_path, env):
    import tempfile

    from uls_client_helpers import run_supervised

    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    envs = ", ".join(f'"{k}" = "{v}"' for k, v in {"OMP_NUM_THREADS": "1", **env}.items())
    (tmp_path / "run.toml").write_text(f"""
[run]
name = "hf"
[job]
kind = "command"
command = [{json.dumps(str(EXAMPLE))}, "--output-dir", "{{checkpoint_dir}}", "--max-steps", "40", "--save-steps", "5", "--resume", "{{resume}}"]
checkpoint_dir = {json.dumps(str(tmp_path / "hf-out"))}
[launcher]
kind = "local"
python = {json.dumps(sys.executable)}
env = {{ {envs} }}
[daemon]
state_dir = {json.dumps(str(tmp_path / "state"))}
socket_path = {json.dumps(str(sock))}
tick_s = 0.1
stop_grace_s = 20.0
backoff_base_s = 0.2
backoff_max_s = 1.0
early_death_s = 1.0
preflight = false
[remediation]
known_good_steps = 5
[detectors]
warmup_steps = 3
window = 10
hang_timeout_floor_s = 60.0
""")
    return run_supervised(tmp_path / "run.toml", timeout=400)


def _steps_by_attempt(sup):
    recs = [json.loads(x) for x in (sup.run_dir / "telemetry.jsonl").read_text().splitlines()]
    out: dict[int, list[int]] = {}
    for r in recs:
        if r["kind"] == "step":
            out.setdefault(r["attempt"], []).append(r["step"])
    return out


def test_hf_trainer_under_the_daemon_sigkill_resumes_from_its_own_checkpoint(tmp_path):
    from ulyssesd.daemon.store.enums import RunState

    sup, say = _daemon_run(tmp_path, {"EXAMPLE_KILL_AT": "13"})
    assert sup.state == RunState.COMPLETED, say
    attempts = sup.store.list_attempts(sup.run_id)
    assert len(attempts) == 2 and attempts[0].signal == 9 or attempts[0].returncode == -9, attempts[0]
    assert str(tmp_path / "hf-out" / "checkpoint-10") in attempts[1].command  # {resume}: newest complete
    steps = _steps_by_attempt(sup)
    # A SIGKILL loses what the Reporter had not written yet (at most its 0.2 s batch window).
    assert steps[1] == list(range(1, steps[1][-1] + 1)) and 10 <= steps[1][-1] <= 13
    assert steps[2] == list(range(11, 41))  # resumed after checkpoint-10, ran to the end


def test_hf_trainer_under_the_daemon_nan_rolls_back_and_completes(tmp_path):
    import math

    from ulyssesd.daemon.store.enums import RunState

    sup, say = _daemon_run(tmp_path, {"EXAMPLE_NAN_AT": "17"})
    assert sup.state == RunState.COMPLETED, say
    nan = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "nan_loss"]
    assert nan and nan[0].step >= 17, say
    attempts = sup.store.list_attempts(sup.run_id)
    resume = attempts[1].command[attempts[1].command.index("--resume") + 1]
    # A NaN's onset is exact: the newest save before it (not ~100 steps back, not the NaN step's own save).
    assert resume == str(tmp_path / "hf-out" / "checkpoint-15")
    recs = [json.loads(x) for x in (sup.run_dir / "telemetry.jsonl").read_text().splitlines()]
    last = [r for r in recs if r["kind"] == "step" and r["attempt"] == attempts[-1].number]
    assert last[-1]["step"] == 40 and all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in last)
