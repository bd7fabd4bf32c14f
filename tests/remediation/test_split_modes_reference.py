"""`split_modes` (inlined sums and a range shortcut, run on every engine's quarter window) answers exactly
what its plain O(n^2) form answered, ties included: the reference below is that form, unchanged."""

from __future__ import annotations

import math
import random

from ulyssesd.remediation.detectors.loss_band import _MAD_TO_SIGMA, _median, split_modes


def reference(values, min_share=0.15, min_gap=0.3, sigmas=4.0):
    xs = sorted(math.log(v) for v in values if v > 0 and math.isfinite(v))
    n = len(xs)
    if n < 30:
        return None
    ps, pq = [0.0], [0.0]
    for x in xs:
        ps.append(ps[-1] + x)
        pq.append(pq[-1] + x * x)

    def sse(i, j):
        m = j - i
        s = ps[j] - ps[i]
        return pq[j] - pq[i] - s * s / m

    lo = max(1, int(min_share * n))
    best3 = None
    for i in range(lo, n - 2 * lo + 1):
        left = sse(0, i)
        for j in range(i + lo, n - lo + 1):
            c = left + sse(i, j) + sse(j, n)
            if best3 is None or c < best3[0]:
                best3 = (c, i, j)
    best2 = min(((sse(0, i) + sse(i, n), i) for i in range(lo, n - lo + 1)), default=None)
    candidates = []
    if best3 is not None:
        candidates.append([(0, best3[1]), (best3[1], best3[2]), (best3[2], n)])
    if best2 is not None:
        candidates.append([(0, best2[1]), (best2[1], n)])
    for parts in candidates:
        groups = [xs[a:b] for a, b in parts]
        meds = [_median(g) for g in groups]
        spread = [_MAD_TO_SIGMA * _median([abs(x - m) for x in g]) for g, m in zip(groups, meds, strict=True)]
        if all(meds[k + 1] - meds[k] >= max(min_gap, sigmas * max(spread[k], spread[k + 1]))
               for k in range(len(groups) - 1)):
            return meds
    return None


def test_split_modes_matches_its_plain_form_on_mixtures_ties_and_noise():
    rnd = random.Random(20261207)
    found = 0
    for trial in range(400):
        n = rnd.choice([29, 30, 31, 45, 60, 100])
        shape = trial % 6
        if shape == 0:
            vals = [rnd.lognormvariate(1, 0.1) for _ in range(n)]                        # one mode
        elif shape == 1:
            vals = [rnd.choice([1.0, 3.0, 9.0]) * rnd.lognormvariate(0, 0.05) for _ in range(n)]  # three
        elif shape == 2:
            vals = [rnd.choice([2.0, 2.0, 2.5]) for _ in range(n)]                       # exact ties
        elif shape == 3:
            vals = [rnd.choice([1.0, 5.0]) * (1 + rnd.random() * 0.01) for _ in range(n)]  # two
        elif shape == 4:
            vals = [rnd.choice([1.0, float("nan"), -1.0, 4.0, math.inf]) for _ in range(n)]  # bad values dropped
        else:  # two modes whose log range is just below, at or just above min_gap (the range shortcut's edge)
            gap = rnd.choice([0.2999, 0.3, 0.3001, 0.35])
            vals = [rnd.choice([1.0, math.exp(gap)]) for _ in range(n)]
        for share in (0.05, 0.15, 0.4):
            got = split_modes(vals, min_share=share)
            assert got == reference(vals, min_share=share), (trial, share)
            found += got is not None
    assert found > 100  # the mixtures were split: the comparison covered the accepting path too
