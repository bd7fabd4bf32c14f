"""`[scalars]` with hostile values (an outside check): the spec refuses what cannot be a peak or a path, with
the key named and no traceback; what only the filesystem can refuse (a dir that is a file, a NUL in a
user's own monitor block) turns the monitor off for the attempt instead of crashing rank 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.scalars import drop_unwritable_monitors, mfu
from ulyssesd.training.spec import MAX_PEAK_TFLOPS_PER_GPU, SpecError, job_spec_from_dict, read_toml

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def _spec(**scalars):
    data = read_toml(TINY)
    data["deepspeed"]["config"].pop("csv_monitor")  # tiny-cpu's own block would win over [scalars] csv
    data["scalars"] = scalars
    return job_spec_from_dict(data, source="hostile.toml")


@pytest.mark.parametrize("peak, why", [
    (math.nan, "peak_tflops_per_gpu=nan"), (math.inf, "less than or equal"), (-math.inf, "greater than 0"),
    (1e308, "less than or equal"), (-5.0, "greater than 0"), (0, "greater than 0"),
    (True, "is a boolean"), (False, "is a boolean"), ("fast", "valid number"),
])
def test_a_peak_that_is_not_a_peak_is_refused_naming_the_key(peak, why):
    with pytest.raises(SpecError) as err:
        _spec(peak_tflops_per_gpu=peak)
    text = str(err.value)
    assert "scalars.peak_tflops_per_gpu" in text and why in text, text


@pytest.mark.parametrize("peak", [989, 0.05, MAX_PEAK_TFLOPS_PER_GPU])
def test_believable_peaks_are_accepted_and_give_a_finite_mfu(peak):
    spec = _spec(peak_tflops_per_gpu=peak)
    value = mfu(spec, world_size=2, tokens_per_step=512, step_time_s=0.5)
    assert value is not None and math.isfinite(value) and value > 0


def test_a_dir_with_a_nul_byte_is_refused_at_load():
    with pytest.raises(SpecError) as err:
        _spec(tensorboard=True, dir="tb\x00x")
    assert "scalars.dir" in str(err.value) and "NUL" in str(err.value)


def test_a_scalars_dir_that_is_a_file_turns_the_monitors_off_not_the_job(tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    spec = _spec(csv=True, tensorboard=True, dir=str(a_file))
    cfg, _ = build_ds_config(spec, 2, tmp_path)
    warnings = drop_unwritable_monitors(cfg)
    assert "csv_monitor" not in cfg and "tensorboard" not in cfg and len(warnings) == 2
    assert all(str(a_file) in w and "off for this attempt" in w for w in warnings)
    assert a_file.read_text() == "x"  # nothing written over it


def test_a_nul_byte_in_a_users_own_monitor_block_is_dropped_not_a_crash(tmp_path):
    """The spec's own dir is checked at load; a user's ds_config block is not, so its NUL reaches os.makedirs,
    which raises ValueError (not OSError): that must drop the block like any other unusable directory."""
    cfg = {"tensorboard": {"enabled": True, "output_path": f"{tmp_path}/tb\x00/", "job_name": "t"},
           "csv_monitor": {"enabled": True, "output_path": f"{tmp_path}/ok/", "job_name": "c"}}
    warnings = drop_unwritable_monitors(cfg)
    assert "tensorboard" not in cfg and len(warnings) == 1 and "null byte" in warnings[0]
    assert "csv_monitor" in cfg and (tmp_path / "ok" / "c").is_dir()
