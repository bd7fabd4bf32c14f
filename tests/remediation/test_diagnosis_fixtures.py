"""Every fixture log under tests/fixtures/logs/{label}/ is classified as {label}, with its deciding lines as evidence.

Each `NN-description.log` is a plain log (feed it to `ulyssesctl diagnose` as is) with a sidecar
`NN-description.json`: `source` (the public issue/format it is built from), optional `note`, `exit_code` and
`signal` (passed to diagnose; null = unknown), `evidence` (each must be a substring of some evidence line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulyssesd.remediation.diagnosis import LABELS, diagnose

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def load_fixture(path: Path) -> tuple[str, dict]:
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    return path.read_text(encoding="utf-8"), meta


ALL = sorted(FIXTURES.glob("*/*.log"))


def test_fixture_set_covers_every_label_three_times():
    per_label = {lb: len(list((FIXTURES / lb).glob("*.log"))) for lb in LABELS}
    assert {lb: n for lb, n in per_label.items() if n < 3} == {}
    assert {p.parent.name for p in ALL} <= set(LABELS), "fixture folder named after an unknown label"
    missing = [p.name for p in ALL if not p.with_suffix(".json").exists()]
    assert missing == [], f"fixtures without a .json sidecar: {missing}"


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fixture_diagnosis(path: Path):
    text, meta = load_fixture(path)
    assert meta.get("source"), f"{path.with_suffix('.json')} lacks a 'source'"
    d = diagnose(text, exit_code=meta["exit_code"], signal=meta["signal"])
    expected = path.parent.name
    assert d.label == expected, f"{path.name}: got {d.label} ({d.reason}) evidence={d.evidence}"
    if expected != "healthy" and meta["exit_code"] not in (-9, 137, -11, 139):
        assert meta["evidence"], f"{path.name}: a non-healthy fixture must name its deciding line(s)"
    for needle in meta["evidence"]:
        assert any(needle in line for line in d.evidence), f"{path.name}: {needle!r} not in evidence {d.evidence}"
    if expected != "healthy":
        assert d.reason and d.reason.endswith(".")
        assert expected not in d.secondary
    for line in d.evidence:
        assert "\x1b" not in line and "\r" not in line
