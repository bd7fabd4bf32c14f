"""Units of the command job and the stdout telemetry source: placeholders, the resume rule, launch argv per
launcher, and the log tail (offsets survive a new daemon, partial lines wait, records are valid)."""

from __future__ import annotations

import json
import sys

import pytest

from ulyssesd.client import write_manifest
from ulyssesd.daemon.job.command import newest_complete_checkpoint, render_command
from ulyssesd.daemon.job.launcher import build_launch
from ulyssesd.daemon.spec import JobSection, LauncherSection, run_spec_from_dict
from ulyssesd.daemon.telemetry.log_source import LogSource
from ulyssesd.remediation.records import parse_line
from ulyssesd.training.spec import SpecError


def _ckpt(root, name, files=("model.pt",)):
    d = root / name
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"x" * 4)
    return d


def test_resume_rule_prefers_valid_manifests_and_else_the_highest_complete_number(tmp_path):
    plain = tmp_path / "plain"
    for step in (500, 90):
        (_ckpt(plain, f"checkpoint-{step}", ("model.pt",)) / "trainer_state.json").write_text(
            json.dumps({"global_step": step}))
    _ckpt(plain, "checkpoint-1000", ("model.pt",))  # being written: no trainer_state.json yet
    assert newest_complete_checkpoint(plain, ["trainer_state.json"]).name == "checkpoint-500"
    # HF's own completion marker: without resume_requires too
    assert newest_complete_checkpoint(plain).name == "checkpoint-500"
    assert newest_complete_checkpoint(plain, max_step=499).name == "checkpoint-90"
    assert newest_complete_checkpoint(tmp_path / "absent") is None
    man = tmp_path / "man"
    for step in (10, 20, 30):
        write_manifest(_ckpt(man, f"step-{step:08d}"), step)
    (man / "step-00000030" / "model.pt").write_bytes(b"truncated-and-longer")  # size no longer matches
    _ckpt(man, "step-00000040")  # no manifest: a partial save
    assert newest_complete_checkpoint(man).name == "step-00000020"


def test_placeholders_and_an_empty_resume_drops_its_option(tmp_path):
    job = JobSection(kind="command", command=["train.py", "--out", "{checkpoint_dir}", "--resume", "{resume}",
                                             "--attempt={attempt}", "--ds", "{ds_config}"],
                     checkpoint_dir=str(tmp_path / "ck"))
    first = render_command(job, run_dir=tmp_path, attempt=1, config_version=1)
    assert first == ["train.py", "--out", str(tmp_path / "ck"), "--attempt=1", "--ds", str(tmp_path / "ds_config.json")]
    write_manifest(_ckpt(tmp_path / "ck", "step-00000007"), 7)
    second = render_command(job, run_dir=tmp_path, attempt=2, config_version=3)
    assert second[3:5] == ["--resume", str(tmp_path / "ck" / "step-00000007")] and "--attempt=2" in second


@pytest.mark.parametrize("kind, expect", [
    ("local", [sys.executable, "/x/train.py", "--a"]),
    ("torchrun", ["/x/train.py", "--a"]),
    ("deepspeed", ["/x/train.py", "--a"]),
])
def test_launch_argv_runs_the_users_script(tmp_path, kind, expect):
    job = JobSection(kind="command", command=["/x/train.py", "--a"])
    plan = build_launch(LauncherSection(kind=kind), run_id="r", run_dir=tmp_path, attempt=1, config_version=1,
                        base_env={}, job=job)
    assert plan.argv[-len(expect):] == expect
    assert "ulyssesd.training" not in plan.argv
    other = build_launch(LauncherSection(kind="torchrun"), run_id="r", run_dir=tmp_path, attempt=1,
                         config_version=1, base_env={}, job=JobSection(kind="command", command=["./run.sh"]))
    assert other.argv[-2:] == ["--no-python", "./run.sh"]


def test_spec_errors_name_the_problem(tmp_path):
    with pytest.raises(SpecError, match=r"unknown placeholder \{bogus\}"):
        run_spec_from_dict({"job": {"kind": "command", "command": ["t.py", "{bogus}"]}})
    with pytest.raises(SpecError, match="command is required"):
        run_spec_from_dict({"job": {"kind": "command"}})
    with pytest.raises(SpecError, match="ds_config"):
        run_spec_from_dict({"job": {"kind": "command", "command": ["t.py"], "ds_config": "missing.json"}},
                           base_dir=tmp_path)
    with pytest.raises(SpecError, match="source"):
        run_spec_from_dict({"telemetry": {"source": "stderr"}})
    rs = run_spec_from_dict({"job": {"kind": "command", "command": ["t.py"]}, "telemetry": {"source": "stdout"}},
                            base_dir=tmp_path)
    assert rs.job_section.command == [str(tmp_path / "t.py")] and rs.raw["job"]["kind"] == "command"


def test_log_source_tails_the_attempt_log_and_resumes_at_its_offset(tmp_path):
    log = tmp_path / "logs" / "attempt-2.log"
    log.parent.mkdir()
    log.write_text("banner\nstep=1 loss=2.0\nstep=2 loss=1.9\nstep=3 lo")  # the last line is mid-write
    src = LogSource(tmp_path, attempt=2)
    assert src.pump(now=100.0) == 2
    with log.open("a") as fh:
        fh.write("ss=1.8\n")
    again = LogSource(tmp_path, attempt=2)  # a new daemon: picks up at the saved offset, no duplicates
    assert again.pump(now=101.0) == 1
    recs = [parse_line(x) for x in (tmp_path / "telemetry-stdout.jsonl").read_text().splitlines()]
    assert [(r.step, r.loss, r.attempt, r.time) for r in recs] == [(1, 2.0, 2, 100.0), (2, 1.9, 2, 100.0),
                                                                   (3, 1.8, 2, 101.0)]
    assert json.loads((tmp_path / "telemetry-stdout.offsets.json").read_text())["2"]["offset"] == log.stat().st_size


def test_remediations_config_changes_land_in_the_jobs_own_ds_config(tmp_path):
    from ulyssesd.daemon.job.command import patched_ds_config

    (tmp_path / "configs").mkdir()
    (tmp_path / "ds_config.json").write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}))
    v1 = {"train": {"gradient_clipping": 1.0, "lr": 3e-4}, "model": {"num_layers": 4}}
    v2 = {"train": {"gradient_clipping": 0.5, "lr": 2.7e-4}, "model": {"num_layers": 4},
          "deepspeed": {"config": {"zero_optimization": {"stage3_param_persistence_threshold": 1000}}}}
    (tmp_path / "configs" / "v1.json").write_text(json.dumps(v1))
    (tmp_path / "configs" / "v2.json").write_text(json.dumps(v2))
    assert patched_ds_config(tmp_path, 1) == tmp_path / "ds_config.json"  # nothing changed yet
    out = patched_ds_config(tmp_path, 2)
    ds = json.loads(out.read_text())
    assert out.name == "ds_config.v2.json"
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 1000}
    assert "optimizer" not in ds  # the job's config has no optimizer section: no lr invented
    assert json.loads((tmp_path / "ds_config.json").read_text())["gradient_clipping"] == 1.0  # the copy stays


@pytest.mark.parametrize("pattern", ["/abs/*.ckpt", "../elsewhere/*.pt"])
def test_a_checkpoint_pattern_outside_the_checkpoint_dir_is_refused_with_an_example(pattern):
    with pytest.raises(ValueError, match="relative to checkpoint_dir.*lightning_logs"):
        JobSection(kind="command", command=["train.py"], checkpoint_pattern=pattern)
