"""The vocabulary of trouble: what a detector (or the daemon) saw, and how bad it is.

Owned here, where the detectors, the playbook and the engine speak it; the store imports it and keeps each
member's *value* as readable text in SQLite, so a value never changes once released (the migrations
tests compare the database's values with these).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

_T = TypeVar("_T", bound="ParsedStrEnum")


class ParsedStrEnum(str, Enum):
    """str-valued enum whose str() is the value (stable across Python versions), parsed with a clear error."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls: type[_T], value: str | _T) -> _T:
        """Return the member for ``value`` or raise ValueError naming the allowed values."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown {cls.__name__} {value!r}; allowed: {allowed}") from None


class Symptom(ParsedStrEnum):
    """What a detector saw."""

    memory_spike = "memory_spike"
    cuda_oom = "cuda_oom"
    loss_spike = "loss_spike"
    loss_oscillation = "loss_oscillation"
    nan_loss = "nan_loss"
    overflow_storm = "overflow_storm"
    slow_step = "slow_step"
    straggler = "straggler"
    throughput_drop = "throughput_drop"
    hang = "hang"
    crash = "crash"
    crash_loop = "crash_loop"
    no_progress = "no_progress"
    checkpoint_corrupt = "checkpoint_corrupt"
    disk_full = "disk_full"
    launch_failure = "launch_failure"
    #: The store's database was damaged, emptied or deleted; the incident says what was recovered and how.
    store_damaged = "store_damaged"
    #: NVML found a GPU failing (Xid, ECC, remap, temperature, lost); the incident names it (daemon/host/gpu_health.py).
    gpu_failure = "gpu_failure"
    #: A bug in the daemon's own loop (one tick step raised); the incident names the step and holds the traceback.
    internal_error = "internal_error"
    #: An inner launcher (torchrun --max-restarts, NVRx ft_launcher) restarted the workers inside an attempt;
    #: not a daemon restart (docs/COEXISTENCE.md).
    inner_restart = "inner_restart"


class Severity(ParsedStrEnum):
    """How bad a finding is: `critical` lets the engine act before the grace window ends."""

    info = "info"
    warning = "warning"
    critical = "critical"


__all__ = ["ParsedStrEnum", "Severity", "Symptom"]
