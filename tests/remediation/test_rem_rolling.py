"""RollingMedian's countdown trigger rebuilds at exactly the additions the original two-condition rule did
(every addition while the window fills, every `refresh` additions once full), so `med` moves identically."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from ulyssesd.remediation.detectors.base import RollingMedian


class _Reference:
    """The pre-optimization rule, kept as the oracle."""

    def __init__(self, size: int, refresh: int, min_count: int):
        self.size, self.refresh, self.min_count = size, refresh, min(min_count, size)
        self.fifo: deque[float] = deque(maxlen=size)
        self.stale = 0
        self.med: float | None = None

    def sync(self) -> None:
        s = sorted(self.fifo)
        n, mid = len(s), len(s) // 2
        self.med = (s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])) if n >= self.min_count else None
        self.stale = 0

    def add(self, x: float) -> None:
        self.fifo.append(x)
        self.stale += 1
        if self.stale >= self.refresh or len(self.fifo) < self.size:
            self.sync()

    def values(self) -> list[float]:
        if self.stale:
            self.sync()
        return sorted(self.fifo)


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 30), refresh=st.integers(1, 12), min_count=st.integers(1, 12),
       ops=st.lists(st.one_of(st.floats(-1e6, 1e6), st.just("values"), st.just("clear")), max_size=200))
def test_trigger_matches_the_reference_rule(size, refresh, min_count, ops):
    got, ref = RollingMedian(size, refresh, min_count), _Reference(size, refresh, min_count)
    for op in ops:
        if op == "values":
            assert got.values() == ref.values()
        elif op == "clear":
            got.clear()
            ref = _Reference(size, refresh, min_count)
        else:
            got.add(op)
            ref.add(op)
        assert got.med == ref.med, (op, len(got))


def test_median_is_stale_between_refreshes_once_full():
    # Negative control: once full, med does not move until `refresh` additions (the behaviour being kept).
    rm = RollingMedian(5, refresh=3, min_count=1)
    for x in (1.0, 2.0, 3.0, 4.0):
        rm.add(x)
    assert rm.med == 2.5  # rebuilt on every addition while filling
    rm.add(5.0)
    rm.add(100.0)
    assert rm.med == 2.5  # full: 2 additions since the last rebuild
    rm.add(100.0)
    assert rm.med == 5.0 and rm.values() == [3.0, 4.0, 5.0, 100.0, 100.0]
