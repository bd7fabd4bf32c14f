"""End-to-end: the real job under torchrun (2 ranks, gloo, DeepSpeed ZeRO-3 + Ulysses) on the CPU.

Launches are shared through session fixtures: each costs ~15 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from train_job_helpers import JobRun, launch, start, tiny_spec, wait_for

from ulyssesd.training.__main__ import main
from ulyssesd.training.checkpoint import validate_tag
from ulyssesd.training.model.attention import UNSAFE_NO_ULYSSES_ENV
from ulyssesd.training.telemetry import validate_record
from ulyssesd.training.train import DUMP_GRADS_ENV, lr_at

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """SP=2 over 2 ranks, 6 uninterrupted steps, grads of step 1 dumped."""
    run_dir = tmp_path_factory.mktemp("baseline")
    run = launch(tiny_spec(), run_dir, env={DUMP_GRADS_ENV: str(run_dir / "grads")})
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="session")
def sp1_sigterm(tmp_path_factory):
    """SP=1 on one rank, same weights and data; SIGTERM during step 4 (a slow_rank fault holds it)."""
    run_dir = tmp_path_factory.mktemp("sp1")
    spec = tiny_spec(parallel={"sequence_parallel_size": 1}, checkpoint={"interval_steps": 5},
                     faults=[{"kind": "slow_rank", "at_step": 4, "magnitude": 3.0}])
    proc = start(spec, run_dir, nproc=1, env={DUMP_GRADS_ENV: str(run_dir / "grads")})

    run = JobRun(run_dir, None, "")
    wait_for(lambda: 3 in run.steps() if (run_dir / "telemetry.jsonl").exists() else False, 120,
             "step 3", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return JobRun(run_dir, proc.returncode, out)


@pytest.fixture(scope="session")
def no_ulysses(tmp_path_factory):
    """Negative control: sequence split over 2 ranks WITHOUT DistributedAttention."""
    run_dir = tmp_path_factory.mktemp("no_ulysses")
    run = launch(tiny_spec(train={"steps": 1}), run_dir,
                 env={DUMP_GRADS_ENV: str(run_dir / "grads"), UNSAFE_NO_ULYSSES_ENV: "1"})
    assert run.returncode == 0, run.output[-4000:]
    return run


def _grads(run):
    return torch.load(run.run_dir / "grads" / "grads-step1.pt")


def _max_grad_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_sp2_matches_sp1_loss_and_grads(baseline, sp1_sigterm):
    b, s = baseline.steps(), sp1_sigterm.steps()
    for step in (1, 2, 3, 4):
        assert abs(b[step]["loss"] - s[step]["loss"]) < 1e-6, (step, b[step]["loss"], s[step]["loss"])
    assert b[1]["grad_norm"] == pytest.approx(s[1]["grad_norm"], abs=1e-6)
    assert _max_grad_diff(_grads(baseline), _grads(sp1_sigterm)) < 1e-6


def test_negative_control_split_without_ulysses_fails_the_check(sp1_sigterm, no_ulysses):
    loss_gap = abs(no_ulysses.steps()[1]["loss"] - sp1_sigterm.steps()[1]["loss"])
    grad_gap = _max_grad_diff(_grads(no_ulysses), _grads(sp1_sigterm))
    assert loss_gap > 1e-4 or grad_gap > 1e-4, (loss_gap, grad_gap)
    assert grad_gap > 1e-4


def test_sigterm_finishes_the_step_saves_and_exits_zero(sp1_sigterm):
    run = sp1_sigterm
    assert run.returncode == 0, run.output[-4000:]
    exiting = run.events("exiting")
    assert [e["reason"] for e in exiting] == ["sigterm"] and exiting[0]["step"] == 4
    assert exiting[0]["saved"] is True and "not_saved" not in exiting[0]
    assert max(run.steps()) == 4
    tag = run.run_dir / "checkpoints" / "step-00000004"  # not an interval step (every 5): saved for SIGTERM
    assert validate_tag(tag) == (True, "ok")


def test_sigterm_after_a_nan_exits_without_saving_on_its_own_knowledge(tmp_path):
    # The counter-case of the test above: a NaN at step 3, SIGTERM during step 4, and NO control file saying
    # `suspect` (the daemon's write can land after the job's poll): the job itself refuses the exit save.
    spec = tiny_spec(parallel={"sequence_parallel_size": 1}, checkpoint={"interval_steps": 2},
                     faults=[{"kind": "nan_loss", "at_step": 3}, {"kind": "slow_rank", "at_step": 4, "magnitude": 3.0}])
    proc = start(spec, tmp_path, nproc=1)
    run = JobRun(tmp_path, None, "")
    wait_for(lambda: 3 in run.steps() if (tmp_path / "telemetry.jsonl").exists() else False, 120, "step 3", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    assert run.steps()[3]["loss"] == "nan" and max(run.steps()) == 4
    exiting = run.events("exiting")
    assert [(e["reason"], e["saved"]) for e in exiting] == [("sigterm", False)]
    assert "at step 3" in exiting[0]["not_saved"] and "nan" in exiting[0]["not_saved"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000002"]
    for rec in run.records():
        assert validate_record(rec) == [], rec


def test_telemetry_validates_against_the_contract(baseline, sp1_sigterm):
    recs = baseline.records() + sp1_sigterm.records()
    for rec in recs:
        assert validate_record(rec) == [], rec
    events = [r["event"] for r in baseline.records() if r["kind"] == "event"]
    assert events[0] == "started" and events[-1] == "exiting"
    assert {"checkpoint_saving", "checkpoint_saved"} <= set(events)
    steps = baseline.steps()
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    s = steps[3]
    assert s["samples"] == [2, 3] and s["tokens"] == 64 and s["attempt"] == 1 and s["config_version"] == 1
    assert s["slowest_rank"] in (0, 1) and s["mem_max_rank"] in (0, 1)
    assert s["step_time_max_s"] >= s["step_time_s"] > 0 and s["mem_max_allocated_gib"] > 0.05
    started = baseline.events("started")[0]
    assert (started["world_size"], started["sp"], started["dp"], started["resumed_from"]) == (2, 2, 1, None)
    # The loss decreases on the learnable synthetic data.
    assert steps[6]["loss"] < steps[1]["loss"]


def test_kill_and_corrupt_then_resume_is_bit_exact_from_previous_valid_tag(baseline, tmp_path):
    faults = [{"kind": "corrupt_checkpoint", "at_step": 4, "corruption": "flip"},
              {"kind": "sigkill", "at_step": 5, "rank": 1}]
    first = launch(tiny_spec(faults=faults), tmp_path)
    assert first.returncode != 0
    assert sorted(first.steps(1)) == [1, 2, 3, 4]
    assert [e["fault"] for e in first.events("fault_injected")] == ["corrupt_checkpoint", "sigkill"]
    second = launch(tiny_spec(faults=faults), tmp_path, attempt=2)  # faults fire on attempt 1 only
    assert second.returncode == 0, second.output[-4000:]
    invalid = second.events("checkpoint_invalid", 2)
    assert [e["tag"] for e in invalid] == ["step-00000004"] and "sha256" in invalid[0]["reason"]
    assert [e["tag"] for e in second.events("checkpoint_loaded", 2)] == ["step-00000002"]
    assert second.events("started", 2)[0]["start_step"] == 2
    assert any(p.name.startswith("step-00000004.corrupt-") for p in (tmp_path / "checkpoints").iterdir())
    resumed, ref = second.steps(2), baseline.steps()
    assert sorted(resumed) == [3, 4, 5, 6]
    for step in resumed:
        assert resumed[step]["loss"] == ref[step]["loss"], step  # exact, fp32 on CPU
        assert resumed[step]["grad_norm"] == ref[step]["grad_norm"], step
    for rec in second.records():
        assert validate_record(rec) == [], rec


def _write_control(run_dir, doc):
    tmp = run_dir / "control.json.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, run_dir / "control.json")  # atomic, as the daemon writes it


def test_resume_with_new_clip_and_lr_then_live_control_then_suspect_sigterm(baseline, tmp_path):
    shutil.copytree(baseline.run_dir / "checkpoints", tmp_path / "checkpoints")
    spec = tiny_spec(train={"steps": 400, "lr": 0.9e-3, "min_lr": 0.9e-4, "gradient_clipping": 0.5},
                     checkpoint={"interval_steps": 1000})
    run = JobRun(tmp_path, None, "")
    proc = start(spec, tmp_path, attempt=2, version=2)
    has_file = lambda: (tmp_path / "telemetry.jsonl").exists()  # noqa: E731
    wait_for(lambda: has_file() and 8 in run.steps(), 120, "step 8", proc)
    _write_control(tmp_path, {"version": 1, "lr_scale": 0.5, "gradient_clipping": 0.25})
    applied = wait_for(lambda: run.events("control_applied"), 60, "control_applied", proc)[0]
    wait_for(lambda: max(run.steps()) >= applied["step"] + 2, 60, "steps after control", proc)
    _write_control(tmp_path, {"version": 2, "lr_scale": 0.5, "gradient_clipping": 0.25, "suspect": True})
    wait_for(lambda: len(run.events("control_applied")) == 2, 60, "control v2", proc)
    os.killpg(proc.pid, signal.SIGTERM)  # what the daemon does: the whole launcher group
    proc.communicate(timeout=120)

    assert [e["tag"] for e in run.events("checkpoint_loaded")] == ["step-00000006"]
    steps = run.steps()
    assert min(steps) == 7
    assert applied["control_version"] == 1 and applied["lr_scale"] == 0.5 and applied["gradient_clipping"] == 0.25
    for step, rec in steps.items():
        scale = 1.0 if step <= applied["step"] else 0.5
        assert rec["lr"] == pytest.approx(scale * lr_at(step, spec), rel=1e-12), step
        assert rec["clip"] == (0.5 if step <= applied["step"] else 0.25), step
    # lr x0.9 really differs from the checkpointed run's schedule.
    assert steps[7]["lr"] == pytest.approx(0.9 * lr_at(7, tiny_spec(train={"steps": 400})))
    # suspect=true: SIGTERM stops after the step WITHOUT saving the (declared bad) weights.
    exiting = run.events("exiting")
    assert [(e["reason"], e["saved"]) for e in exiting] == [("sigterm", False)]
    assert run.events("checkpoint_saving") == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == \
        sorted(p.name for p in (baseline.run_dir / "checkpoints").glob("step-*"))


def test_explicit_missing_tag_exits_3(baseline, tmp_path):
    shutil.copytree(baseline.run_dir / "checkpoints", tmp_path / "checkpoints")
    spec = tiny_spec(parallel={"sequence_parallel_size": 1}, checkpoint={"load": "step-00000099"})
    run = launch(spec, tmp_path, nproc=1)
    assert run.returncode == 3, run.output[-3000:]
    assert "step-00000099" in run.output


def test_invalid_spec_exits_2(tmp_path, capsys):
    bad = tmp_path / "run.toml"
    bad.write_text('[model]\npreset = "tiny"\nnum_attention_heads = 3\n[train]\nseq_len = 63\n'
                   '[parallel]\nsequence_parallel_size = 2\n')
    assert main(["--spec", str(bad), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.seq_len=63 is not divisible by parallel.sequence_parallel_size=2" in err
