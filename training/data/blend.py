"""Weighted blending of several datasets, as a pure function of the global sample index.

Global indices are cut into blocks of `block` samples. Inside every block each dataset owns a fixed
number of slots (its weight share of the block, largest-remainder rounding, at least one slot for every
positive weight), and a keyed permutation of the block decides which position gets which slot. So:
- sample i -> (dataset, that dataset's own sample index) is O(1), needs no table and no iterator state:
  a resume, a rollback that skips ranges and a change of data-parallel size all see the same mapping;
- every block of `block` consecutive samples holds exactly the planned share of each dataset.
"""

from __future__ import annotations

from dataclasses import dataclass

from .order import key_of, permute_index

DEFAULT_BLOCK = 1024


def slot_counts(weights: list[float], block: int) -> list[int]:
    """Slots of each dataset per block: proportional to the weights, summing to `block`."""
    if not weights:
        raise ValueError("a blend needs at least one dataset")
    if any(not w > 0 for w in weights):
        raise ValueError(f"blend weights must be > 0, got {weights}")
    if block < len(weights):
        raise ValueError(f"blend block {block} is smaller than the number of datasets {len(weights)}")
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [max(1, int(x)) for x in exact]
    # Largest remainder first; ties by dataset order (deterministic).
    order = sorted(range(len(weights)), key=lambda k: (-(exact[k] - int(exact[k])), k))
    k = 0
    while sum(counts) < block:
        counts[order[k % len(order)]] += 1
        k += 1
    while sum(counts) > block:  # only when the max(1, .) floor overshot: take from the largest
        big = max(range(len(counts)), key=lambda j: (counts[j], -j))
        counts[big] -= 1
    return counts


@dataclass(frozen=True)
class BlendSchedule:
    """Maps a global sample index to (dataset, local sample index)."""

    weights: tuple[float, ...]  # relative weight of each dataset (any positive scale)
    seed: int  # order seed
    block: int = DEFAULT_BLOCK  # samples per block over which the shares are exact

    def __post_init__(self) -> None:
        object.__setattr__(self, "_counts", slot_counts(list(self.weights), self.block))
        starts = [0]
        for c in self._counts:  # type: ignore[attr-defined]
            starts.append(starts[-1] + c)
        object.__setattr__(self, "_starts", starts)

    @property
    def counts(self) -> list[int]:
        return list(self._counts)  # type: ignore[attr-defined]

    def locate(self, global_index: int) -> tuple[int, int]:
        if global_index < 0:
            raise IndexError(f"global sample index must be >= 0, got {global_index}")
        blk, pos = divmod(global_index, self.block)
        slot = permute_index(pos, self.block, key_of(self.seed, blk, 0xB1E4D))
        starts = self._starts  # type: ignore[attr-defined]
        d = 0
        while starts[d + 1] <= slot:
            d += 1
        return d, blk * self._counts[d] + (slot - starts[d])  # type: ignore[attr-defined]

    def consumed(self, n: int) -> list[int]:
        """How many samples of each dataset global indices [0, n) take."""
        blk, rest = divmod(n, self.block)
        out = [blk * c for c in self._counts]  # type: ignore[attr-defined]
        for pos in range(blk * self.block, blk * self.block + rest):
            out[self.locate(pos)[0]] += 1
        return out
