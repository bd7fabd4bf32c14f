"""Domain enums shared by the store, the daemon and the CLI.

Deliberately free of SQLAlchemy imports so `ulyssesctl` and the supervisor can import them cheaply.
Every enum is a stdlib `str` enum whose *value* is what lands in SQLite (readable text).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

_T = TypeVar("_T", bound="_StrEnum")


class _StrEnum(str, Enum):
    """str-valued enum whose str() is the value (stable across Python versions)."""

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


class RunState(_StrEnum):
    """Lifecycle state of a supervised run (the supervisor's state machine)."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    REMEDIATING = "REMEDIATING"
    RESTARTING = "RESTARTING"
    BACKOFF = "BACKOFF"
    PAUSED = "PAUSED"
    STOPPING = "STOPPING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


#: States after which a run never moves again.
TERMINAL_RUN_STATES: frozenset[RunState] = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.STOPPED})


class IncidentStatus(_StrEnum):
    """open -> remediating -> resolved | escalated | failed."""

    open = "open"
    remediating = "remediating"
    resolved = "resolved"
    escalated = "escalated"
    failed = "failed"


TERMINAL_INCIDENT_STATUSES: frozenset[IncidentStatus] = frozenset(
    {IncidentStatus.resolved, IncidentStatus.escalated, IncidentStatus.failed}
)


class Symptom(_StrEnum):
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


class Severity(_StrEnum):
    info = "info"
    warning = "warning"
    critical = "critical"


class ActionKind(_StrEnum):
    """What a remediation did."""

    set_config = "set_config"
    hot_control = "hot_control"
    restart = "restart"
    rollback_skip = "rollback_skip"
    revert = "revert"
    stop = "stop"
    alert = "alert"
    prune = "prune"
    observe_only_noop = "observe_only_noop"


class ApplyMode(_StrEnum):
    """How an action's config change took effect."""

    hot = "hot"
    restart = "restart"
    none = "none"


class ActionOutcome(_StrEnum):
    """Verification result of an action (None in the DB while not yet verified)."""

    pending = "pending"
    effective = "effective"
    ineffective = "ineffective"
    failed = "failed"


__all__ = [
    "ActionKind",
    "ActionOutcome",
    "ApplyMode",
    "IncidentStatus",
    "RunState",
    "Severity",
    "Symptom",
    "TERMINAL_INCIDENT_STATUSES",
    "TERMINAL_RUN_STATES",
]
