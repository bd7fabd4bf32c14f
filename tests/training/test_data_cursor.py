"""DataCursor and batch_indices: determinism, DP disjointness, skip ranges, save/restore (property tests)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ulyssesd.training.data.batches import DataCursor, batch_indices, normalize_ranges

ranges_st = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 60)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=6)
layout_st = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))  # dp, micro_batch, grad_accum


def _step_all_ranks(cursor: DataCursor, dp: int, mb: int, ga: int):
    """One optimizer step as every DP rank computes it (each from its own copy of the same cursor)."""
    per_rank, ranges = [], set()
    for r in range(dp):
        c = copy.deepcopy(cursor)
        idx, rng = batch_indices(c, r, dp, mb, ga)
        per_rank.append(idx)
        ranges.add(rng)
        after = c
    assert len(ranges) == 1  # all ranks agree on the step's global range
    return per_rank, ranges.pop(), after


@settings(max_examples=150, deadline=None)
@given(ranges_st, layout_st, st.integers(0, 200), st.integers(1, 6))
def test_steps_are_disjoint_skip_free_and_contiguous(skips, layout, start, steps):
    dp, mb, ga = layout
    cursor = DataCursor(start, skips)
    seen: list[int] = []
    prev_end = start
    for _ in range(steps):
        per_rank, (lo, hi), cursor = _step_all_ranks(cursor, dp, mb, ga)
        flat = [i for rank in per_rank for micro in rank for i in micro]
        assert all(len(micro) == mb for rank in per_rank for micro in rank)
        assert all(len(rank) == ga for rank in per_rank)
        assert len(flat) == len(set(flat)) == dp * mb * ga  # DP groups disjoint
        assert lo == prev_end and hi == max(flat) + 1 and min(flat) >= lo
        assert not any(cursor.is_skipped(i) for i in flat)
        assert not any(s <= i < e for i in flat for s, e in skips)  # never trains on a skipped sample
        # Nothing in [lo, hi) outside the skip ranges is left out (no silent data loss).
        assert set(flat) == {i for i in range(lo, hi) if not any(s <= i < e for s, e in skips)}
        seen.extend(flat)
        prev_end = hi
    assert len(seen) == len(set(seen))  # no sample twice across steps


@settings(max_examples=100, deadline=None)
@given(ranges_st, layout_st, st.integers(0, 5), st.integers(1, 5))
def test_cursor_save_restore_reproduces_the_sequence(skips, layout, before, after):
    dp, mb, ga = layout
    cursor = DataCursor(0, skips)
    for _ in range(before):
        batch_indices(cursor, 0, dp, mb, ga)
    saved = cursor.state_dict()
    expected = [batch_indices(cursor, r % dp, dp, mb, ga) for r in range(after)]
    restored = DataCursor()
    restored.load_state_dict(saved)
    assert restored == DataCursor(saved["next_sample"], saved["skip_ranges"])
    assert [batch_indices(restored, r % dp, dp, mb, ga) for r in range(after)] == expected


def test_sp_ranks_of_one_dp_group_get_the_same_indices():
    # SP ranks pass the same dp_rank: identical indices; different dp_rank: different indices.
    a = batch_indices(DataCursor(10), 1, 2, 2, 2)
    b = batch_indices(DataCursor(10), 1, 2, 2, 2)
    c = batch_indices(DataCursor(10), 0, 2, 2, 2)
    assert a == b and a[0] != c[0]


def test_rollback_and_skip_excludes_the_spike_window():
    cursor = DataCursor()
    history = [batch_indices(cursor, 0, 1, 4, 1) for _ in range(5)]
    spike_range = history[2][1]  # samples of the step that spiked
    rolled = DataCursor(history[1][1][1])  # cursor as saved after step 1
    rolled.add_skip(*spike_range)
    idx, _ = batch_indices(rolled, 0, 1, 4, 1)
    assert idx == [[12, 13, 14, 15]] and spike_range == (8, 12)


def test_normalize_merges_overlapping_and_touching_ranges_and_rejects_bad_ones():
    assert normalize_ranges([(10, 20), (0, 5), (5, 7), (15, 30), (40, 41)]) == [(0, 7), (10, 30), (40, 41)]
    assert DataCursor(0, [[3, 4], [1, 3]]).skip_ranges == [(1, 4)]
    for bad in ([(5, 5)], [(-1, 3)], [(4, 2)], [(1, 2, 3)]):
        with pytest.raises(ValueError, match="skip range"):
            normalize_ranges(bad)
    with pytest.raises(ValueError, match="next_sample"):
        DataCursor(-1)


def test_state_dict_is_json_friendly():
    import json

    c = DataCursor(42, [(1, 3), (2, 9)])
    assert json.loads(json.dumps(c.state_dict())) == {"next_sample": 42, "skip_ranges": [[1, 9]]}


def test_batch_indices_rejects_bad_layout():
    for args in [(2, 2, 1, 1), (-1, 2, 1, 1), (0, 0, 1, 1), (0, 1, 0, 1), (0, 1, 1, 0)]:
        with pytest.raises(ValueError):
            batch_indices(DataCursor(), *args)


def test_huge_skip_range_is_jumped_not_iterated():
    c = DataCursor(0, [(1, 10**15)])
    idx, rng = batch_indices(c, 0, 1, 3, 1)
    assert idx == [[0, 10**15, 10**15 + 1]] and rng == (0, 10**15 + 2)


def test_cursor_for_merges_checkpoint_state_with_spec_skip_ranges():
    from ulyssesd.training.data.batches import cursor_for
    from ulyssesd.training.spec import DataSpec

    spec = DataSpec(skip_ranges=[(100, 200)])
    assert cursor_for(spec) == DataCursor(0, [(100, 200)])
    c = cursor_for(spec, {"next_sample": 64, "skip_ranges": [[150, 300], [10, 20]]})
    assert c == DataCursor(64, [(10, 20), (100, 300)])
