"""Hang detector: calibrated from step times, longer during checkpoints and startup, never below the floor."""

from __future__ import annotations

from rem_helpers import healthy

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors import HangDetector
from ulyssesd.remediation.records import EventRecord

CFG = DetectorsConfig(hang_timeout_floor_s=60, hang_step_multiplier=10, hang_checkpoint_timeout_s=1800,
                      hang_startup_timeout_s=900)


def _fed(step_time: float, n: int = 50) -> tuple[HangDetector, float]:
    det = HangDetector(CFG, start_time=0.0)
    t = 0.0
    for r in healthy(n, seed=1, time_noise=0.0):
        t += step_time
        r.step_time_s = r.step_time_max_s = step_time
        det.observe(r, t)
    return det, t


def test_fast_steps_use_the_floor():
    det, t = _fed(1.0)
    assert det.check(t + 59) is None
    f = det.check(t + 61)
    assert f is not None and f.symptom == "hang" and f.evidence["timeout_s"] == 60
    assert "no progress for 61 s after step 50" in f.message


def test_timeout_never_below_floor_even_for_tiny_steps():
    det, t = _fed(0.001)
    assert det.timeout()[0] == 60
    assert det.check(t + 30) is None


def test_slow_steps_calibrate_a_longer_timeout():
    det, t = _fed(20.0)
    assert det.timeout()[0] == 200  # 10 x the median step time
    assert det.check(t + 150) is None   # a floor-only detector would have fired at 60 s
    assert det.check(t + 201) is not None


def test_checkpoint_save_extends_and_saved_restores():
    det, t = _fed(1.0)
    det.observe(EventRecord("checkpoint_saving", step=50), t)
    assert det.check(t + 600) is None
    assert det.check(t + 1801).evidence["phase"] == "checkpoint save in progress, none measured yet"
    det2, t2 = _fed(1.0)
    det2.observe(EventRecord("checkpoint_saving", step=50), t2)
    det2.observe(EventRecord("checkpoint_saved", step=50), t2 + 30)
    assert det2.check(t2 + 30 + 61) is not None  # back to the training timeout


def test_startup_before_first_step_gets_the_startup_timeout():
    det = HangDetector(CFG, start_time=0.0)
    assert det.check(600) is None
    f = det.check(901)
    assert f is not None and f.evidence["phase"] == "startup before the first step" and "since start" in f.message
    # A `started` event (a restart) resets to the startup phase.
    det2, t = _fed(1.0)
    det2.observe(EventRecord("started", step=0, attempt=2), t)
    assert det2.check(t + 600) is None


def test_fires_once_per_stall_and_rearms_on_progress():
    det, t = _fed(1.0)
    assert det.check(t + 61) is not None
    assert det.check(t + 120) is None
    r = healthy(1, seed=2, start=51)[0]
    det.observe(r, t + 130)
    assert det.check(t + 130 + 61) is not None
