"""Sample order across restarts and layouts: resume, rollback with skipped ranges and a change of the
data-parallel size give exactly the batches of an uninterrupted run; weighted blends keep their shares;
the prefetch loader yields what inline loading yields and re-raises data errors at the step that needs them."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from ulyssesd.training.data.batches import DataCursor, DataError, SampleSource, cursor_for
from ulyssesd.training.data.blend import BlendSchedule, slot_counts
from ulyssesd.training.data.indexed_dataset import IndexedDatasetWriter
from ulyssesd.training.data.loader import PrefetchLoader
from ulyssesd.training.spec import DataSpec

SEQ = 16


def _dataset(path, lo, hi, n_docs=60, seed=0):
    """An indexed dataset whose tokens all lie in [lo, hi): tells the blend's components apart."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.dtype("<u2")) as w:
        for _ in range(n_docs):
            w.add_document(rng.integers(lo, hi, size=int(rng.integers(5, 40))))
    return str(path)


@pytest.fixture(scope="module")
def blend_spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    a = _dataset(d / "a", 0, 100, seed=1)
    b = _dataset(d / "b", 100, 200, seed=2)
    return DataSpec(kind="indexed", blend=[{"path": a, "weight": 3.0}, {"path": b, "weight": 1.0}], seed=11)


def _run(spec, steps, dp, micro, accum=1, state=None, depth=2):
    """Simulated run: {step: {global index: sample tokens}} as all DP ranks together read them."""
    source = SampleSource(spec, SEQ, vocab_size=256, seed=0)
    cursors = [cursor_for(spec, state) for _ in range(dp)]
    loaders = [PrefetchLoader(source, cursors[r], r, dp, micro, accum, depth=depth) for r in range(dp)]
    out = {}
    try:
        for step in range(steps):
            seen = {}
            for r in range(dp):
                got = loaders[r].next(cursors[r])
                for ix, batch in zip(got.indices, got.micro, strict=True):
                    for i, row in zip(ix, batch, strict=True):
                        seen[i] = row.tolist()
            out[step] = seen
    finally:
        for ld in loaders:
            ld.close()
    return out, json.loads(json.dumps(cursors[0].state_dict()))  # a checkpoint's round trip


def _flat(run):
    return [(i, run[s][i]) for s in sorted(run) for i in sorted(run[s])]


def test_resume_gives_exactly_the_uninterrupted_batches(blend_spec):
    full, _ = _run(blend_spec, 12, dp=2, micro=2)
    first, state = _run(blend_spec, 5, dp=2, micro=2)
    rest, _ = _run(blend_spec, 7, dp=2, micro=2, state=state)
    assert [first[s] for s in range(5)] + [rest[s] for s in range(7)] == [full[s] for s in range(12)]
    # Negative control: a resume that lost the cursor replays the start instead.
    replay, _ = _run(blend_spec, 7, dp=2, micro=2, state=None)
    assert replay[0] != full[5]


def test_rollback_with_a_skipped_range_matches_a_run_that_skipped_it_from_the_start(blend_spec):
    # Run B trains 10 steps, is rolled back to its step-4 checkpoint and the daemon skips [20, 27).
    _, at4 = _run(blend_spec, 4, dp=2, micro=2)
    assert at4["next_sample"] == 16
    rolled = DataSpec(**{**blend_spec.model_dump(), "skip_ranges": [(20, 27)]})
    after, _ = _run(rolled, 8, dp=2, micro=2, state=at4)
    # Run A had the skip range in its spec from the start.
    a_full, _ = _run(rolled, 12, dp=2, micro=2)
    assert [after[s] for s in range(8)] == [a_full[s] for s in range(4, 12)]
    trained = {i for s in after for i in after[s]}
    assert not trained & set(range(20, 27)) and {16, 17, 18, 19, 27} <= trained


