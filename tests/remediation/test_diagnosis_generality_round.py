"""The generality round of 2026-12-07 (tests/remediation/unseen/corpus_26.txt, issue 29): 60 real excerpts from LSF,
PBS, Kubernetes, mp.spawn, fairseq, Lightning, NeMo, Megatron and Windows logs, split with a fixed seed before anything
was scored. Before the redesign: 26/60 (held-out 15/30); after, with the redesign tuned on the tuning half only: the
figures in docs/DIAGNOSIS.md ("Generality round, 2026-12-07"). Print them:
    DS_ACCELERATOR=cpu .venv/bin/python tests/remediation/generality_round.py --misses
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from diagnosis_eval import evaluate  # noqa: E402
from generality_round import SEED, cases, split  # noqa: E402
from unseen_round import REPO, UNSEEN, split_unseen  # noqa: E402

from ulyssesd.remediation.diagnosis import LABELS, diagnose  # noqa: E402

CASES = cases()
SPLIT = split()
HELDOUT_FLOOR = 0.95  # measured 30/30 once, after the redesign; the gate
TUNE_FLOOR = 0.95  # measured 30/30


def _part(name: str):
    return [c for c in CASES if SPLIT[c.id] == name]


def test_round_shape_and_seeded_split():
    assert len(CASES) >= 40 and {c.label for c in CASES} <= set(LABELS)
    assert sum(c.label == "healthy" for c in CASES) >= 10
    assert all(c.source.startswith("https://github.com/") and c.why for c in CASES)
    assert 2 * len(_part("heldout")) >= len(CASES)
    assert split_unseen([c.id for c in CASES], SEED) == SPLIT != split_unseen([c.id for c in CASES], SEED + 1)


# fairseq#940's rows are also one of the unseen round's loss *curves* (replayed by the loss detectors, never a crash-log
# case the diagnosis was tuned on); found by this test after the round was frozen, kept so the seeded split stays put.
KNOWN_CURVE_OVERLAP = {"https://github.com/facebookresearch/fairseq/issues/940"}


def test_round_sources_were_in_no_older_corpus():
    old = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests/fixtures/logs_real").glob("corpus_*.txt"))
    old += (UNSEEN / "corpus_25.txt").read_text(encoding="utf-8")
    old += "\n".join(p.read_text() for p in (REPO / "tests/fixtures/replay/real").glob("*.json"))
    old += "\n".join(p.read_text() for p in (UNSEEN / "curves").glob("*.json"))
    seen = [c.source for c in CASES if re.search(re.escape(c.source) + r"(?!\d)", old)
            and c.source not in KNOWN_CURVE_OVERLAP]
    assert not seen, seen


def _gate(part: str, floor: float) -> None:
    res = evaluate(_part(part), diagnose)
    failures_called_healthy = [c.id for c, got, _ in res.misses if got == "healthy"]
    assert not res.healthy_flagged, res.healthy_flagged
    assert not failures_called_healthy, failures_called_healthy
    assert res.accuracy >= floor, [(c.id, c.label, got) for c, got, _ in res.misses]


def test_heldout_half_reaches_95_percent_no_healthy_flagged_no_failure_called_healthy():
    _gate("heldout", HELDOUT_FLOOR)


def test_tuning_half_reaches_95_percent():
    _gate("tune", TUNE_FLOOR)


def test_every_decision_cites_its_line():
    for c in CASES:
        d = diagnose(c.text, exit_code=c.exit_code, signal=c.signal)
        if d.label != "healthy":
            assert d.evidence and d.reason, c.id
