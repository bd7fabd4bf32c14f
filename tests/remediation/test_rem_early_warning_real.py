"""Early warning and calibration on the real curves (issue 39 item 4; figures: bench/early_warning_real.py and
bench/RESULTS.md): no early warning on any healthy real curve or self-recovering spike, every real incident
found with calibration on no later than with the fixed thresholds, fewer findings on the recorded healthy
run once fitted, and the warning ahead of the detector on the real blow-up whose grad norms arm it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import early_warning_real as ew  # noqa: E402


def test_real_curves_warnings_and_calibration():
    rows = {c["id"]: (c, ew.run(c, calibrate=False), ew.run(c, calibrate=True)) for c in ew.curves()}
    assert len(rows) >= 30
    for cid, (c, fixed, fitted) in rows.items():
        if c["kind"] in ("healthy", "healthy_spike"):
            assert fitted["warnings"] == [], (cid, fitted["warnings"])
        if c["kind"] == "incident":
            assert fitted["found_at"] is not None, cid
            assert fixed["found_at"] is not None and fitted["delay"] <= fixed["delay"], (cid, fixed, fitted)
    _, fixed, fitted = rows["recorded-tiny-cpu-3k"]
    assert fitted["fitted"] and len(fitted["findings"]) < len(fixed["findings"])
    assert not any(s in ew.INCIDENT_SYMPTOMS for s, _ in fitted["findings"])
    for cid in ("recorded-tiny-cpu-lr30", "recorded-tiny-cpu-lr30-logits"):
        _, _, lr30 = rows[cid]
        assert lr30["lead"] is not None and lr30["lead"] > 0 and lr30["warned_at"] >= 300, (cid, lr30)
    # The job's logit_max warns too on the run that reports it (before the loss finding).
    _, _, logits = rows["recorded-tiny-cpu-lr30-logits"]
    assert "logit_max" in logits["signals"], logits
    first_logit = min(w["step"] for w in logits["warnings"] if w["signal"] == "logit_max")
    assert 300 <= first_logit < logits["found_at"], logits
