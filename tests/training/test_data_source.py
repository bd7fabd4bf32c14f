"""SampleSource: synthetic determinism and learnability, text/token windows, clear file errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ulyssesd.training.data.batches import DataError, SampleSource, permute_index
from ulyssesd.training.spec import DataSpec


def _tokens_file(tmp_path, values, dtype="uint16", name="toks.bin"):
    path = tmp_path / name
    np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tofile(path)
    return path


# ------------------------------------------------------------------------------- permutation
@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4099])
def test_permute_index_is_a_bijection(n):
    out = [permute_index(i, n, key=12345) for i in range(n)]
    assert sorted(out) == list(range(n))


def test_permute_index_depends_on_key_and_rejects_out_of_range():
    a = [permute_index(i, 1000, 1) for i in range(1000)]
    b = [permute_index(i, 1000, 2) for i in range(1000)]
    assert a != b and a != list(range(1000))
    with pytest.raises(IndexError):
        permute_index(1000, 1000, 1)


# --------------------------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_per_seed_and_index_and_in_vocab():
    src = SampleSource(DataSpec(kind="synthetic"), seq_len=64, vocab_size=50, seed=7)
    again = SampleSource(DataSpec(kind="synthetic"), seq_len=64, vocab_size=50, seed=7)
    other = SampleSource(DataSpec(kind="synthetic"), seq_len=64, vocab_size=50, seed=8)
    for i in [0, 1, 99, 10**12]:
        x = src.sample(i)
        assert x.dtype == torch.long and x.shape == (65,)
        assert int(x.min()) >= 0 and int(x.max()) < 50
        assert torch.equal(x, again.sample(i))
    # Different indices and different seeds give different data (negative controls).
    assert not torch.equal(src.sample(0), src.sample(1))
    assert any(not torch.equal(src.sample(i), other.sample(i)) for i in range(4))


def test_spec_seed_overrides_train_seed():
    a = SampleSource(DataSpec(kind="synthetic", seed=3), 32, 256, seed=1)
    b = SampleSource(DataSpec(kind="synthetic"), 32, 256, seed=3)
    assert a.seed == 3 and torch.equal(a.sample(5), b.sample(5))


def _train_tiny(batch_fn, steps=40, vocab=256, ctx=3, lr=2.0):
    """A tiny next-token model (embeddings of the last `ctx` tokens -> logits); returns (first, last) loss."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, 32)
    head = torch.nn.Linear(32 * ctx, vocab)
    params = [*emb.parameters(), *head.parameters()]
    losses = []
    for step in range(steps):
        toks = batch_fn(step)  # [b, s+1]
        x = toks[:, :-1]
        ctxs = torch.stack([torch.roll(x, k, dims=1) for k in range(ctx)], dim=-1)[:, ctx:]
        logits = head(emb(ctxs).flatten(-2))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), toks[:, ctx + 1:].reshape(-1))
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():  # plain SGD by hand: torch.optim's first use imports dynamo (seconds)
            for p, g in zip(params, grads, strict=True):
                p -= lr * g
        losses.append(loss.item())
    return sum(losses[:3]) / 3, sum(losses[-5:]) / 5


def test_synthetic_is_learnable_in_a_few_dozen_steps():
    src = SampleSource(DataSpec(kind="synthetic"), seq_len=64, vocab_size=256, seed=1)
    first, last = _train_tiny(lambda step: src.batch(range(step * 8, step * 8 + 8)))
    assert first > 4.5 and last < 0.6 * first, (first, last)
    # Negative control: uniform random tokens over the same 64-token alphabet cannot go below ln(64).
    gen = torch.Generator().manual_seed(0)
    _, rand_last = _train_tiny(lambda step: torch.randint(0, 64, (8, 65), generator=gen))
    assert rand_last > math.log(64) * 0.95, rand_last
    assert last < rand_last * 0.7


