"""build_ds_config: the seed's ds_config_ulysses.json as a base, ownership of batch keys, warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.spec import JobSpec, SpecError, job_spec_from_dict

SEED_CONFIG = Path(__file__).parent / "fixtures" / "ds_config_ulysses.json"


def _spec(**sections) -> JobSpec:
    base = {"train": {"micro_batch_size": 1, "gradient_accumulation_steps": 8, "seq_len": 64},
            "deepspeed": {"config_path": str(SEED_CONFIG)}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return job_spec_from_dict(base)


def test_seed_config_is_accepted_with_one_warning_per_unsupported_or_misplaced_key():
    cfg, warnings = build_ds_config(_spec(), world_size=8)
    assert "sparse_attention" not in cfg
    sparse = [w for w in warnings if "'sparse_attention'" in w]
    assert len(sparse) == 1 and "dense attention" in sparse[0]
    zero = cfg["zero_optimization"]
    # The seed's top-level §5.2 keys are not DeepSpeed keys: moved where DeepSpeed reads them, as ints.
    assert zero["reduce_bucket_size"] == 100_000_000 and isinstance(zero["reduce_bucket_size"], int)
    assert zero["stage3_prefetch_bucket_size"] == 500_000_000
    assert zero["contiguous_gradients"] is True
    assert zero["stage3_param_persistence_threshold"] == 1_000_000
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage"] == 3
    assert not any(k in cfg for k in ("reduce_bucket_size", "prefetch_bucket_size", "contiguous_gradients"))
    assert sum("moved to zero_optimization" in w for w in warnings) == 3
    assert cfg["train_batch_size"] == 1 * 8 * 8
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["gradient_clipping"] == 1.0


def test_sequence_parallel_dp_enters_train_batch_size():
    cfg, _ = build_ds_config(_spec(parallel={"sequence_parallel_size": 2}), world_size=8)
    assert cfg["train_batch_size"] == 1 * 8 * 4  # dp = 8 / sp 2


def test_batch_conflict_is_an_error_naming_both_places():
    spec = _spec(train={"gradient_accumulation_steps": 4})
    with pytest.raises(SpecError) as err:
        build_ds_config(spec, world_size=2)
    msg = str(err.value)
    assert "gradient_accumulation_steps=8 in ds_config_ulysses.json" in msg
    assert "train.gradient_accumulation_steps=4" in msg


def test_inline_config_overrides_the_file_and_monitor_paths_go_under_run_dir(tmp_path):
    spec = _spec(deepspeed={"config": {"csv_monitor": {"enabled": True},
                                       "zero_optimization": {"stage3_param_persistence_threshold": 1e4}}})
    cfg, _ = build_ds_config(spec, world_size=2, run_dir=tmp_path)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 10_000
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # file value kept
    assert cfg["csv_monitor"]["output_path"].startswith(str(tmp_path))


def test_fp16_section_from_precision_and_conflicts():
    spec = job_spec_from_dict({"precision": {"dtype": "fp16"}})
    cfg, _ = build_ds_config(spec, world_size=1)
    assert cfg["fp16"]["enabled"] is True and cfg["fp16"]["loss_scale"] == 0
    assert cfg["fp16"]["initial_scale_power"] == 16 and cfg["fp16"]["hysteresis"] == 2
    bad = job_spec_from_dict({"precision": {"dtype": "bf16"}, "deepspeed": {"config": {"fp16": {"enabled": True}}}})
    with pytest.raises(SpecError, match=r"fp16.enabled=True .* conflicts with precision.dtype='bf16'"):
        build_ds_config(bad, world_size=1)


def test_stage_other_than_3_and_unknown_optimizer_are_rejected():
    spec = job_spec_from_dict({"deepspeed": {"config": {"zero_optimization": {"stage": 2},
                                                        "optimizer": {"type": "Lamb"}}}})
    with pytest.raises(SpecError) as err:
        build_ds_config(spec, world_size=1)
    assert len(err.value.problems) == 2


def test_clip_owned_by_spec_with_warning_and_scheduler_dropped():
    spec = job_spec_from_dict({"train": {"gradient_clipping": 0.5},
                               "deepspeed": {"config": {"gradient_clipping": 1.0, "scheduler": {"type": "WarmupLR"}}}})
    cfg, warnings = build_ds_config(spec, world_size=1)
    assert cfg["gradient_clipping"] == 0.5 and "scheduler" not in cfg
    assert any("train.gradient_clipping=0.5" in w for w in warnings)
    assert any("'scheduler'" in w for w in warnings)


def test_missing_or_bad_base_file(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        build_ds_config(job_spec_from_dict({"deepspeed": {"config_path": str(tmp_path / "nope.json")}}), 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        build_ds_config(job_spec_from_dict({"deepspeed": {"config_path": str(bad)}}), 1)


def test_config_is_json_serializable():
    cfg, _ = build_ds_config(_spec(), world_size=8)
    json.dumps(cfg)


def test_planner_reads_the_user_config_the_job_builds_from(tmp_path):
    """One merge and one list of misplaced ZeRO keys: a top-level `sub_group_size` (DeepSpeed would ignore it)
    is moved into zero_optimization by the job and read from there by the planner; a key that stays where the
    user wrote it (`stage3_max_reuse_distance` inside zero_optimization) is left alone by both."""
    from ulyssesd.training.planner import PlanInputError, ZeroSettings, user_ds_config

    base = tmp_path / "ds.json"
    base.write_text(json.dumps({"sub_group_size": 2e8, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e7}}))
    spec = _spec(deepspeed={"config_path": str(base), "config": {"zero_optimization": {"reduce_bucket_size": 3e7}}})
    cfg, warnings = build_ds_config(spec, world_size=1)
    assert cfg["zero_optimization"]["sub_group_size"] == 200_000_000 and "sub_group_size" not in cfg
    assert isinstance(cfg["zero_optimization"]["sub_group_size"], int)
    assert any("'sub_group_size'" in w and "moved to zero_optimization" in w for w in warnings)
    user = user_ds_config(spec)  # the raw merge: inline wins over the file
    assert user["zero_optimization"]["reduce_bucket_size"] == 3e7 and user["sub_group_size"] == 2e8
    for planned in (ZeroSettings.from_ds_config(user), ZeroSettings.from_ds_config(cfg)):
        assert planned.sub_group_size == 200_000_000 and planned.reduce_bucket_size == 30_000_000
    # Bad input: the planner's error names the key and the file, as the job's does.
    missing = _spec(deepspeed={"config_path": str(tmp_path / "nope.json")})
    with pytest.raises(PlanInputError, match=r"nope\.json.*deepspeed\.config_path: file not found"):
        user_ds_config(missing)
