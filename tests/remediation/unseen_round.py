"""The unseen round of 2026-12-03: real crash-log excerpts and real loss curves collected after the rules were
written, and the split that keeps at least half of them away from rule writing.

The split is drawn with a fixed seed over the sorted ids of each set (crash logs and curves separately), so it is
decided by the ids alone, before any result is looked at: `split_unseen(ids)` puts the first ceil(n/2) ids of the
seeded shuffle in the held-out part. Adding a case re-draws the split, so a later round goes in its own file.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UNSEEN = HERE / "unseen"
CRASH_CORPUS = UNSEEN / "corpus_25.txt"
CURVES = UNSEEN / "curves"
SEED = 20261203  # fixed before any case was scored; written down in docs/DIAGNOSIS.md

sys.path.insert(0, str(REPO / "bench"))
from diagnosis_eval import Case, parse_corpus_text  # noqa: E402


def split_unseen(ids: list[str], seed: int = SEED) -> dict[str, str]:
    """id -> 'heldout' | 'tune': a seeded shuffle of the sorted ids, the first ceil(n/2) held out."""
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    n_held = len(order) - len(order) // 2
    return {cid: ("heldout" if i < n_held else "tune") for i, cid in enumerate(order)}


def crash_cases() -> list[Case]:
    """The crash-log excerpts of the round (the logs_real corpus format)."""
    return parse_corpus_text(CRASH_CORPUS.read_text(encoding="utf-8"), CRASH_CORPUS.name)


def crash_split() -> dict[str, str]:
    return split_unseen([c.id for c in crash_cases()])


def curves() -> list[dict[str, Any]]:
    """The real loss curves of the round (the replay/real JSON format), each with its drawn 'split'."""
    items = [json.loads(p.read_text()) for p in sorted(CURVES.glob("*.json"))]
    # Drawn per kind (incident / healthy): an unstratified draw over 10 curves put all 3 incidents in the tuning
    # part, leaving nothing held out to check that real incidents are acted on (changed before any curve was replayed).
    for kind in sorted({c["kind"] for c in items}):
        group = [c for c in items if c["kind"] == kind]
        split = split_unseen([c["id"] for c in group])
        for c in group:
            c["split"] = split[c["id"]]
    return items
