"""Keyed orders: a 64-bit mixing hash and an O(1)-memory keyed permutation of [0, n).

The data order of every source is built from these, so it is a pure function of (seed, index).
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a fast, well-distributed 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def key_of(*parts: int) -> int:
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix64(h ^ (p & MASK64))
    return h


def permute_index(i: int, n: int, key: int) -> int:
    """A keyed bijection of [0, n) (Feistel network + cycle walking).

    O(1) memory, so the shuffled order of billions of windows needs no permutation table.
    """
    if not 0 <= i < n:
        raise IndexError(f"index {i} outside [0, {n})")
    if n == 1:
        return 0
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    lo_mask = (1 << half) - 1
    x = i
    while True:  # cycle walking: re-apply until the value lands inside [0, n); expected < 4 rounds
        left, right = x >> half, x & lo_mask
        for r in range(4):
            left, right = right, left ^ (_mix64(key ^ (r << 56) ^ right) & lo_mask)
        x = (left << half) | right
        if x < n:
            return x
