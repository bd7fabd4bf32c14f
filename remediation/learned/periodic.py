"""Periodic slow steps, recognised by their period: an evaluation, a save or a data-shard switch the job does
not announce makes a short run of slow steps every N steps. Such a run is the run's own rhythm, not a
slowdown: the fit learns its period, phase and length from the healthy history, the slow-step detector lets a
run inside that window pass (a slowdown that outlasts the window is still found), and the fitted slow-step
ratio is computed without those steps (they would otherwise raise it until the detector went blind).

Pure: `find_period(runs)` reads (start step, length) of the slow runs a fit saw; `in_window` is the test the
detector applies.
"""

from __future__ import annotations

from typing import Any

MIN_PERIOD = 5          # shorter: the slow steps are a slowdown, not an occasional piece of work
MIN_OCCURRENCES = 3     # a period seen fewer times is a coincidence
MATCH_SHARE = 0.8       # share of its slots in the history that must hold a slow run (a rhythm, not chance)
TOLERANCE = 1           # steps a run's start may drift from its slot (a record spans steps, a step is late)
MAX_RUN_STEPS = 20      # a longer run every period is a slowdown that repeats, never passed over


def find_period(runs: list[tuple[int, int]], first_step: int, last_step: int) -> dict[str, Any] | None:
    """The period of `runs` (start step, length in steps) over the history `first_step`..`last_step`, or None.

    Accepted when at least MATCH_SHARE of the slots phase + k * period in the history hold a run starting
    within TOLERANCE of it, at least MIN_OCCURRENCES times, and the history covers MIN_OCCURRENCES periods
    (other slow runs - a GC step, a noisy neighbour - are left to the detector as before);
    its runs are short (<= MAX_RUN_STEPS, at most a third of the period). Candidates: the gaps between
    consecutive starts (and their halves/thirds: a missed occurrence doubles a gap)."""
    if len(runs) < MIN_OCCURRENCES:
        return None
    starts = [s for s, _ in runs]
    gaps = {b - a for a, b in zip(starts, starts[1:], strict=False)}
    cands = sorted({g // d for g in gaps for d in (1, 2, 3) if g // d >= MIN_PERIOD})
    best: dict[str, Any] | None = None
    for p in cands:
        # The phase that explains the most starts (each start's residue, within the tolerance).
        residues = [s % p for s in starts]
        for phase in sorted(set(residues)):
            hit = [(s, n) for (s, n), r in zip(runs, residues, strict=False) if _near(r, phase, p)]
            slots = len(range(first_step + (phase - first_step) % p, last_step + 1, p))
            if len(hit) < MIN_OCCURRENCES or len({s // p for s, _ in hit}) < MATCH_SHARE * slots:
                continue
            length = max(n for _, n in hit)
            if length > MAX_RUN_STEPS or 3 * length > p or (last_step - first_step) < MIN_OCCURRENCES * p:
                continue
            # Prefer the period explaining more runs, then the longer one (a multiple explains fewer).
            key = (len(hit), p)
            if best is None or key > (best["matched"], best["period"]):
                best = {"period": p, "phase": phase, "steps": length, "matched": len(hit), "runs": len(runs),
                        "starts": [s for s, _ in hit][-8:]}
    return best


def _near(residue: int, phase: int, period: int) -> bool:
    d = abs(residue - phase)
    return min(d, period - d) <= TOLERANCE


def in_window(step: int, period: int, phase: int, steps: int) -> bool:
    """Whether `step` falls in a learned periodic slow window: from TOLERANCE before the slot to
    `steps` + TOLERANCE after its start."""
    if period <= 0:
        return False
    off = (step - phase) % period
    return off <= steps - 1 + TOLERANCE or off >= period - TOLERANCE
