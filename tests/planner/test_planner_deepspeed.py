"""Model-state numbers against DeepSpeed's own estimator, and our parameter list against the real model."""

from __future__ import annotations

import functools

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params

from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.planner import Cluster, param_shapes, plan
from ulyssesd.training.spec import JobSpec

PRESETS = ["tiny", "gpt-1b", "gpt-7b", "gpt-176b"]
# (optimizer offload, param offload) as DeepSpeed's estimator enumerates them.
OFFLOADS = [(False, False), (True, False), (True, True)]


def _job(preset: str, offload_opt: bool, offload_param: bool, grad_fp32: bool = False, **model) -> JobSpec:
    zo: dict = {"stage": 3}
    if offload_opt:
        zo["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zo["offload_param"] = {"device": "cpu"}
    cfg: dict = {"zero_optimization": zo}
    if grad_fp32:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return JobSpec.model_validate({"model": {"preset": preset, **model}, "precision": {"dtype": "bf16"},
                                   "train": {"seq_len": 256}, "deepspeed": {"config": cfg}})


@functools.cache
def _meta_model(preset: str, model_items: tuple = ()) -> GPT:
    with torch.device("meta"):   # the 176B model cannot be built on a CPU; shapes are all we need
        return GPT(JobSpec.model_validate({"model": {"preset": preset, **dict(model_items)}}).resolved_model())


def _real_counts(job: JobSpec) -> tuple[int, int]:
    """(total params, largest layer params) of the real training model, built on the meta device."""
    model = _meta_model(job.model.preset)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@pytest.mark.parametrize("preset,model", [(p, {}) for p in PRESETS] + [
    (p, m) for p in ("tiny", "gpt-1b") for m in ({"bias": True}, {"mlp": "swiglu", "tie_embeddings": False})])
def test_param_shapes_match_real_model(preset, model):
    job = _job(preset, False, False, **model)
    real = _meta_model(preset, tuple(sorted(model.items())))
    ours = [(s.name, s.numel) for s in param_shapes(job.resolved_model())]
    assert ours == [(n, p.numel()) for n, p in real.named_parameters()]


def test_tiny_counts_equal_deepspeed_model_to_params():
    job = _job("tiny", False, False)
    real = GPT(job.resolved_model())   # real CPU tensors: DeepSpeed dedups shared params by data_ptr
    ds_total, ds_largest = model_to_params(real)
    p = plan(job, Cluster(gpus_per_node=8), search=False)
    assert (p.deepspeed_view["total_params"], p.deepspeed_view["largest_layer_params"]) == (ds_total, ds_largest)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("offload_opt,offload_param", OFFLOADS)
@pytest.mark.parametrize("gpus,nodes", [(8, 1), (4, 2)])
def test_model_states_agree_with_deepspeed_estimator(preset, offload_opt, offload_param, gpus, nodes):
    job = _job(preset, offload_opt, offload_param)
    total, largest = _real_counts(job)
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=total, largest_layer_params=largest, num_gpus_per_node=gpus, num_nodes=nodes,
        cpu_offload=offload_opt, cpu_offload_params=offload_param, zero_init=True, additional_buffer_factor=1.5)
    view = plan(job, Cluster(gpus_per_node=gpus, nodes=nodes), search=False).deepspeed_view
    assert view["total_params"] == total and view["largest_layer_params"] == largest
    assert view["gpu_bytes"] == pytest.approx(ds_gpu, rel=0.01)
    assert view["cpu_bytes_per_node_unbuffered"] * 1.5 == pytest.approx(ds_cpu, rel=0.01)


@pytest.mark.parametrize("preset", PRESETS)
def test_real_accounting_equals_deepspeed_with_fp32_grad_accumulation(preset):
    """Our own items (not the estimator view) reproduce DeepSpeed's GPU number when gradients accumulate in
    fp32 (the accounting DeepSpeed's estimator assumes); with the default bf16 accumulation we are exactly
    2·P/N lower. Negative control: the default plan does NOT match within 1 % for the big presets."""
    n = 8
    total, largest = _real_counts(_job(preset, False, False))
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, n, 1, cpu_offload=False,
                                                         cpu_offload_params=False, zero_init=True)
    fp32 = plan(_job(preset, False, False, grad_fp32=True), Cluster(gpus_per_node=n), search=False)
    ours = (fp32.bytes_of("bf16 parameter shard") + fp32.bytes_of("gradient partition (fp32)")
            + fp32.bytes_of("fp32 master + Adam m, v") + 4 * largest)
    assert ours == pytest.approx(ds_gpu, rel=0.01)
    bf16 = plan(_job(preset, False, False), Cluster(gpus_per_node=n), search=False)
    assert bf16.bytes_of("gradient partition (bf16)") == pytest.approx(fp32.bytes_of("gradient partition (fp32)") / 2)
    if preset != "tiny":
        ours_bf16 = (bf16.bytes_of("bf16 parameter shard") + bf16.bytes_of("gradient partition (bf16)")
                     + bf16.bytes_of("fp32 master + Adam m, v") + 4 * largest)
        assert ours_bf16 != pytest.approx(ds_gpu, rel=0.01)


def test_offloaded_host_states_equal_deepspeed_without_buffer_factor():
    job = _job("gpt-176b", True, False)
    total, largest = _real_counts(job)
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, 8, 1, cpu_offload=True,
                                                              cpu_offload_params=False, zero_init=True)
    p = plan(job, Cluster(gpus_per_node=8, host_mem_gib=1e6), search=False)
    host_states = p.bytes_of("fp32 master + Adam m, v (offloaded)") + p.bytes_of("fp32 gradient partitions (offload)")
    assert host_states * 1.5 == pytest.approx(ds_cpu, rel=0.01)
    # On the GPU both count the bf16 shard; DeepSpeed adds 4 bytes x largest layer, we itemize gathered buffers.
    assert p.bytes_of("bf16 parameter shard") + 4 * largest == pytest.approx(ds_gpu, rel=0.01)


@pytest.mark.parametrize("model", [{}, {"bias": True}])
def test_spec_num_params_matches_real_model(model):
    job = _job("tiny", False, False, **model)
    real = _meta_model("tiny", tuple(sorted(model.items())))
    assert job.resolved_model().num_params() == sum(p.numel() for p in real.parameters())
