"""Detector thresholds and remediation policy: the `[detectors]` and `[remediation]` sections of a run spec.

Owned by the remediation library (pure; no I/O). The remediation issue extends these models; every field
keeps a one-line doc and a sensible default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DetectorsConfig(_Section):
    warmup_steps: int = Field(20, ge=0, description="Steps after each (re)start during which statistical detectors stay quiet.")
    window: int = Field(100, ge=5, description="Rolling window (steps) of the robust baselines.")
    loss_spike_mad: float = Field(8.0, gt=0, description="Loss spike = loss above median + k·MAD of the window.")
    memory_spike_ratio: float = Field(1.5, gt=1, description="Memory spike = step max-allocated above ratio × baseline.")
    slow_step_ratio: float = Field(2.0, gt=1, description="Slow step = step time above ratio × rolling median (seed: 2×).")
    hang_timeout_floor_s: float = Field(60.0, gt=0, description="The hang timeout is never shorter than this.")


class RemediationConfig(_Section):
    mode: Literal["act", "observe"] = Field("act", description="observe = record what would be done, do nothing.")
    max_restarts_per_hour: int = Field(6, ge=0, description="Restart budget; beyond it the run ends FAILED.")
    no_progress_restarts: int = Field(3, ge=1, description="Restarts without checkpoint advance before FAILED.")
