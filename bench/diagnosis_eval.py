"""Accuracy of the log diagnosis on the real-log corpus (tests/fixtures/logs_real/corpus_*.txt).

    python bench/diagnosis_eval.py                      # held-out part: accuracy + confusion matrix
    python bench/diagnosis_eval.py --split train --misses
    python bench/diagnosis_eval.py --module /tmp/diagnosis_before.py   # the same with another diagnosis.py
    python bench/diagnosis_eval.py --file corpus_22.txt --split all --misses   # one batch only (a fresh round)
    python bench/diagnosis_eval.py --split all --by-file                 # correct / total per file and part

The corpus is split once, by a hash of each case id, *before* rules are written: rules are tuned on the
`train` part only and `heldout` (~40 %) measures them. The format of a case is in the corpus README.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "logs_real"
HELDOUT_PERCENT = 40  # share of cases (by id hash) kept out of rule writing
_CASE = "### case:"
_FIELDS = ("source", "label", "why", "exit_code", "signal")


class CorpusError(ValueError):
    """A corpus file is malformed; the message names the file, the case and what is wrong."""


@dataclass(frozen=True)
class Case:
    """One real log excerpt with its expected label."""

    id: str  # unique, stable: the split is derived from it
    source: str  # URL of the public thread (or repository + path)
    label: str  # expected diagnosis label
    why: str  # why that label, from the thread's evidence
    text: str  # the excerpt as published
    exit_code: int | None = None  # exit status the thread reports, if any
    signal: int | None = None  # terminating signal the thread reports, if any
    file: str = ""  # corpus file it came from


def split_of(case_id: str) -> str:
    """'heldout' or 'train', fixed by the id alone (sha256), so adding cases never moves old ones."""
    h = int(hashlib.sha256(case_id.encode()).hexdigest()[:8], 16)
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def _int_or_none(v: str | None, where: str) -> int | None:
    if v is None or v.strip().lower() in ("", "none", "null"):
        return None
    try:
        return int(v)
    except ValueError:
        raise CorpusError(f"{where}: not an integer: {v!r}") from None


def parse_corpus_text(text: str, name: str = "<text>") -> list[Case]:
    """Cases of one corpus file: '### case: ID', 'key: value' header lines, '---', then the excerpt."""
    cases: list[Case] = []
    blocks = text.split("\n" + _CASE)
    if not text.startswith(_CASE):
        blocks = blocks[1:]  # text before the first case is not a case
    else:
        blocks[0] = blocks[0][len(_CASE):]
    for block in blocks:
        head, sep, body = block.partition("\n---\n")
        lines = head.split("\n")
        cid = lines[0].strip()
        where = f"{name}: case {cid!r}"
        if not sep:
            raise CorpusError(f"{where}: no '---' line between the header and the excerpt")
        meta: dict[str, str] = {}
        for line in lines[1:]:
            key, colon, value = line.partition(":")
            if not colon or key.strip() not in _FIELDS:
                raise CorpusError(f"{where}: unexpected header line {line!r} (allowed keys: {', '.join(_FIELDS)})")
            meta[key.strip()] = value.strip()
        for need in ("source", "label", "why"):
            if not meta.get(need):
                raise CorpusError(f"{where}: missing '{need}:'")
        if not body.strip():
            raise CorpusError(f"{where}: empty excerpt")
        cases.append(Case(cid, meta["source"], meta["label"], meta["why"], body.rstrip("\n") + "\n",
                          _int_or_none(meta.get("exit_code"), where), _int_or_none(meta.get("signal"), where),
                          name))
    return cases


def load_corpus(folder: Path = CORPUS, labels: tuple[str, ...] | None = None) -> list[Case]:
    """Every case of folder/corpus_*.txt; ids must be unique and labels (when given) known."""
    cases: list[Case] = []
    for path in sorted(folder.glob("corpus_*.txt")):
        cases += parse_corpus_text(path.read_text(encoding="utf-8"), path.name)
    seen: Counter[str] = Counter(c.id for c in cases)
    dup = sorted(i for i, n in seen.items() if n > 1)
    if dup:
        raise CorpusError(f"duplicate case ids: {', '.join(dup)}")
    if labels is not None:
        bad = sorted({f"{c.id} ({c.label})" for c in cases if c.label not in labels})
        if bad:
            raise CorpusError(f"unknown labels in cases: {', '.join(bad)}")
    return cases


@dataclass
class Result:
    """Outcome of diagnosing a set of cases."""

    total: int
    correct: int
    confusion: Counter  # (expected, got) -> count
    misses: list[tuple[Case, str, str]]  # (case, got label, reason)
    healthy_flagged: list[str]  # ids of healthy cases given a failure label

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def evaluate(cases: list[Case], diagnose: Callable) -> Result:
    confusion: Counter = Counter()
    misses: list[tuple[Case, str, str]] = []
    flagged: list[str] = []
    for c in cases:
        d = diagnose(c.text, exit_code=c.exit_code, signal=c.signal)
        confusion[(c.label, d.label)] += 1
        if d.label != c.label:
            misses.append((c, d.label, d.reason))
            if c.label == "healthy":
                flagged.append(c.id)
    return Result(len(cases), len(cases) - len(misses), confusion, misses, flagged)


def confusion_table(res: Result, labels: tuple[str, ...]) -> str:
    """Rows: expected label; columns: diagnosed label (only labels that occur)."""
    used = [lb for lb in labels if any(k[0] == lb or k[1] == lb for k in res.confusion)]
    short = {lb: lb[:6] for lb in used}
    width = max(len(lb) for lb in used) if used else 8
    out = [" " * width + " | " + " ".join(f"{short[lb]:>6}" for lb in used)]
    for exp in used:
        row = [res.confusion.get((exp, got), 0) for got in used]
        if sum(row):
            out.append(f"{exp:<{width}} | " + " ".join(f"{n or '.':>6}" for n in row))
    return "\n".join(out)


def _load_diagnose(module: Path | None) -> tuple[Callable, tuple[str, ...]]:
    if module is None:
        from ulyssesd.remediation.diagnosis import LABELS, diagnose
        return diagnose, LABELS
    spec = importlib.util.spec_from_file_location("diagnosis_under_test", module)
    assert spec and spec.loader, f"cannot import {module}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.diagnose, mod.LABELS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("heldout", "train", "all"), default="heldout")
    ap.add_argument("--module", type=Path, help="a diagnosis.py file to evaluate instead of the installed one")
    ap.add_argument("--misses", action="store_true", help="list every miss with the diagnosis' reason")
    ap.add_argument("--file", action="append", default=[], metavar="NAME",
                    help="score only the cases of this corpus file (e.g. corpus_22.txt; repeatable)")
    ap.add_argument("--by-file", action="store_true",
                    help="also print correct/total of the train and held-out part of each chosen corpus file")
    args = ap.parse_args(argv)
    diagnose, labels = _load_diagnose(args.module)
    from ulyssesd.remediation.diagnosis import LABELS as CURRENT

    cases = load_corpus(labels=CURRENT)
    per: Counter[tuple[str, str]] = Counter((split_of(c.id), c.label) for c in cases)
    print(f"corpus: {len(cases)} cases in {CORPUS.relative_to(REPO)}")
    print(f"{'label':<22} {'train':>5} {'heldout':>7}")
    for lb in CURRENT:
        print(f"{lb:<22} {per[('train', lb)]:>5} {per[('heldout', lb)]:>7}")
    unknown = sorted(set(args.file) - {c.file for c in cases})
    if unknown:
        ap.error(f"no such corpus file in {CORPUS.relative_to(REPO)}: {', '.join(unknown)}")
    chosen = [c for c in cases if (args.split == "all" or split_of(c.id) == args.split)
              and (not args.file or c.file in args.file)]
    res = evaluate(chosen, diagnose)
    scope = f"{args.split} of {', '.join(args.file)}" if args.file else args.split
    print(f"\n{scope}: {res.correct}/{res.total} correct = {100 * res.accuracy:.1f} %; "
          f"healthy cases flagged: {len(res.healthy_flagged)}")
    print("\nconfusion (rows = expected, columns = diagnosed; labels cut to 6 characters)")
    print(confusion_table(res, tuple(dict.fromkeys((*CURRENT, *labels)))))
    if args.by_file:
        print(f"\n{'file':<16} {'train':>9} {'heldout':>9}")
        for name in sorted({c.file for c in chosen}):
            cells = []
            for part in ("train", "heldout"):
                sub = evaluate([c for c in chosen if c.file == name and split_of(c.id) == part], diagnose)
                cells.append(f"{sub.correct}/{sub.total}" if sub.total else "-")
            print(f"{name:<16} {cells[0]:>9} {cells[1]:>9}")
    if args.misses:
        print()
        for c, got, reason in res.misses:
            print(f"MISS {c.id}: expected {c.label}, got {got}: {reason[:220]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
