"""Every rung is checked for applicability before it is chosen: a change that cannot reach the job is skipped
with its reason (issue 39 item 1), so a command job's loss ladder never restarts for nothing."""

from __future__ import annotations

import json
from pathlib import Path

from ulyssesd.daemon.job.command import job_reach
from ulyssesd.daemon.spec import JobSection, engine_job_values
from ulyssesd.remediation.detectors.base import Finding
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.job import BUILTIN
from ulyssesd.training.spec import JobSpec

CONFIG = JobSpec().model_dump(mode="json")


def _first_loss_decision(reach, known_good: bool = True):
    eng = RemediationEngine(job=engine_job_values(CONFIG), reach=reach)
    if known_good:
        eng.known_good.append(("step100", 100))
        eng.saved.append(("step100", 100))
    f = Finding("loss_spike", 150, "severe", {"since_step": 150})
    return eng._decide("loss", "loss_spike", f, 150, 1000.0, "loss spike at step 150")


def test_command_job_without_ds_config_skips_clip_fp32_lr_with_reasons_and_rolls_back(tmp_path: Path):
    job = JobSection(kind="command", command=["python", "train.py", "--resume", "{resume}"])
    reach = job_reach(job, {**CONFIG, "telemetry": {"source": "stdout"}})
    [d] = _first_loss_decision(reach)
    assert d.action_kind == "rollback_skip" and d.apply == "rollback_skip"
    for rung in ("lower_clip skipped: train.gradient_clipping does not reach the job",
                 "fp32_layers skipped: precision.fp32_layers does not reach the job",
                 "lower_lr skipped: train.lr, train.min_lr does not reach the job"):
        assert rung in d.reason, d.reason
    assert "without [job] ds_config" in d.reason
    assert "train.gradient_clipping" not in d.config_patch and "precision.fp32_layers" not in d.config_patch


def test_command_job_without_known_good_never_restarts_for_a_change_it_cannot_take():
    job = JobSection(kind="command", command=["python", "train.py"])
    [d] = _first_loss_decision(job_reach(job, {**CONFIG, "telemetry": {"source": "stdout"}}), known_good=False)
    assert d.action_kind in ("rollback_skip", "stop_alert"), d.reason
    assert "lower_clip skipped" in d.reason and "fp32_layers skipped" in d.reason


def test_command_job_with_ds_config_takes_clip_but_not_fp32(tmp_path: Path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))   # no optimizer section: lr cannot reach
    job = JobSection(kind="command", command=["python", "train.py"], ds_config=str(ds))
    reach = job_reach(job, {**CONFIG, "telemetry": {"source": "stdout"}})
    assert reach.takes_key("train.gradient_clipping") and reach.takes_key("deepspeed.config.zero_optimization.x")
    assert not reach.takes_key("precision.fp32_layers") and not reach.takes_key("train.lr")
    eng = RemediationEngine(job=engine_job_values(CONFIG), reach=reach)
    eng.known_good.append(("step100", 100))
    [d1] = eng._decide("loss", "loss_spike", Finding("loss_spike", 150, "severe", {"since_step": 150}), 150, 0.0, "x")
    assert d1.action_kind == "lower_clip"
    # A client job reading control.json takes the hot LR cut even though its ds_config has no optimizer.
    client = job_reach(job, CONFIG)
    assert client.why_not("hot", {"train.lr": 1e-4}, {"lr_scale": 0.9}) is None
    assert reach.why_not("hot", {"train.lr": 1e-4}, {"lr_scale": 0.9}) is not None


def test_builtin_job_ladder_unchanged():
    assert job_reach(JobSection(), CONFIG) is BUILTIN
    [d] = _first_loss_decision(BUILTIN)
    assert d.action_kind == "lower_clip" and "skipped" not in d.reason


def test_command_job_memory_ladder_skips_what_has_no_deepspeed_place():
    """Without a ds_config the ZeRO knobs and activation checkpointing do not reach a command job; the
    allocator env does (the launcher sets it)."""
    job = JobSection(kind="command", command=["python", "train.py"])
    eng = RemediationEngine(job=engine_job_values(CONFIG), reach=job_reach(job, CONFIG))
    [d] = eng.on_crash("cuda_oom", ["torch.OutOfMemoryError: CUDA out of memory."], 0.0)
    assert d.apply in ("restart_latest", "stop"), d.reason
    assert all(k.startswith("launcher.env.") for k in d.config_patch), d.config_patch
    if d.apply == "restart_latest":
        assert "expandable_segments" in d.reason and "raise_persistence_threshold skipped" in d.reason
