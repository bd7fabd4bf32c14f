"""slice_for_sp: shards reconstruct the full sequence with global position ids; uneven splits refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulyssesd.training.data.batches import slice_for_sp


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 8))
def test_shards_reconstruct_inputs_labels_and_global_positions(b, sp, s_local):
    s = sp * s_local
    tokens = torch.randint(0, 1000, (b, s + 1))
    parts = [slice_for_sp(tokens, r, sp) for r in range(sp)]
    inputs = torch.cat([p[0] for p in parts], dim=1)
    labels = torch.cat([p[1] for p in parts], dim=1)
    pos = torch.cat([p[2] for p in parts], dim=1)
    assert torch.equal(inputs, tokens[:, :-1])
    assert torch.equal(labels, tokens[:, 1:])
    assert torch.equal(pos, torch.arange(s).expand(b, s))
    for r, (i, lab, p) in enumerate(parts):
        assert i.shape == lab.shape == p.shape == (b, s_local)
        assert int(p[0, 0]) == r * s_local  # global, not shard-local (negative control: local would be 0)


def test_uneven_sequence_is_refused():
    with pytest.raises(ValueError, match="seq_len=7 is not divisible by sequence_parallel_size=2"):
        slice_for_sp(torch.zeros(1, 8, dtype=torch.long), 0, 2)


def test_bad_rank_and_shape_are_refused():
    with pytest.raises(ValueError, match="sp_rank=2"):
        slice_for_sp(torch.zeros(1, 9, dtype=torch.long), 2, 2)
    with pytest.raises(ValueError, match=r"\[batch, seq_len\+1\]"):
        slice_for_sp(torch.zeros(9, dtype=torch.long), 0, 1)
