"""Rank watch: notice a training rank that is gone while its launcher still runs.

When one rank dies (SIGKILL, segfault, a Python exception), its peers block in their next collective and
the launcher does not notice them: torchrun SIGTERMs the survivors and waits 30 s before it SIGKILLs them
(its `_close(timeout=30)`), and a rank blocked inside NCCL cannot run its SIGTERM handler. Measured on
2×H200 (bench/RESULTS.md) that wait was 32 s of a 79 s MTTR. The daemon sees the lost rank itself, gives the
attempt `grace_s` to end on its own (a normal exit: all ranks leave within milliseconds of each other after
the final barrier), and otherwise ends the attempt at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankWatch:
    """Per attempt: the rank pids seen alive, and since when each lost one has been gone."""

    grace_s: float  # a rank may be gone this long before the attempt is declared broken
    every_s: float  # how often to look (a process-table scan)
    seen: set[int] = field(default_factory=set)
    lost_since: dict[int, float] = field(default_factory=dict)
    next_check: float = 0.0

    def due(self, now: float) -> bool:
        if now < self.next_check:
            return False
        self.next_check = now + self.every_s
        return True

    def observe(self, now: float, live: list[int]) -> list[int] | None:
        """Feed the live rank pids; returns the lost pids once the first has been gone for `grace_s`."""
        alive = set(live)
        for pid in self.seen - alive:
            self.lost_since.setdefault(pid, now)
        self.seen |= alive
        if self.lost_since and now - min(self.lost_since.values()) >= self.grace_s:
            return sorted(self.lost_since)
        return None
