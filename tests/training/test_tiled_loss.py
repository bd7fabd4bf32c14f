"""Sequence-tiled LM loss (`train.loss_chunk_tokens`): same loss and gradients as the untiled loss, and the
[tokens, V] fp32 logits of the whole local sequence are never alive at once."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from train_job_helpers import launch, tiny_spec

from ulyssesd.training.model.gpt import GPT, IGNORE_INDEX
from ulyssesd.training.spec import ModelSpec, SpecError, job_spec_from_dict
from ulyssesd.training.train import DUMP_GRADS_ENV

B, S = 2, 32  # 64 local tokens: chunk 16 divides them, 7 and 48 do not


def _model(loss_chunk_tokens: int = 0, **model) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelSpec(preset="tiny", **model).resolved(), "math", loss_chunk_tokens=loss_chunk_tokens)


def _batch(b: int = B, s: int = S, vocab: int = 256, ignored: bool = True):
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (b, s + 1), generator=g)
    labels = tok[:, 1:].clone()
    if ignored:  # padding-like runs and scattered ignored labels, crossing chunk boundaries
        labels[0, :9] = IGNORE_INDEX
        labels[1, 5::6] = IGNORE_INDEX
    return tok[:, :-1], torch.arange(s).expand(b, s), labels


def _loss_and_grads(model: GPT, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _gaps(a, b) -> tuple[float, float]:
    """(|loss gap|, max relative gradient gap over all parameters)."""
    (la, ga), (lb, gb) = a, b
    assert ga.keys() == gb.keys()
    rel = max(((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp_min(1e-30)).item() for k in ga)
    loss_gap = abs((la - lb).item())
    # nan (e.g. a chunk whose labels are all ignored, averaged on its own) counts as an infinite gap.
    return (math.inf if math.isnan(loss_gap) else loss_gap), (math.inf if math.isnan(rel) else rel)


# fp32 summation order only: the mean is sum/count either way, grouped differently.
LOSS_TOL, GRAD_TOL = 2e-6, 1e-5


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk", [16, 7, 48, 64, 1000])
def test_tiled_loss_equals_untiled_loss_and_grads(chunk, tie):
    batch = _batch()
    ref = _loss_and_grads(_model(0, tie_embeddings=tie), batch)
    tiled = _loss_and_grads(_model(chunk, tie_embeddings=tie), batch)
    loss_gap, grad_gap = _gaps(ref, tiled)
    assert loss_gap < LOSS_TOL and grad_gap < GRAD_TOL, (chunk, loss_gap, grad_gap)
    # The untiled reference really is F.cross_entropy's mean over the non-ignored labels.
    assert (batch[2] == IGNORE_INDEX).sum() == 9 + 5


def test_no_ignored_labels_and_eval_no_grad_path():
    batch = _batch(ignored=False)
    ref = _loss_and_grads(_model(0), batch)
    loss_gap, grad_gap = _gaps(ref, _loss_and_grads(_model(7), batch))
    assert loss_gap < LOSS_TOL and grad_gap < GRAD_TOL, (loss_gap, grad_gap)
    m = _model(7).eval()
    with torch.no_grad():  # no checkpoint outside training: plain chunk loop
        assert abs(m(*batch).item() - ref[0].item()) < LOSS_TOL


def test_negative_control_wrong_normalisation_is_caught(monkeypatch):
    """The comparison above fails for plausible wrong tilings: the mean of chunk means (÷ chunk count) and a
    denominator that counts ignored labels."""
    batch = _batch()
    ref = _loss_and_grads(_model(0), batch)

    def mean_of_chunk_means(self, x, labels):
        n = self.loss_chunk_tokens
        parts = [F.cross_entropy((self.embed(xc, as_head=True)).float(), yc)
                 for xc, yc in zip(x.reshape(-1, x.shape[-1]).split(n), labels.reshape(-1).split(n), strict=True)]
        return torch.stack(parts).mean()

    def counts_ignored(self, x, labels):
        total = sum(self._chunk_loss_sum(xc, yc) for xc, yc in
                    zip(x.reshape(-1, x.shape[-1]).split(self.loss_chunk_tokens), labels.reshape(-1).split(
                        self.loss_chunk_tokens), strict=True))
        return total / labels.numel()

    for wrong in (mean_of_chunk_means, counts_ignored):
        monkeypatch.setattr(GPT, "_tiled_loss", wrong)
        loss_gap, grad_gap = _gaps(ref, _loss_and_grads(_model(7), batch))
        assert loss_gap > 100 * LOSS_TOL and grad_gap > 100 * GRAD_TOL, (wrong.__name__, loss_gap, grad_gap)


def _saved_numels(model: GPT, batch) -> list[int]:
    """Numel of every activation autograd keeps from forward to backward (outside checkpoint's own hooks;
    parameters, e.g. the tied [V, h] head weight, are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    loss.backward()
    return sizes


def test_tiled_path_keeps_no_tokens_by_vocab_tensor_for_backward():
    tokens, vocab = B * S, 1024  # V above the tiny MLP width (256), so only logits reach tokens·V
    batch = _batch(vocab=vocab)
    untiled = _saved_numels(_model(0, vocab_size=vocab), batch)
    tiled = _saved_numels(_model(16, vocab_size=vocab), batch)
    assert max(untiled) >= tokens * vocab  # the fp32 log-softmax output of the whole local sequence
    assert max(tiled) < tokens * vocab, max(tiled)


def _peak_cpu_bytes(model: GPT, batch) -> int:
    """Peak of live CPU allocations over forward + backward, from the profiler's allocation events (the
    CPU allocator has no max_memory_allocated; kineto records every alloc (+) and free (-) in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(*batch).backward()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    assert len(events) > 100, "profiler recorded no allocation events"
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_memory_drops_by_the_planners_12_v_per_token():
    vocab, s, chunk = 8192, 256, 64
    batch = _batch(s=s, vocab=vocab, ignored=False)
    tokens = B * s
    untiled = _peak_cpu_bytes(_model(0, vocab_size=vocab), batch)
    tiled = _peak_cpu_bytes(_model(chunk, vocab_size=vocab), batch)
    predicted_drop = 12 * vocab * (tokens - chunk)  # training/planner/cost_model.py: t·12·V -> min(N, t)·12·V
    # fp32 model: logits.float() is no copy, so the measured drop is a little under 12·V per token.
    assert 0.75 * predicted_drop < untiled - tiled < 1.1 * predicted_drop, (untiled, tiled, predicted_drop)


def test_spec_option_default_validation_and_error_names_the_key():
    assert tiny_spec().train.loss_chunk_tokens == 0
    assert tiny_spec(train={"loss_chunk_tokens": 8192}).train.loss_chunk_tokens == 8192
    with pytest.raises(SpecError, match=r"train\.loss_chunk_tokens=-1"):
        job_spec_from_dict({"train": {"loss_chunk_tokens": -1}})
    with pytest.raises(ValueError, match="loss_chunk_tokens=-1"):
        _model(-1)


@pytest.mark.slow
def test_deepspeed_sp2_tiled_loss_matches_untiled(tmp_path):
    """Real job: 2 ranks (gloo), ZeRO-3 + Ulysses SP=2, 32 local tokens per rank, chunks of 7 (tied head =
    the embedding, gathered by ZeRO-3 inside every checkpointed chunk): same step-1 loss and gradients."""
    runs = {}
    for chunk in (0, 7):
        run_dir = tmp_path / f"chunk{chunk}"
        spec = tiny_spec(train={"steps": 1, "loss_chunk_tokens": chunk}, checkpoint={"save_at_end": False})
        runs[chunk] = run = launch(spec, run_dir, env={DUMP_GRADS_ENV: str(run_dir / "grads")})
        assert run.returncode == 0, run.output[-4000:]
    # The option reached the model in the job (the tiled run really tiled).
    assert "chunks of 7 local tokens" in runs[7].output and "tiled LM loss" not in runs[0].output
    ref, tiled = runs[0].steps()[1], runs[7].steps()[1]
    assert abs(ref["loss"] - tiled["loss"]) < 1e-6, (ref["loss"], tiled["loss"])
    assert tiled["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    g0, g7 = (torch.load(runs[c].run_dir / "grads" / "grads-step1.pt") for c in (0, 7))
    assert g0.keys() == g7.keys()
    assert max((g0[k] - g7[k]).abs().max().item() for k in g0) < 1e-6
