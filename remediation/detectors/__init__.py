"""Detectors over the telemetry stream: one small class per symptom (see docs/REMEDIATION.md).

Each has `observe(record, now) -> list[Finding]` and `reset()` (called after every (re)start: warm-up again);
the hang detector also has `check(now) -> Finding | None`.
"""

from __future__ import annotations

from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.base import SYMPTOMS, Detector, Finding
from ulyssesd.remediation.detectors.hang import HangDetector
from ulyssesd.remediation.detectors.loss_oscillation import LossOscillationDetector
from ulyssesd.remediation.detectors.loss_spike import LossSpikeDetector
from ulyssesd.remediation.detectors.memory_spike import MemorySpikeDetector
from ulyssesd.remediation.detectors.nan_loss import NanLossDetector
from ulyssesd.remediation.detectors.overflow_storm import OverflowStormDetector
from ulyssesd.remediation.detectors.slow_step import SlowStepDetector
from ulyssesd.remediation.detectors.straggler import StragglerDetector
from ulyssesd.remediation.detectors.throughput_drift import ThroughputDriftDetector
from ulyssesd.remediation.detectors.throughput_drop import ThroughputDropDetector


def build_detectors(cfg: DetectorsConfig, min_loss_scale: float | None = None) -> list[Detector]:
    """All step-stream detectors (hang is separate: it is driven by the clock)."""
    spike = LossSpikeDetector(cfg)
    return [NanLossDetector(cfg, min_loss_scale=min_loss_scale), spike,
            LossOscillationDetector(cfg, modes_of=spike), MemorySpikeDetector(cfg),
            OverflowStormDetector(cfg, min_loss_scale=min_loss_scale), SlowStepDetector(cfg), StragglerDetector(cfg),
            ThroughputDropDetector(cfg), ThroughputDriftDetector(cfg)]


__all__ = ["SYMPTOMS", "Detector", "Finding", "HangDetector", "LossOscillationDetector", "LossSpikeDetector",
           "MemorySpikeDetector", "NanLossDetector", "OverflowStormDetector", "SlowStepDetector",
           "StragglerDetector", "ThroughputDriftDetector", "ThroughputDropDetector", "build_detectors"]
