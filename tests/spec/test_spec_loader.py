"""The run-spec loader: every example loads; each broken spec gets its specific, path-naming error."""

from __future__ import annotations

from pathlib import Path

import pytest

from ulyssesd.daemon.spec import load_run_spec, run_spec_from_dict
from ulyssesd.training.spec import JobSpec, SpecError, load_job_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_loads(path: Path) -> None:
    spec = load_run_spec(path)
    model = spec.job.resolved_model()
    assert model.num_attention_heads % spec.job.parallel.sequence_parallel_size == 0
    assert spec.launcher.world_size % spec.job.parallel.sequence_parallel_size == 0
    # The job's half loads on its own and round-trips through the effective-config JSON.
    job = load_job_spec(path)
    assert JobSpec.model_validate_json(job.to_json()) == job


def test_presets_have_the_documented_sizes() -> None:
    sizes = {p: JobSpec.model_validate({"model": {"preset": p}, "train": {"seq_len": 256}}).resolved_model()
             for p in ("tiny", "gpt-1b", "gpt-7b", "gpt-176b")}
    assert (sizes["gpt-7b"].hidden_size, sizes["gpt-7b"].num_layers, sizes["gpt-7b"].num_attention_heads) == (4096, 32, 32)
    assert abs(sizes["gpt-7b"].num_params() / 6.86e9 - 1) < 0.002  # the reference probe's 6.86B
    big = sizes["gpt-176b"]
    assert (big.hidden_size, big.num_layers, big.num_attention_heads, big.vocab_size) == (12288, 96, 96, 50257)
    assert round(big.num_params() / 1e9, 1) == 174.6  # docs/DEEPSPEED_NOTES.md: P = 174.6B


def test_seed_ds_config_path_is_resolved_relative_to_the_spec() -> None:
    spec = load_run_spec(CONFIGS / "gpt-176b-8xa100.toml")
    assert Path(spec.job.deepspeed.config_path).is_file()


BROKEN = [
    ({"model": {"num_attention_heads": 96, "hidden_size": 12288}, "parallel": {"sequence_parallel_size": 5},
      "train": {"seq_len": 1000}},
     ["model.num_attention_heads=96 is not divisible by parallel.sequence_parallel_size=5"]),
    ({"parallel": {"sequence_parallel_size": 2}, "train": {"seq_len": 129}},
     ["train.seq_len=129 is not divisible by parallel.sequence_parallel_size=2"]),
    ({"model": {"preset": "gpt-9000"}}, ["model.preset='gpt-9000'"]),
    ({"train": {"lr": -1}}, ["train.lr=-1"]),
    ({"train": {"learning_rate": 1e-4}}, ["train.learning_rate: unknown key"]),
    ({"precision": {"dtype": "fp8"}}, ["precision.dtype='fp8'"]),
    ({"precision": {"fp32_layers": 10}}, ["precision.fp32_layers=10 exceeds model.num_layers=4"]),
    ({"data": {"kind": "tokens"}}, ["data.path is required when data.kind='tokens'"]),
    ({"data": {"skip_ranges": [[10, 5]]}}, ["data.skip_ranges entry [10, 5]"]),
    ({"launcher": {"nproc_per_node": 3}, "parallel": {"sequence_parallel_size": 2}},
     ["launcher world size 3", "not divisible by parallel.sequence_parallel_size=2"]),
    ({"launcher": {"kind": "deepspeed", "nnodes": 2}}, ["launcher.hostfile is required"]),
    ({"detectors": {"loss_spike_mad": -3}}, ["detectors.loss_spike_mad=-3"]),
    ({"remediation": {"mode": "yolo"}}, ["remediation.mode='yolo'"]),
    ({"bogus_section": {}}, ["bogus_section: unknown key"]),
    ({"train": {"seq_len": 4096}, "model": {"max_seq_len": 1024}},
     ["train.seq_len=4096 exceeds model.max_seq_len=1024"]),
]


@pytest.mark.parametrize(("data", "expected"), BROKEN, ids=[str(i) for i in range(len(BROKEN))])
def test_broken_spec_gets_its_specific_error(data: dict, expected: list[str]) -> None:
    with pytest.raises(SpecError) as info:
        run_spec_from_dict(data, "broken.toml")
    text = str(info.value)
    assert "broken.toml" in text
    for fragment in expected:
        assert fragment in text, f"{fragment!r} not in:\n{text}"


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(SpecError) as info:
        run_spec_from_dict({"train": {"lr": -1, "steps": 0}, "precision": {"dtype": "fp8"}}, "x.toml")
    assert len(info.value.problems) == 3


def test_malformed_toml_names_the_file_and_position(tmp_path: Path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text("[train]\nsteps = = 3\n")
    with pytest.raises(SpecError) as info:
        load_run_spec(bad)
    assert str(bad) in str(info.value) and "not valid TOML" in str(info.value) and "line 2" in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="file not found"):
        load_run_spec(tmp_path / "nope.toml")