def test_dp_size_change_keeps_the_global_order(blend_spec):
    dp2, state = _run(blend_spec, 6, dp=2, micro=2)  # 4 samples per step
    dp4, _ = _run(blend_spec, 6, dp=4, micro=1)
    dp1, _ = _run(blend_spec, 6, dp=1, micro=2, accum=2)
    assert dp2 == dp4 == dp1  # same global batch: same samples per step, whatever the layout
    # Resume the dp=2 checkpoint on 4 ranks with a larger global batch: the global order goes on.
    more, _ = _run(blend_spec, 3, dp=4, micro=2, state=state)
    whole, _ = _run(blend_spec, 12, dp=2, micro=2)
    assert _flat(dp2) + _flat(more) == _flat(whole)


def test_blend_shares_are_exact_per_block_and_every_local_sample_is_used_once():
    sched = BlendSchedule((3.0, 1.0), seed=5, block=64)
    assert sched.counts == [48, 16]
    picks = [sched.locate(i) for i in range(64 * 8)]
    for blk in range(8):
        assert Counter(d for d, _ in picks[blk * 64:(blk + 1) * 64]) == {0: 48, 1: 16}
    for d, n in ((0, 48 * 8), (1, 16 * 8)):
        assert sorted(loc for dd, loc in picks if dd == d) == list(range(n))
    assert sched.consumed(100) == [sum(1 for d, _ in picks[:100] if d == 0), sum(1 for d, _ in picks[:100] if d == 1)]
    assert picks != [BlendSchedule((3.0, 1.0), seed=6, block=64).locate(i) for i in range(64 * 8)]
    assert slot_counts([1000.0, 1.0], 64) == [63, 1]  # a tiny weight still gets its slot
    with pytest.raises(ValueError, match="weights must be > 0"):
        slot_counts([1.0, 0.0], 64)


def test_blended_source_reads_each_dataset_at_its_share(blend_spec):
    src = SampleSource(blend_spec, SEQ, vocab_size=256, seed=0)
    from_b = sum(int(src.sample(i)[0] >= 100) for i in range(2048))
    assert from_b == 512  # weight 1 of 4, exact over two 1024-sample blocks
    pos = src.position(DataCursor(2048, [(0, 48)]))
    assert pos["samples_consumed"] == 2048 and pos["samples_trained"] == 2000
    assert [c["samples"] for c in pos["components"]] == [1536, 512]
    assert pos["epoch"] == max(c["samples"] // c["windows"] for c in pos["components"]) > 0


def test_prefetch_equals_inline_loading_and_records_wait(blend_spec):
    fast, _ = _run(blend_spec, 6, dp=2, micro=3, depth=3)
    inline, _ = _run(blend_spec, 6, dp=2, micro=3, depth=0)
    assert fast == inline
    src = SampleSource(blend_spec, SEQ, vocab_size=256, seed=0)
    cursor = DataCursor()
    loader = PrefetchLoader(src, cursor, 0, 1, 4, 1, depth=2)
    try:
        got = loader.next(cursor)
        assert got.samples == (0, 4) and cursor.next_sample == 4 and got.wait_s >= 0
        assert torch.equal(got.micro[0], src.batch([0, 1, 2, 3]))
    finally:
        loader.close()


def test_a_data_error_in_the_prefetch_thread_surfaces_at_its_step(tmp_path):
    path = tmp_path / "t.bin"
    vals = np.arange(400, dtype="<u2") % 50
    vals[250] = 999
    vals.tofile(path)
    spec = DataSpec(kind="tokens", path=str(path), seed=3)
    src = SampleSource(spec, 8, vocab_size=256, seed=0)
    bad_step = min(i for i in range(src.num_windows) if src.window_of(i) == 31) // 2  # tokens 248..256
    cursor = DataCursor()
    loader = PrefetchLoader(src, cursor, 0, 1, 2, 1, depth=2)
    try:
        for _ in range(bad_step):
            loader.next(cursor)  # the healthy steps before it are fine
        with pytest.raises(DataError, match="token 999 at token offset 250"):
            loader.next(cursor)
    finally:
        loader.close()
