"""Domain enums shared by the store, the daemon and the CLI.

Deliberately free of SQLAlchemy imports so `ulyssesctl` and the supervisor can import them cheaply.
Every enum is a stdlib `str` enum whose *value* is what lands in SQLite (readable text).
"""

from __future__ import annotations

# The symptom/severity vocabulary is remediation's (detectors and playbook speak it); the store imports it
# for its columns, and the daemon and ulyssesctl keep importing all domain enums from here.
from ulyssesd.remediation.vocabulary import ParsedStrEnum as _StrEnum
from ulyssesd.remediation.vocabulary import Severity, Symptom


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
