"""The daemon supervising an unmodified DeepSpeed script that only prints logs: `[job] kind = "command"` runs
examples/print_logs/train.py, `[telemetry] source = "stdout"` turns its log into records. A crash is
diagnosed and restarted, a hang is detected and the job killed and restarted; both runs then complete."""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import pytest
from uls_client_helpers import run_supervised

from ulyssesd.daemon.store.enums import RunState

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "print_logs" / "train.py"
_JIT_BUILD = re.compile(r"deepspeed_shm_comm|Building extension module|built successfully")


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


def _spec(tmp: Path, env: dict[str, str], steps: int = 60) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    sections = {
        "run": {"name": "printlogs"},
        "job": {"kind": "command", "command": [str(SCRIPT), "--steps", str(steps), "--step-sleep", "0.03"]},
        "telemetry": {"source": "stdout"},
        "launcher": {"kind": "local", "python": sys.executable,
                     "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **env}},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.1, "stop_grace_s": 5.0,
                   "hang_grace_s": 2.0, "stack_dump_wait_s": 0.5, "backoff_base_s": 0.2, "backoff_max_s": 1.0,
                   "early_death_s": 1.0, "preflight": False},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 15.0},
    }
    text = "\n".join(f"[{name}]\n" + "\n".join(f"{k} = {_toml(v)}" for k, v in body.items()) + "\n"
                     for name, body in sections.items())
    (tmp / "run.toml").write_text(text)
    return tmp / "run.toml"


def test_crash_of_a_printed_logs_job_is_diagnosed_and_restarted(tmp_path):
    sup, say = run_supervised(_spec(tmp_path, {"EXAMPLE_CRASH_AT": "25"}))
    assert sup.state == RunState.COMPLETED, say
    # The first test of the file used to pay DeepSpeed's JIT build of its CPU shm all-reduce (inference only)
    # inside run_supervised's bound: 96 s instead of 12 s on a cold extension cache (a fresh clone), more on a
    # loaded box, under a lock file (torch's FileBaton) that other jobs wait on without a bound. Build nothing.
    for n in (1, 2):
        log = (sup.run_dir / "logs" / f"attempt-{n}.log").read_text()
        assert not _JIT_BUILD.search(log), _JIT_BUILD.search(log)
    attempts = sup.store.list_attempts(sup.run_id)
    assert [a.number for a in attempts] == [1, 2]
    assert attempts[0].returncode not in (0, None) and attempts[0].diagnosis == "python_exception", attempts[0]
    crash = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "crash"]
    assert len(crash) == 1 and crash[0].step == 24  # the last step the log showed (it raised before printing 25)
    assert sup.last_step == 60
    recs = [json.loads(x) for x in (sup.run_dir / "telemetry-stdout.jsonl").read_text().splitlines()]
    assert {r["attempt"] for r in recs} == {1, 2}
    assert [r["step"] for r in recs if r["attempt"] == 2] == list(range(1, 61))


def test_hang_of_a_printed_logs_job_is_detected_killed_and_restarted(tmp_path):
    sup, say = run_supervised(_spec(tmp_path, {"EXAMPLE_HANG_AT": "20"}))
    assert sup.state == RunState.COMPLETED, say
    hang = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(hang) == 1 and hang[0].step == 19, hang
    assert [a.number for a in sup.store.list_attempts(sup.run_id)] == [1, 2]
    assert (sup.run_dir / "stacks").is_dir() or any("stack" in s for s in say)


def test_loss_spike_from_log_lines_becomes_a_restart_with_the_users_ds_config_patched(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10, "gradient_clipping": 1.0,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                              "zero_optimization": {"stage": 0}}))
    spec = _spec(tmp_path, {"EXAMPLE_SPIKE_AT": "40"}, steps=90)
    text = spec.read_text().replace('"--step-sleep", "0.03"]', '"--step-sleep", "0.03", "--deepspeed_config", "{ds_config}"]')
    spec.write_text(text.replace('kind = "command"', f'kind = "command"\nds_config = {json.dumps(str(ds))}')
                    # The example's loss wobbles 2.5..27: its 5x for 20 steps is not severe beyond that noise
                    # (the severe grace), so the ordinary grace must end inside the spike for the fix to come.
                    + "[remediation]\ngrace_steps = 10\n")
    sup, say = run_supervised(spec)
    assert sup.state == RunState.COMPLETED, say
    spikes = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "loss_spike"]
    assert spikes, say
    actions = [a for i in spikes for a in sup.store.list_actions(incident_id=i.id)]
    assert any(a.mode.value == "restart" and "hot_unavailable" in a.parameters for a in actions), actions
    attempts = sup.store.list_attempts(sup.run_id)
    assert len(attempts) == 2
    handed = [arg for arg in attempts[1].command if "ds_config" in arg]
    assert handed and handed[0].endswith(f"ds_config.v{attempts[1].config_version}.json")
    assert json.loads(Path(handed[0]).read_text())["gradient_clipping"] < 1.0  # the clip rung, in the job's file
    log2 = (sup.run_dir / "logs" / "attempt-2.log").read_text()
    assert f"gradient_clipping={json.loads(Path(handed[0]).read_text())['gradient_clipping']}" in log2


def test_attach_job_gets_the_daemons_hot_fix_without_a_restart(tmp_path):
    script = SCRIPT.parents[1] / "deepspeed_attach" / "train.py"
    spec = _spec(tmp_path, {"EXAMPLE_SPIKE_AT": "60"}, steps=150)
    text = spec.read_text().replace('[telemetry]\nsource = "stdout"\n', "")
    text = text.replace(json.dumps(str(SCRIPT)), json.dumps(str(script)))
    text = text.replace('"--step-sleep", "0.03"]', '"--step-sleep", "0.03", "--save-dir", "{checkpoint_dir}"]')
    spec.write_text(text)
    sup, say = run_supervised(spec)
    assert sup.state == RunState.COMPLETED, say
    assert len(sup.store.list_attempts(sup.run_id)) == 1, say  # no restart
    spikes = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "loss_spike"]
    actions = [a for i in spikes for a in sup.store.list_actions(incident_id=i.id)]
    assert any(a.mode.value == "hot" for a in actions), (say, actions)
    recs = [json.loads(x) for x in (sup.run_dir / "telemetry.jsonl").read_text().splitlines()]
    hot = next(a for a in actions if a.mode.value == "hot").parameters["control"]
    # (the first control_applied is the neutral control.json every launch writes)
    applied = [r for r in recs if r.get("event") == "control_applied" and r["control_version"] == hot["version"]]
    assert applied and applied[0]["step"] > 60, say
    assert {"gradient_clipping", "lr_scale"} & set(hot), hot
    if "gradient_clipping" in hot:  # the job's engine reports the clip it now uses
        assert applied[0]["gradient_clipping"] == hot["gradient_clipping"]
    if "lr_scale" in hot:
        assert applied[0]["lr_scale"] == hot["lr_scale"]
