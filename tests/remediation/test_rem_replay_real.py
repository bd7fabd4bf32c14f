"""Replay of real published loss curves (tests/fixtures/replay/real/, provenance in each file and README.md):
every incident curve is acted on in time, every healthy curve raises nothing, with the default thresholds.

"Acted on": a decision of the loss/nan ladders (not evidence collection). In time: a NaN/inf curve at its
onset record, an overflow storm within 10 steps, a divergence or a zero loss within 30 training steps.
Healthy: no finding and no decision at all. Self-recovering spike (kind healthy_spike: a real spike that came back
without any intervention): no decision at all -- no rollback, no restart, and no hot change either, because the rule
for healthy curves allows none; a finding is allowed (the spike is real and is worth recording). Hang findings are not judged: the rows are excerpts (rows between
them were not published), so the wall time between two rows is unknown.

Print the table (train and held-out part):
    DS_ACCELERATOR=cpu .venv/bin/python tests/remediation/test_rem_replay_real.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision
from ulyssesd.remediation.playbook import RESTARTING
from ulyssesd.remediation.records import parse_record
from ulyssesd.remediation.replay import replay

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "replay" / "real"
CURVES = sorted(REAL.glob("*.json"))
# How late an action may come, in training steps after the onset, per incident kind.
DEADLINE = {"nan": 0, "overflow_storm": 10, "loss_divergence": 30, "loss_zero": 30}
LOSS_LADDERS = ("loss", "nan")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def run_curve(curve: dict[str, Any]) -> tuple[list[Finding], list[Decision]]:
    recs = [parse_record({k: v for k, v in row.items() if k != "loss_carried"}) for row in curve["records"]]
    items = [it.item for it in replay(recs, job_values=curve["job"] or None)
             if it.item.symptom != "hang"]
    return ([i for i in items if isinstance(i, Finding)], [i for i in items if isinstance(i, Decision)])


def judge(curve: dict[str, Any]) -> tuple[bool, str]:
    """(passed, what happened) for one curve."""
    findings, decisions = run_curve(curve)
    if curve["kind"] == "healthy":
        if findings or decisions:
            what = "; ".join(f"{f.symptom}@{f.step}" for f in findings)
            return False, f"raised {what or ''} {[(d.action_kind, d.step) for d in decisions]}"
        return True, "quiet"
    if curve["kind"] == "healthy_spike":
        seen = ", ".join(f"{f.symptom}@{f.step}" for f in findings) or "nothing"
        if decisions:
            return False, f"acted on a self-recovering spike: {[(d.action_kind, d.apply, d.step) for d in decisions]} (found {seen})"
        return True, f"no action (found {seen})"
    onset, limit = curve["onset_step"], DEADLINE[curve["incident"]]
    acted = [d for d in decisions if d.ladder in LOSS_LADDERS and d.step is not None and d.step >= onset]
    if not acted:
        return False, f"no action (findings: {[(f.symptom, f.step) for f in findings]})"
    first = acted[0]
    late = first.step - onset
    ok = late <= limit
    return ok, f"{first.action_kind} ({first.apply}) at step {first.step}, {late} steps after onset (limit {limit})"


# Curves the engine gets wrong today, kept in CI as strict xfails so that a fix shows up (and must remove the entry).
# Not tuned away: the curve is in the held-out part, and its first rows (2.77 -> 7.34 -> 8.72 in 20 steps, still
# ~2.5x above the band 40 steps later) look like the real divergences the loss ladder must act on within 30 steps.
KNOWN_FAILURES = {
    "bigscience-tr1-13b-spike-29050": "the loss ladder lowers the clip (hot) 10 steps into a real spike that recovered "
                                      "by itself over ~500 steps; no rollback, no restart",
}


def _curve_param(p: Path):
    reason = KNOWN_FAILURES.get(p.stem)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(p, id=p.stem, marks=marks)


@pytest.mark.parametrize("path", [_curve_param(p) for p in CURVES])
def test_real_curve(path):
    ok, what = judge(load(path))
    assert ok, what


@pytest.mark.parametrize("path", [p for p in CURVES if load(p)["kind"] == "healthy_spike"], ids=lambda p: p.stem)
def test_self_recovering_spike_is_never_rolled_back_or_restarted(path):
    """The weaker floor under test_real_curve: even where a hot change is taken (a known failure), the engine must
    not stop, restart or roll back a run whose real spike came back by itself."""
    _, decisions = run_curve(load(path))
    drastic = [(d.action_kind, d.apply, d.step) for d in decisions
               if d.apply in (*RESTARTING, "stop") or d.rollback_to_step is not None]
    assert not drastic, drastic


def test_corpus_shape_and_split():
    curves = [load(p) for p in CURVES]
    incidents = [c for c in curves if c["kind"] == "incident"]
    healthy = [c for c in curves if c["kind"] == "healthy"]
    spikes = [c for c in curves if c["kind"] == "healthy_spike"]
    assert len(incidents) >= 12 and len(healthy) >= 6 and len(spikes) >= 2
    assert all(c["incident"] is None and c["onset_step"] is not None for c in spikes)
    held = [c for c in curves if c["split"] == "heldout"]
    assert 3 * len(held) >= len(curves)
    for c in curves:   # provenance on every curve, every row a published one
        assert c["source"]["url"] and c["source"]["what"] and c["records"]
        assert (c["onset_step"] is None) == (c["kind"] == "healthy")


def report() -> int:
    rows = []
    for p in CURVES:
        c = load(p)
        ok, what = judge(c)
        rows.append((c["split"], c["kind"], c["id"], ok, what))
    for split in ("train", "heldout"):
        part = [r for r in rows if r[0] == split]
        print(f"\n{split}: {sum(r[3] for r in part)}/{len(part)} pass")
        for _, kind, cid, ok, what in part:
            print(f"  {'PASS' if ok else 'FAIL'}  {kind:13s} {cid:48s} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(report())
