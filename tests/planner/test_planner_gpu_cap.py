"""ULYSSESD_GPU_MEMORY_CAP_GIB: the benchmark knob that makes an H200 stand in for an 80 GB card. The job caps its
allocator (training/train.py); the daemon's planner on that host must plan for the same cap, or its memory fixes
would be chosen for 139 GiB and fail at 79."""

from __future__ import annotations

from ulyssesd.daemon.operator import ctl_plan
from ulyssesd.training.planner.inputs import GPU_MEMORY_CAP_ENV, gpu_memory_cap_gib


def test_cap_is_read_only_when_a_positive_number():
    assert gpu_memory_cap_gib({}) is None
    assert gpu_memory_cap_gib({GPU_MEMORY_CAP_ENV: "79.1"}) == 79.1
    assert gpu_memory_cap_gib({GPU_MEMORY_CAP_ENV: "-3"}) is None
    assert gpu_memory_cap_gib({GPU_MEMORY_CAP_ENV: "lots"}) is None


def test_the_hosts_gpu_figure_is_capped(monkeypatch):
    monkeypatch.delenv(GPU_MEMORY_CAP_ENV, raising=False)
    assert ctl_plan._capped(139.8) == 139.8
    monkeypatch.setenv(GPU_MEMORY_CAP_ENV, "79.1")
    assert ctl_plan._capped(139.8) == 79.1
    assert ctl_plan._capped(40.0) == 40.0  # a cap above the card changes nothing
