"""`model.compile_blocks` (issue 20 speed lever): each block's work before and after attention through inductor
(here its CPU C++ backend) must give the plain model's loss and gradients, with one graph for all blocks."""

from __future__ import annotations

import pytest
import torch
from model_helpers import token_batch

from ulyssesd.training.model import fused_block
from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.spec import ModelSpec


def _model(model: dict | None = None, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelSpec(preset="tiny", **(model or {})).resolved(), "sdpa", **kw)


def _counting_compiled(monkeypatch) -> list[str]:
    calls: list[str] = []
    pre, post = fused_block.compiled()
    monkeypatch.setattr(fused_block, "compiled", lambda: (lambda *a: calls.append("pre") or pre(*a),
                                                          lambda *a: calls.append("post") or post(*a)))
    return calls


def _loss_and_grads(m: GPT):
    x, pos, y = token_batch()
    loss = m(x, pos, y)
    loss.backward()
    return loss, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize(("model", "kw", "passes"), [
    ({}, {}, 1),                                                            # no recompute
    ({"mlp": "swiglu", "norm_fp32_copy": False, "qkv_copy": False}, {}, 1),
    ({"checkpoint_keep_attention": True}, {"checkpoint_every": 1}, 2),      # forward + recompute
])
def test_compiled_blocks_give_the_plain_models_loss_and_grads(monkeypatch, model, kw, passes):
    torch._dynamo.reset()
    fused_block.compiled.cache_clear()
    ref_loss, ref_grads = _loss_and_grads(_model(model, **kw))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls = _counting_compiled(monkeypatch)
    loss, grads = _loss_and_grads(_model({**model, "compile_blocks": True}, **kw))
    assert calls.count("pre") == calls.count("post") == 4 * passes  # every block went through both graphs
    # One graph per function for all 4 blocks (weights are arguments: no per-block recompile).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    # Inductor reorders the fp32 arithmetic (fused LayerNorm/GELU): equal up to rounding, not bit-identical.
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-3, atol=1e-6), name


def test_fp32_blocks_and_tiled_mlp_take_the_eager_path(monkeypatch):
    calls = _counting_compiled(monkeypatch)
    _loss_and_grads(_model({"compile_blocks": True}, fp32_layers=1))
    assert calls.count("pre") == 3  # 4 blocks, the first one in fp32 (a remediation) runs eagerly
    calls.clear()
    _loss_and_grads(_model({"compile_blocks": True, "mlp_chunk_tokens": 16}))
    assert calls == []  # 64 local tokens > 16: every block's MLP is tiled (eager)


def test_a_still_partitioned_weight_is_refused_naming_the_setting():
    with pytest.raises(RuntimeError, match="train.zero3_leaf_blocks"):
        fused_block.check_gathered(torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.empty(0)))
    fused_block.check_gathered(torch.nn.Parameter(torch.ones(3)))  # gathered: fine


@pytest.mark.slow
def test_deepspeed_zero3_sp2_job_with_compiled_blocks_matches_the_plain_job_and_needs_leaf_blocks(tmp_path):
    """Real job: 2 ranks (gloo), ZeRO-3 (zero.Init patches F.linear) + Ulysses SP=2 + leaf blocks, every block
    checkpointed with the attention kept: compiled blocks give the plain job's step-1 loss and gradients."""
    from train_job_helpers import launch, tiny_spec

    from ulyssesd.training.train import DUMP_GRADS_ENV

    runs = {}
    train = {"steps": 1, "activation_checkpoint_every": 1, "zero3_leaf_blocks": True}
    for name, model in (("plain", {}), ("compiled", {"compile_blocks": True})):
        run_dir = tmp_path / name
        spec = tiny_spec(model={"checkpoint_keep_attention": True, **model}, train=train,
                         checkpoint={"save_at_end": False})
        runs[name] = run = launch(spec, run_dir, env={DUMP_GRADS_ENV: str(run_dir / "grads")})
        assert run.returncode == 0, run.output[-4000:]
        assert ("compile_blocks: compiling" in run.output) == (name == "compiled")  # the compiled path ran
    ref, fused = runs["plain"].steps()[1], runs["compiled"].steps()[1]
    assert abs(ref["loss"] - fused["loss"]) < 1e-5 * abs(ref["loss"]), (ref["loss"], fused["loss"])
    g0, g1 = (torch.load(runs[n].run_dir / "grads" / "grads-step1.pt") for n in ("plain", "compiled"))
    assert g0.keys() == g1.keys()
    for k in g0:
        assert torch.allclose(g1[k], g0[k], rtol=1e-3, atol=1e-6), k
