"""The built-in model reports the largest |output logit| of each forward (issue 39, early warning): the same
value whether the loss is computed whole or in checkpointed chunks (their recompute in backward changes
nothing), without changing the loss or its gradients, and it follows the logits when they grow."""

from __future__ import annotations

import pytest
import torch

from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.spec import ModelSpec


@pytest.mark.parametrize("chunk", [0, 16])
def test_logit_max_is_the_forwards_largest_logit_and_changes_nothing(chunk):
    torch.manual_seed(0)
    model = GPT(ModelSpec(preset="tiny").resolved(), "math", loss_chunk_tokens=chunk)
    tok = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, labels, pos = tok[:, :-1], tok[:, 1:], torch.arange(32).expand(2, 32)
    loss = model(inputs, pos, labels)
    loss.backward()
    with torch.no_grad():   # the logits, computed directly
        x = model.embed(inputs)
        from ulyssesd.training.model.gpt import rotary_cos_sin

        cos, sin = rotary_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta)
        want = model._logits(model.ln_f(model._run_chunk(0, len(model.blocks), x, cos, sin))).abs().max()
    assert model.logit_max is not None and torch.allclose(model.logit_max, want.float(), rtol=1e-5)
    # Growing output weights grow it (what the early warning watches).
    before = float(model.logit_max)
    with torch.no_grad():
        for p in (model.head or model.embed).parameters():
            p.mul_(3.0)
    model(inputs, pos, labels)
    assert float(model.logit_max) > 2.5 * before


@pytest.mark.slow
def test_the_built_in_job_reports_logit_max_with_each_step(tmp_path):
    """A real 1-rank DeepSpeed job (CPU, gloo): every step record carries a finite, positive logit_max that
    the daemon's telemetry parser reads."""
    from train_job_helpers import launch, tiny_spec

    from ulyssesd.remediation.records import parse_record

    run = launch(tiny_spec(parallel={"sequence_parallel_size": 1}, train={"steps": 4}), tmp_path, nproc=1)
    assert run.returncode == 0, run.output[-4000:]
    steps = run.steps()
    assert sorted(steps) == [1, 2, 3, 4]
    for rec in steps.values():
        parsed = parse_record(rec)
        assert parsed.logit_max is not None and 0 < parsed.logit_max < 1e4, rec
