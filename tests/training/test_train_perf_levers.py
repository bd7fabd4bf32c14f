"""Performance levers added for the H200 benchmarks (bench/RESULTS.md "GPU: MFU levers"): each must leave the
math unchanged (or change it only as documented) and be off by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import assert_same_loss_and_grads
from model_helpers import tiny_model as _model
from model_helpers import token_batch as _batch

from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.model.gpt import LayerNorm32
from ulyssesd.training.spec import JobSpec, SpecError, job_spec_from_dict


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_selective_checkpointing_gives_identical_loss_and_grads(n):
    assert_same_loss_and_grads(_model(), _model(checkpoint_layers=n), atol=1e-7)


def test_selective_checkpointing_really_recomputes_only_the_first_n_blocks():
    m = _model(checkpoint_layers=2)
    calls = [0] * len(m.blocks)
    for i, blk in enumerate(m.blocks):
        blk.register_forward_pre_hook(lambda mod, args, i=i: calls.__setitem__(i, calls[i] + 1))
    x, pos, y = _batch()
    m(x, pos, y).backward()
    assert calls == [2, 2, 1, 1]  # forward + recompute for the checkpointed ones only


def test_activation_checkpoint_layers_above_num_layers_is_rejected_with_both_keys():
    with pytest.raises(SpecError) as exc:
        job_spec_from_dict({"model": {"preset": "tiny"}, "train": {"activation_checkpoint_layers": 5}})
    assert "train.activation_checkpoint_layers=5 exceeds model.num_layers=4" in str(exc.value)


def test_norm_fp32_copy_is_the_default_and_reaches_every_layernorm():
    assert all(ln.fp32_copy for ln in _model().modules() if isinstance(ln, LayerNorm32))
    m = _model(model={"norm_fp32_copy": False})
    lns = [ln for ln in m.modules() if isinstance(ln, LayerNorm32)]
    assert lns and not any(ln.fp32_copy for ln in lns)
    # On CPU the lever is inert (the fused kernel path is CUDA only): same loss as the default.
    x, pos, y = _batch()
    assert torch.equal(_model()(x, pos, y), m(x, pos, y))


def test_fused_adam_only_on_gpu_without_offload():
    def opt(**train):
        spec = JobSpec.model_validate({"model": {"preset": "tiny"}, "train": train})
        return build_ds_config(spec, 1)[0]["optimizer"]["params"]

    assert "fused" not in opt(device="cuda")  # default off
    assert opt(device="cuda", fused_adam=True)["fused"] is True
    assert "fused" not in opt(device="cpu", fused_adam=True)
    spec = JobSpec.model_validate({"model": {"preset": "tiny"}, "train": {"device": "cuda", "fused_adam": True},
                                   "deepspeed": {"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}})
    assert "fused" not in build_ds_config(spec, 1)[0]["optimizer"]["params"]


def test_save_at_end_defaults_on():
    assert JobSpec().checkpoint.save_at_end is True


def test_zero3_leaf_blocks_defaults_off():
    assert JobSpec().train.zero3_leaf_blocks is False


# ---------------------------------------------------------------- issue 20: step-speed levers (model.*)
class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that run under it (forward, recompute and backward alike)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _sdpa_model(**kw):
    """Tiny GPT on the fused CPU SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`), as cuDNN on GPU."""
    torch.manual_seed(0)
    from ulyssesd.training.model.gpt import GPT
    from ulyssesd.training.spec import ModelSpec

    return GPT(ModelSpec(preset="tiny", **kw.pop("model", {})).resolved(), "sdpa", **kw)


def test_speed_levers_are_off_by_default_and_reach_the_blocks():
    m = _model()
    assert m.cfg.rotary_fused is False and m.cfg.qkv_copy is True and m.cfg.checkpoint_keep_attention is False
    on = _model(model={"rotary_fused": True, "qkv_copy": False})
    assert all(b.rotary_fused and not b.qkv_copy for b in on.blocks)


@pytest.mark.parametrize("backend_model", [_model, _sdpa_model])
def test_qkv_view_instead_of_copy_gives_identical_loss_and_grads(backend_model):
    assert_same_loss_and_grads(backend_model(), backend_model(model={"qkv_copy": False}), atol=0)


def test_keep_attention_checkpoint_gives_identical_loss_and_grads():
    assert_same_loss_and_grads(_sdpa_model(checkpoint_every=1),
                               _sdpa_model(checkpoint_every=1, model={"checkpoint_keep_attention": True}), atol=1e-7)
    assert_same_loss_and_grads(_sdpa_model(checkpoint_layers=2),
                               _sdpa_model(checkpoint_layers=2, model={"checkpoint_keep_attention": True}), atol=1e-7)


def test_keep_attention_checkpoint_skips_the_attention_forward_in_recompute():
    x, pos, y = _batch()

    def attention_forwards(model):
        with _CountOps() as ops:
            model(x, pos, y).backward()
        fwd = [n for n in ops.counts if n.startswith("_scaled_dot_product") and "backward" not in n]
        assert fwd, ops.counts  # the fused kernel ran (else this test would prove nothing)
        return sum(ops.counts[n] for n in fwd), sum(c for n, c in ops.counts.items() if n.startswith("mm"))

    n_layers = 4
    plain_attn, plain_mm = attention_forwards(_sdpa_model(checkpoint_every=1))
    keep_attn, keep_mm = attention_forwards(_sdpa_model(checkpoint_every=1, model={"checkpoint_keep_attention": True}))
    assert plain_attn == 2 * n_layers  # forward + recompute
    assert keep_attn == n_layers       # forward only: recompute reads the kept outputs
    assert keep_mm == plain_mm         # everything else is still recomputed


def test_compiled_rotary_matches_the_eager_fp32_rotary_forward_and_backward():
    # The GPU lever runs the same function through inductor; here inductor's CPU backend (C++) compiles it.
    from ulyssesd.training.model.gpt import _compiled_rotate_qk, rotary_cos_sin, rotate_qk

    heads, d = 4, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 24, 3 * heads * d, generator=g).to(torch.bfloat16).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(100, 124).expand(2, 24), d, 10000.0)
    q, k, _ = qkv.view(2, 24, 3, heads, d).unbind(2)  # strided views, as in Block.forward
    eager = rotate_qk(q, k, cos, sin)
    compiled = _compiled_rotate_qk()(q, k, cos, sin)
    for e, c in zip(eager, compiled, strict=True):
        assert c.dtype == torch.bfloat16 and c.is_contiguous() and c.shape == (2, 24, heads, d)
        # bf16 outputs of the same fp32 math: equal up to one bf16 rounding step where FMA contraction differs.
        assert torch.allclose(e.float(), c.float(), rtol=2 ** -7, atol=1e-6)
    grad = [torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in eager]
    ge, = torch.autograd.grad(eager, qkv, grad)
    gc, = torch.autograd.grad(compiled, qkv, grad)
    assert torch.allclose(ge.float(), gc.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(ge[..., 2 * heads * d:], torch.zeros_like(ge[..., 2 * heads * d:]))  # v's third: no grad


def test_keep_attention_costs_one_output_and_logsumexp_per_checkpointed_block():
    from ulyssesd.training.planner import Cluster, plan

    def items(**model):
        job = JobSpec.model_validate({"model": {"preset": "gpt-1b", **model},
                                      "train": {"seq_len": 32768, "activation_checkpoint_every": 1}})
        return {i.name: i.bytes for i in plan(job, Cluster.preset("h200-141g", gpus_per_node=1),
                                              search=False).items}

    plain, keep = items(), items(checkpoint_keep_attention=True)
    extra = {k: v for k, v in keep.items() if k not in plain}
    assert extra == {"kept attention outputs (24 checkpointed blocks)": 32768 * 24 * (2 * 2048 + 4 * 16)}


def test_compiled_rotary_inside_keep_attention_checkpoints_gives_the_same_training_math(monkeypatch):
    # On the GPU the compiled rotary runs inside torch's selective-checkpoint dispatch mode (forward and
    # recompute); here the CPU compiled kernel is forced into the same place.
    from ulyssesd.training.model import gpt as model_mod

    keep = {"checkpoint_keep_attention": True}
    x, pos, y = _batch()
    eager = _sdpa_model(checkpoint_every=1, model=keep)
    eager_loss = eager(x, pos, y)
    eager_loss.backward()
    compiled, calls = model_mod._compiled_rotate_qk(), []
    monkeypatch.setattr(model_mod, "rotate_qk", lambda *a: calls.append(1) or compiled(*a))
    fused = _sdpa_model(checkpoint_every=1, model=keep)
    fused_loss = fused(x, pos, y)
    fused_loss.backward()
    assert len(calls) == 2 * 4  # forward + recompute of 4 blocks went through the compiled kernel
    assert torch.allclose(eager_loss, fused_loss, rtol=1e-6)
    for (name, p1), (_, p2) in zip(eager.named_parameters(), fused.named_parameters(), strict=True):
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-4, atol=1e-7), name


def test_shipped_1xh200_config_loads_and_the_planner_is_within_10_percent_of_its_measured_peak():
    # configs/gpt-1b-1xh200.toml as measured on one H200 (bench/RESULTS.md, device call 7b: 78.25 GiB peak).
    from ulyssesd.training.planner import Cluster, predict_peak_gib
    from ulyssesd.training.spec import load_job_spec

    job = load_job_spec(Path(__file__).parents[2] / "configs" / "gpt-1b-1xh200.toml")
    m = job.resolved_model()
    assert m.rotary_fused and not m.qkv_copy and not m.norm_fp32_copy and job.train.zero3_leaf_blocks
    assert m.compile_blocks  # device call 12: -0.8 % per step; it needs the leaf blocks above under ZeRO-3
    ds, _ = build_ds_config(job, 1)
    predicted = predict_peak_gib(job, Cluster.preset("h200-141g", gpus_per_node=1, nodes=1, host_mem_gib=64.0), ds)
    assert abs(predicted - 78.25) / 78.25 < 0.10, predicted


def test_planner_is_within_10_percent_of_the_measured_512k_steady_state_peak():
    # bench/gpu_long_seq.sh at 512K on one H200 (bench/RESULTS.md, device call 12): TiledMLP 16K, offloaded
    # block inputs, keep-attention, tiled loss 8K, every layer recomputed; step 2 (Adam moments loaded) 98.44 GiB.
    import tomllib

    from ulyssesd.training.planner import Cluster, predict_peak_gib

    spec = tomllib.loads((Path(__file__).parents[2] / "configs" / "gpt-1b-1xh200.toml").read_text())
    spec["model"].update(rotary_fused=False, qkv_copy=True, max_seq_len=524288, offload_checkpoints=True,
                         mlp_chunk_tokens=16384, checkpoint_keep_attention=True, compile_blocks=False)
    spec["train"].update(seq_len=524288, activation_checkpoint_every=1, loss_chunk_tokens=8192)
    job = job_spec_from_dict(spec)
    ds, _ = build_ds_config(job, 1)
    predicted = predict_peak_gib(job, Cluster.preset("h200-141g", gpus_per_node=1, nodes=1, host_mem_gib=128.0), ds)
    assert abs(predicted - 98.44) / 98.44 < 0.10, predicted


# ----------------------------------------------------------------- TiledMLP (model.mlp_chunk_tokens)
@pytest.mark.parametrize("chunk", [7, 16, 64])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_tiled_mlp_gives_the_same_loss_and_grads(chunk, mlp):
    # 2 x 32 = 64 local tokens: 7 = uneven chunks, 16 = even, 64 = one chunk (untiled path).
    ref = _model(model={"mlp": mlp})
    tiled = _model(model={"mlp": mlp, "mlp_chunk_tokens": chunk})
    x, pos, y = _batch()
    l1, l2 = ref(x, pos, y), tiled(x, pos, y)
    l1.backward()
    l2.backward()
    assert torch.allclose(l1, l2, rtol=1e-6)
    for (name, p1), (_, p2) in zip(ref.named_parameters(), tiled.named_parameters(), strict=True):
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-5, atol=1e-7), name


def test_tiled_mlp_recomputes_chunk_by_chunk_and_composes_with_block_checkpoints():
    m = _sdpa_model(checkpoint_every=1, model={"mlp_chunk_tokens": 16, "checkpoint_keep_attention": True})
    sizes = []
    m.blocks[0].fc_in.register_forward_hook(lambda mod, args, out: sizes.append(args[0].shape[0]))
    x, pos, y = _batch()
    loss = m(x, pos, y)
    loss.backward()
    # The MLP only ever sees chunks of 16 of the 64 local tokens: 4 in forward, 4 when each chunk is
    # recomputed for its backward, and those of the block's own recompute (torch stops that one early once
    # the tensors backward needs exist, so it may skip the last chunk).
    assert set(sizes) == {16} and 8 < len(sizes) <= 12, sizes
    ref = _sdpa_model(checkpoint_every=1, model={"checkpoint_keep_attention": True})
    ref_loss = ref(x, pos, y)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    for (name, p1), (_, p2) in zip(ref.named_parameters(), m.named_parameters(), strict=True):
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-5, atol=1e-7), name


def test_tiled_mlp_planner_items_and_the_short_sequence_case():
    from ulyssesd.training.planner import Cluster, plan

    def items(seq, **model):
        job = JobSpec.model_validate({"model": {"preset": "gpt-1b", "max_seq_len": 1 << 20, **model},
                                      "train": {"seq_len": seq, "activation_checkpoint_every": 1}})
        return {i.name: i.bytes for i in plan(job, Cluster.preset("h200-141g", gpus_per_node=1),
                                              search=False).items}

    plain, tiled = items(262144), items(262144, mlp_chunk_tokens=16384)
    assert tiled["TiledMLP chunk in backward"] == 16384 * 4 * 2 * 8192
    assert tiled["block backward transients"] == 262144 * 2 * 5 * 2048
    assert plain["block backward transients"] == 262144 * 2 * (2 * 8192 + 2 * 2048)
    assert tiled["recomputed chunk (1 block(s))"] < plain["recomputed chunk (1 block(s))"]
    assert items(8192, mlp_chunk_tokens=16384) == items(8192)  # one chunk = untiled


def test_mlp_chunk_tokens_rejects_negative_values_naming_the_key():
    with pytest.raises(SpecError) as exc:
        job_spec_from_dict({"model": {"preset": "tiny", "mlp_chunk_tokens": -1}})
    assert "model.mlp_chunk_tokens" in str(exc.value)


@pytest.mark.slow
def test_deepspeed_zero3_sp2_tiled_mlp_and_keep_attention_match_the_plain_job(tmp_path):
    """Real job: 2 ranks (gloo), ZeRO-3 + Ulysses SP=2, every block checkpointed; the MLP in chunks of 12 of
    the 32 local tokens (ZeRO-3 gathers fc_in/fc_out once per chunk call and per recompute) and the attention
    kept: same step-1 loss and gradients as the plain job."""
    from train_job_helpers import launch, tiny_spec

    from ulyssesd.training.train import DUMP_GRADS_ENV

    runs = {}
    for name, model in (("plain", {}), ("levers", {"mlp_chunk_tokens": 12, "checkpoint_keep_attention": True})):
        run_dir = tmp_path / name
        spec = tiny_spec(model=model, train={"steps": 1, "activation_checkpoint_every": 1},
                         checkpoint={"save_at_end": False})
        runs[name] = run = launch(spec, run_dir, env={DUMP_GRADS_ENV: str(run_dir / "grads")})
        assert run.returncode == 0, run.output[-4000:]
    ref, tiled = runs["plain"].steps()[1], runs["levers"].steps()[1]
    assert abs(ref["loss"] - tiled["loss"]) < 1e-6, (ref["loss"], tiled["loss"])
    g0, g1 = (torch.load(runs[n].run_dir / "grads" / "grads-step1.pt") for n in ("plain", "levers"))
    assert g0.keys() == g1.keys()
    assert max((g0[k] - g1[k]).abs().max().item() for k in g0) < 1e-6


# ------------------------------------------- the plain reference of bench/reference_gpt.py (issue 20)
REPO_ROOT = Path(__file__).resolve().parents[2]


def _bench_module(name: str):
    import importlib

    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))


@pytest.mark.parametrize("train, problem", [({"activation_checkpoint_layers": 2}, "every layer or none"),
                                            ({"activation_checkpoint_every": 2}, "every layer or none"),
                                            ({"micro_batch_size": 2}, "micro-batch 1 at SP=1")])
def test_reference_refuses_settings_it_cannot_match_naming_them(tmp_path, train, problem):
    ref = _bench_module("reference_gpt")
    spec = tmp_path / "spec.toml"
    body = "\n".join(f"{k} = {v}" for k, v in train.items())
    spec.write_text(f'[model]\npreset = "tiny"\n[train]\n{body}\n')
    with pytest.raises(SystemExit, match=problem):
        ref.settings(spec)


def test_reference_model_has_the_products_parameter_count():
    ref = _bench_module("reference_gpt")
    m = JobSpec.model_validate({"model": {"preset": "tiny", "tie_embeddings": False}}).resolved_model()
    plain = ref.PlainGPT(m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_hidden_size, False)
    assert sum(p.numel() for p in plain.parameters()) == m.num_params()


@pytest.mark.slow
def test_gpu_bench_times_the_reference_and_the_product_with_one_method(tmp_path):
    """Both programs through bench/gpu_bench.py on the CPU (1 rank, tiny model): same fields, same tokens."""
    out = tmp_path / "bench.jsonl"
    case = "model.preset=tiny model.tie_embeddings=false train.device=cpu train.seq_len=64 " \
           "train.activation_checkpoint_every=1 steps=4 timeout=240"
    res = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gpu_bench.py"), "--base",
                          str(REPO_ROOT / "configs" / "gpt-1b-1xh200.toml"), "--nproc", "1", "--workdir",
                          str(tmp_path / "runs"), "--out", str(out), "--case", f"name=ref program=reference {case}",
                          "--case", f"name=prod {case}"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    for name in ("ref", "prod"):
        assert rows[name]["rc"] == 0 and rows[name]["steps_done"] == 4, rows[name].get("log_tail")
        assert rows[name]["tokens_per_step"] == 64 and rows[name]["median_step_s"] > 0
    assert rows["ref"]["program"] == "reference" and "predicted_peak_gib" in rows["prod"]
