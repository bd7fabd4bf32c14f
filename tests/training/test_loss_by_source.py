"""Per-source loss of the built-in job (issue 39): the data says where each sample came from, the model keeps
each sample's token-loss sum and count without changing the loss or its gradients, and the telemetry helper
turns the gathered sums into {source: mean loss}."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ulyssesd.training.data.batches import SampleSource, _SyntheticPatterns
from ulyssesd.training.model.gpt import GPT, IGNORE_INDEX
from ulyssesd.training.spec import DataSpec, ModelSpec
from ulyssesd.training.telemetry import loss_by_source


def test_synthetic_source_names_and_families_match_the_samples():
    src = SampleSource(DataSpec(kind="synthetic"), seq_len=64, vocab_size=256, seed=3)
    assert src.source_names == ["motif", "copy", "arithmetic"]
    fams = [src.source_of(i) for i in range(2000)]
    share = [fams.count(k) / len(fams) for k in range(3)]
    assert abs(share[0] - 0.5) < 0.05 and abs(share[1] - 0.25) < 0.05 and abs(share[2] - 0.25) < 0.05
    pat = _SyntheticPatterns(3, 256)
    for i in range(200):   # the family decides the sample's shape: arithmetic has a constant stride
        s = pat.sample(i, 16)
        d = np.diff(s) % pat.alphabet
        if pat.family_of(i) == 2:
            assert len(set(d.tolist())) == 1
        if pat.family_of(i) == 1:
            assert any((s[n:] == s[:-n]).all() for n in range(2, 9))


@pytest.mark.parametrize("chunk", [0, 16])
def test_per_sample_loss_is_kept_without_changing_the_loss_or_its_gradients(chunk):
    torch.manual_seed(0)
    model = GPT(ModelSpec(preset="tiny").resolved(), "math", loss_chunk_tokens=chunk)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, 256, (3, 33), generator=g)
    inputs, labels = tok[:, :-1], tok[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX
    pos = torch.arange(32).expand(3, 32)
    ref = model(inputs, pos, labels)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.track_sample_loss = True
    got = model(inputs, pos, labels)
    got.backward()
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-7), n
    sums, counts = model.last_sample_loss
    assert counts.tolist() == [27, 32, 32]
    assert math.isclose(float(sums.sum() / counts.sum()), float(ref.detach()), rel_tol=1e-5)
    with torch.no_grad():   # each sample's own mean loss, computed independently
        for b in range(3):
            one = model(inputs[b:b + 1], pos[b:b + 1], labels[b:b + 1])
            assert math.isclose(float(sums[b] / counts[b]), float(one), rel_tol=1e-4)


def test_loss_by_source_leaves_out_sources_without_samples():
    assert loss_by_source(["motif", "copy", "arithmetic"], [6.0, 0.0, 1.0, 3.0, 0.0, 2.0]) == {
        "motif": 2.0, "arithmetic": 0.5}
