"""Fast, single-process units of the job: telemetry contract, control parsing, faults, LR, model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ulyssesd.training.control import ControlPoller, parse_control
from ulyssesd.training.faults import FaultInjector, InjectedFault, corrupt_tag
from ulyssesd.training.spec import FaultSpec, job_spec_from_dict
from ulyssesd.training.telemetry import TelemetryWriter, validate_record
from ulyssesd.training.train import lr_at


# ---------------------------------------------------------------------------------- telemetry
def test_writer_records_validate_and_nonfinite_become_strings(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TelemetryWriter(path, attempt=3, config_version=2)
    w.step(5, float("nan"), grad_norm=float("inf"), lr=1e-4, samples=[8, 16], skipped=False, slowest_rank=1)
    w.event("checkpoint_saved", 5, tag="step-00000005", seconds=1.0, bytes=10)
    w.event("exiting", 5, reason="sigterm")
    w.close()
    lines = path.read_text().splitlines()
    recs = [json.loads(line) for line in lines]  # strict JSON: NaN literals would still parse, so check text
    assert "NaN" not in lines[0] and recs[0]["loss"] == "nan" and recs[0]["grad_norm"] == "inf"
    assert recs[0]["attempt"] == 3 and recs[0]["config_version"] == 2 and recs[0]["v"] == 1
    for r in recs:
        assert validate_record(r) == []


def test_disabled_writer_writes_nothing(tmp_path):
    w = TelemetryWriter(tmp_path / "t.jsonl", 1, None, enabled=False)
    w.step(1, 1.0)
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("rec, needle", [
    ({"v": 2, "kind": "step", "step": 1, "loss": 1.0}, "v=2"),
    ({"v": 1, "kind": "step", "step": -1, "loss": 1.0}, "step=-1"),
    ({"v": 1, "kind": "step", "step": 1}, "loss=None"),
    ({"v": 1, "kind": "step", "step": 1, "loss": "big"}, "loss='big'"),
    ({"v": 1, "kind": "step", "step": 1, "loss": 1.0, "slowest_rank": True}, "slowest_rank"),
    ({"v": 1, "kind": "step", "step": 1, "loss": 1.0, "samples": [5, 2]}, "samples"),
    ({"v": 1, "kind": "event", "step": 1, "event": "checkpoint_saved"}, "tag"),
    ({"v": 1, "kind": "event", "step": 1, "event": "exiting", "reason": "bored"}, "reason"),
    ({"v": 1, "kind": "event", "step": 1, "event": "control_applied"}, "control_version"),
    ({"v": 1, "kind": "weird"}, "kind='weird'"),
    ([1, 2], "not an object"),
])
def test_validator_rejects(rec, needle):
    problems = validate_record(rec)
    assert problems and any(needle in p for p in problems), problems


# ------------------------------------------------------------------------------------ control
def test_parse_control():
    assert parse_control('{"version": 4, "lr_scale": 0.9, "gradient_clipping": 0.5}')[0] == \
        {"version": 4, "lr_scale": 0.9, "gradient_clipping": 0.5}
    assert parse_control("{garbage")[0] is None
    assert "version" in parse_control('{"lr_scale": 0.9}')[1]
    assert "lr_scale" in parse_control('{"version": 1, "lr_scale": -1}')[1]
    assert "suspect" in parse_control('{"version": 1, "suspect": "yes"}')[1]


def test_poller_applies_each_version_once_and_ignores_garbage(tmp_path):
    path = tmp_path / "control.json"
    p = ControlPoller(path, rank=0, world_size=1)
    assert p.poll() is None  # missing file = no change
    path.write_text('{"version": 1, "lr_scale": 0.5}')
    assert p.poll() == {"version": 1, "lr_scale": 0.5}
    assert p.poll() is None and p.state.lr_scale == 0.5
    path.write_text("{broken")
    assert p.poll() is None and p.state.lr_scale == 0.5
    path.write_text('{"version": 2, "gradient_clipping": 0.25, "suspect": true}')
    assert p.poll()["version"] == 2
    assert (p.state.lr_scale, p.state.gradient_clipping, p.state.suspect) == (0.5, 0.25, True)


# ------------------------------------------------------------------------------------- faults
def _injector(faults, rank=0, attempt=1):
    events = []
    inj = FaultInjector([FaultSpec(**f) for f in faults], rank, 0, attempt, 1234, torch.device("cpu"),
                        lambda kind, step, **kw: events.append((kind, step, kw)))
    return inj, events


def test_raise_fires_at_step_on_its_rank_and_attempt_only():
    inj, events = _injector([{"kind": "raise", "at_step": 3}])
    inj.before_step(2)
    with pytest.raises(InjectedFault):
        inj.before_step(3)
    assert events == [("raise", 3, {"rank": 0, "magnitude": 10.0})]
    other, ev2 = _injector([{"kind": "raise", "at_step": 3}], rank=1)
    other.before_step(3)  # not its rank: only announces (rank 0 writes for everybody)
    assert ev2 and ev2[0][0] == "raise"
    second, ev3 = _injector([{"kind": "raise", "at_step": 3}], attempt=2)
    second.before_step(3)
    assert ev3 == []
    listed, _ = _injector([{"kind": "raise", "at_step": 3, "attempts": [2]}], attempt=2)
    with pytest.raises(InjectedFault):
        listed.before_step(3)


def test_loss_spike_window_and_nan():
    inj, events = _injector([{"kind": "loss_spike", "at_step": 2, "steps": 2, "magnitude": 7.0}])
    assert [inj.loss_factor(s) for s in (1, 2, 3, 4)] == [1.0, 7.0, 7.0, 1.0]
    assert len(events) == 1
    nan, _ = _injector([{"kind": "nan_loss", "at_step": 1}])
    assert math.isnan(nan.loss_factor(1))


def test_cuda_oom_has_torch_text_and_enospc_is_oserror(tmp_path):
    inj, _ = _injector([{"kind": "cuda_oom", "at_step": 1, "magnitude": 25.96}])
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory. Tried to allocate 25.96 GiB. GPU 0"):
        inj.before_step(1)
    inj, _ = _injector([{"kind": "enospc_on_save", "at_step": 2}])
    inj.before_save(1, tmp_path)
    with pytest.raises(OSError) as err:
        inj.before_save(2, tmp_path)
    assert err.value.errno == 28


def test_memory_spike_is_reported_then_released():
    inj, _ = _injector([{"kind": "memory_spike", "at_step": 2, "steps": 2, "magnitude": 3.0}])
    inj.before_step(1)
    assert inj.extra_mem_gib == 0
    inj.before_step(2)
    assert inj.extra_mem_gib == 3.0
    inj.before_step(3)
    assert inj.extra_mem_gib == 3.0
    inj.before_step(4)
    assert inj.extra_mem_gib == 0


def test_probability_is_deterministic():
    a, _ = _injector([{"kind": "loss_spike", "probability": 0.3}])
    b, _ = _injector([{"kind": "loss_spike", "probability": 0.3}])
    fa = [a.loss_factor(s) for s in range(1, 200)]
    assert fa == [b.loss_factor(s) for s in range(1, 200)]
    assert 20 < sum(f != 1.0 for f in fa) < 100


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_corrupt_tag_defeats_manifest_validation(tmp_path, how):
    from ulyssesd.training.checkpoint import validate_tag, write_manifest

    tag = tmp_path / "step-00000004"
    tag.mkdir()
    (tag / "a_model_states.pt").write_bytes(bytes(range(256)) * 8)
    (tag / "b_optim_states.pt").write_bytes(bytes(range(256)) * 40)
    write_manifest(tag, 4, 1.0, 8, 1)
    assert validate_tag(tag) == (True, "ok")
    target = corrupt_tag(tag, how)
    assert target.name == "b_optim_states.pt"  # the largest shard
    ok, reason = validate_tag(tag)
    assert not ok and "b_optim_states.pt" in reason
    assert ("truncated" in reason) if how == "truncate" else ("sha256" in reason)


# ---------------------------------------------------------------------------------------- LR
def test_lr_schedule_warmup_then_cosine_to_min():
    spec = job_spec_from_dict({"train": {"steps": 110, "warmup_steps": 10, "lr": 1e-3, "min_lr": 1e-4}})
    assert lr_at(1, spec) == pytest.approx(1e-4)
    assert lr_at(10, spec) == pytest.approx(1e-3)
    assert lr_at(60, spec) == pytest.approx(5.5e-4)
    assert lr_at(110, spec) == pytest.approx(1e-4)
    assert all(lr_at(s, spec) >= lr_at(s + 1, spec) for s in range(10, 110))


# ---------------------------------------------------------------------------------- attention
def test_backend_resolution_on_cpu():
    from ulyssesd.training.model.attention import LocalAttention, resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "sdpa" and resolve_backend("math", cpu) == "math"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("cudnn", cpu)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="flash-attn package is not installed"):
            resolve_backend("flash_attn", cpu)
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    out = LocalAttention("math")(q, k, v)
    # Causal: the first position attends only to itself.
    assert torch.allclose(out[:, 0], v[:, 0], atol=1e-6) and out.shape == q.shape


def test_gpu_memory_cap_is_off_unless_set_and_names_a_bad_value(monkeypatch):
    # The bench knob that lets an H200 stand in for an 80 GB H100; unset it changes nothing.
    from ulyssesd.training.train import GPU_MEMORY_CAP_ENV, cap_gpu_memory

    monkeypatch.delenv(GPU_MEMORY_CAP_ENV, raising=False)
    assert cap_gpu_memory(0) is None
    monkeypatch.setenv(GPU_MEMORY_CAP_ENV, "eighty")
    with pytest.raises(RuntimeError, match="ULYSSESD_GPU_MEMORY_CAP_GIB='eighty' is not a number"):
        cap_gpu_memory(0)
