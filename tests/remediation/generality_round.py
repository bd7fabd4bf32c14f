"""The generality round of 2026-12-07 (issue 29): real crash/healthy log excerpts from ecosystems the older corpora are
thin on (LSF, PBS/Torque, Kubernetes, mp.spawn, fairseq, Lightning, NeMo, Megatron, Windows), collected before the
diagnosis was redesigned and frozen in tests/remediation/unseen/corpus_26.txt.

The split is drawn with a fixed seed over the sorted ids (`unseen_round.split_unseen`), before any case was scored:
ceil(n/2) held out. The redesign was tuned on the `tune` half only; the `heldout` half was scored once, after.

    DS_ACCELERATOR=cpu .venv/bin/python tests/remediation/generality_round.py [--split all|tune|heldout] [--misses]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from unseen_round import REPO, UNSEEN, split_unseen  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from diagnosis_eval import Case, confusion_table, evaluate, parse_corpus_text  # noqa: E402

CORPUS = UNSEEN / "corpus_26.txt"
SEED = 20261207  # fixed before any case was scored; written down in docs/DIAGNOSIS.md


def cases() -> list[Case]:
    return parse_corpus_text(CORPUS.read_text(encoding="utf-8"), CORPUS.name)


def split() -> dict[str, str]:
    return split_unseen([c.id for c in cases()], SEED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("all", "tune", "heldout"), default="all")
    ap.add_argument("--misses", action="store_true")
    args = ap.parse_args(argv)
    from ulyssesd.remediation.diagnosis import LABELS, diagnose

    parts = split()
    for name in (("tune", "heldout") if args.split == "all" else (args.split,)) + (("all",) if args.split == "all" else ()):
        chosen = [c for c in cases() if name == "all" or parts[c.id] == name]
        res = evaluate(chosen, diagnose)
        bad_healthy = sum(n for (exp, got), n in res.confusion.items() if exp != "healthy" and got == "healthy")
        print(f"{name}: {res.correct}/{res.total} = {100 * res.accuracy:.1f} %; healthy flagged: "
              f"{len(res.healthy_flagged)}; failures called healthy: {bad_healthy}")
        print(confusion_table(res, LABELS))
        if args.misses:
            for c, got, reason in res.misses:
                print(f"  MISS {c.id}: expected {c.label}, got {got}: {reason[:200]}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
