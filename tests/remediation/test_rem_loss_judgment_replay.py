"""Replay of a real recorded tiny run with per-source loss (tests/fixtures/replay/tiny_cpu_sources_lr30.jsonl):
configs/tiny-cpu.toml without its [detectors] block under the real daemon, 400 steps on the shared 2-core dev
box, the built-in synthetic data (copy, arithmetic and motif at different levels, each falling), the LR raised
30x from step 300 (fault `lr_spike`). Recorded by tests/remediation/test_rem_loss_judgment_real.py.

With the default thresholds: no loss finding in the healthy 299 steps, the blow-up found within 20 steps.
"""

from __future__ import annotations

from pathlib import Path

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.records import StepRecord, parse_line

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "replay" / "tiny_cpu_sources_lr30.jsonl"
ONSET = 300


def test_recorded_tiny_run_is_multi_modal_by_family():
    recs = [parse_line(x) for x in FIXTURE.read_text().splitlines()]
    steps = [r for r in recs if isinstance(r, StepRecord) and 200 <= r.step < ONSET]
    by: dict[str, list[float]] = {}
    for r in steps:
        for k, v in (r.loss_by_source or {}).items():
            by.setdefault(k, []).append(v)
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    assert set(med) == {"copy", "arithmetic", "motif"} and med["copy"] > 2 * med["motif"], med


def test_replay_healthy_part_quiet_and_lr_blowup_found_within_20_steps():
    eng = RemediationEngine(DetectorsConfig())
    loss_findings: list[Finding] = []
    for line in FIXTURE.read_text().splitlines():
        rec = parse_line(line)
        for item in eng.observe(rec, rec.time or 0.0):
            if isinstance(item, Finding) and item.symptom in ("loss_spike", "loss_oscillation", "nan_loss"):
                loss_findings.append(item)
    assert loss_findings, "the 30x LR blow-up was not found"
    first = loss_findings[0]
    assert ONSET <= (first.step or 0) <= ONSET + 20, [(f.step, f.message) for f in loss_findings]
    assert first.evidence["since_step"] >= ONSET
    # The early warning (grad norm out of its own per-source distribution) came first, and never before.
    assert eng.grad_watch is not None
    warned = [w["step"] for w in eng.grad_watch.warnings]
    assert warned and ONSET <= warned[0] < (first.step or 0), (warned, first.step)


def test_ulyssesctl_tune_fits_the_recorded_run(tmp_path, capsys):
    import json
    import shutil

    from ulyssesd.daemon.operator.ctl import main

    tele = tmp_path / "telemetry.jsonl"
    shutil.copy(FIXTURE, tele)
    assert main(["tune", "--telemetry", str(tele), "--write", "--json"]) in (0, None)
    fit = json.loads(capsys.readouterr().out)
    assert fit["steps"] == 400 and fit["false_alarm_rate_per_step"] == 1e-5
    assert 2.0 <= fit["values"]["slow_step_ratio"] <= 10.0
    assert fit["values"]["hang_startup_timeout_s"] == 120.0   # 5 x its 4.4 s start-up, at the floor
    bands = {b["source"] for b in fit["evidence"]["loss_bands"]["per_source"]}
    assert bands == {"motif", "copy", "arithmetic"}
    assert json.loads((tmp_path / "calibration.json").read_text())["values"] == fit["values"]
