"""Performance levers added for the H200 benchmarks (bench/RESULTS.md "GPU: MFU levers"): each must leave the
math unchanged (or change it only as documented) and be off by default."""

from __future__ import annotations

import pytest
import torch
from model_helpers import assert_same_loss_and_grads
from model_helpers import tiny_model as _model
from model_helpers import token_batch as _batch

from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.model import LayerNorm32
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