# ----------------------------------------------------------------------------------- text / tokens
def test_text_windows_cover_each_window_once_per_epoch_and_reshuffle(tmp_path):
    text = bytes(range(256)) * 4  # 1024 bytes
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    src = SampleSource(DataSpec(kind="text", path=str(path)), seq_len=31, vocab_size=256, seed=5)
    n = src.num_windows
    assert n == (1024 - 1) // 31
    epoch0 = [src.window_of(i) for i in range(n)]
    epoch1 = [src.window_of(i) for i in range(n, 2 * n)]
    assert sorted(epoch0) == list(range(n)) == sorted(epoch1)
    assert epoch0 != epoch1  # each epoch is a fresh order
    for i in [0, 3, n + 2]:
        w = src.window_of(i)
        expect = torch.tensor(list(text[w * 31:w * 31 + 32]))
        assert torch.equal(src.sample(i), expect)


def test_tokens_uint32_windows_and_vocab_check(tmp_path):
    vals = np.arange(1000, dtype=np.uint32) + 70000
    path = _tokens_file(tmp_path, vals, "uint32")
    src = SampleSource(DataSpec(kind="tokens", path=str(path), token_dtype="uint32"), 9, 80000, seed=1)
    x = src.sample(4)
    w = src.window_of(4)
    assert torch.equal(x, torch.arange(70000 + w * 9, 70000 + w * 9 + 10))
    small = SampleSource(DataSpec(kind="tokens", path=str(path), token_dtype="uint32"), 9, 70005, seed=1)
    with pytest.raises(DataError) as err:
        small.sample(4)
    w = small.window_of(4)
    bad_off = w * 9 + (5 if w == 0 else 0)
    msg = str(err.value)
    assert str(path) in msg and f"token offset {bad_off}" in msg and "70005" in msg


def test_tokens_out_of_range_error_names_exact_offset(tmp_path):
    vals = np.zeros(200, dtype=np.uint16)
    vals[123] = 9999
    path = _tokens_file(tmp_path, vals)
    src = SampleSource(DataSpec(kind="tokens", path=str(path)), 7, 256, seed=0)
    hits = 0
    for i in range(src.num_windows):
        w = src.window_of(i)
        if w * 7 <= 123 < w * 7 + 8:
            with pytest.raises(DataError, match="token 9999 at token offset 123 .byte offset 246."):
                src.sample(i)
            hits += 1
        else:
            assert int(src.sample(i).max()) == 0  # the check is lazy: clean windows still read
    assert hits >= 1


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.bin"):
        SampleSource(DataSpec(kind="tokens", path=str(tmp_path / "nope.bin")), 8, 256, 0)


def test_short_file_is_a_clear_error(tmp_path):
    path = _tokens_file(tmp_path, np.arange(8))
    with pytest.raises(DataError, match=r"holds 8 tokens \(uint16\) but one sample needs seq_len\+1 = 9"):
        SampleSource(DataSpec(kind="tokens", path=str(path)), 8, 256, 0)
    # Exactly seq_len+1 tokens is enough (boundary).
    assert SampleSource(DataSpec(kind="tokens", path=str(path)), 7, 256, 0).num_windows == 1


def test_wrong_dtype_size_is_a_clear_error(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 1001)
    with pytest.raises(DataError, match="size 1001 bytes is not a multiple of 2"):
        SampleSource(DataSpec(kind="tokens", path=str(path)), 8, 256, 0)
    path.write_bytes(b"\x01" * 1002)
    with pytest.raises(DataError, match="not a multiple of 4"):
        SampleSource(DataSpec(kind="tokens", path=str(path), token_dtype="uint32"), 8, 256, 0)


def test_empty_file_and_directory_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="holds 0 tokens"):
        SampleSource(DataSpec(kind="text", path=str(empty)), 8, 256, 0)
    with pytest.raises(DataError, match="not a regular file"):
        SampleSource(DataSpec(kind="text", path=str(tmp_path)), 8, 256, 0)


def test_pickled_token_source_reopens_the_file_instead_of_copying_it(tmp_path):
    import pickle

    path = _tokens_file(tmp_path, np.arange(100_000) % 200)
    src = SampleSource(DataSpec(kind="tokens", path=str(path)), 15, 256, seed=2)
    blob = pickle.dumps(src)
    assert len(blob) < 10_000  # not the 200 KB of token data
    clone = pickle.loads(blob)
    assert all(torch.equal(clone.sample(i), src.sample(i)) for i in (0, 7, 9999))
