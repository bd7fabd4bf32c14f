"""Plain frozen records the repository returns (never live ORM objects), each with `to_dict()` for JSON."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, TypeVar

from .enums import ActionKind, ActionOutcome, ApplyMode, IncidentStatus, RunState, Severity, Symptom

R = TypeVar("R", bound="Record")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        # Same spelling as the telemetry contract: strict JSON has no NaN/Infinity.
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Record:
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: enums as their text, datetimes as ISO-8601 (UTC)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_row(cls: type[R], row: Any, **extra: Any) -> R:
        # Fields with defaults (e.g. IncidentRecord.actions) are not columns; they come via `extra`.
        names = {f.name for f in fields(cls) if f.default is dataclasses.MISSING} - set(extra)
        return cls(**{n: getattr(row, n) for n in names}, **extra)

    def replace(self: R, **changes: Any) -> R:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RunRecord(Record):
    id: str
    run_dir: str | None
    spec_path: str | None
    spec: dict[str, Any]
    state: RunState
    state_reason: str | None
    config_version: int | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True)
class StateTransitionRecord(Record):
    id: int
    run_id: str
    from_state: RunState | None
    to_state: RunState
    reason: str
    attempt: int | None
    at: datetime


@dataclass(frozen=True)
class AttemptRecord(Record):
    id: int
    run_id: str
    number: int
    command: list[str]
    config_version: int | None
    host: str | None
    pid: int | None
    pgid: int | None
    proc_start_time: float | None
    resumed_from: str | None
    started_at: datetime
    ended_at: datetime | None
    returncode: int | None
    signal: int | None
    diagnosis: str | None
    diagnosis_evidence: Any


@dataclass(frozen=True)
class ActionRecord(Record):
    id: int
    run_id: str
    incident_id: int | None
    kind: ActionKind
    parameters: dict[str, Any]
    config_diff: dict[str, Any]
    mode: ApplyMode
    from_config_version: int | None
    to_config_version: int | None
    observe_only: bool
    applied_at: datetime
    outcome: ActionOutcome
    outcome_detail: dict[str, Any] | None
    verified_at: datetime | None


@dataclass(frozen=True)
class IncidentRecord(Record):
    id: int
    run_id: str
    attempt: int
    step: int
    symptom: Symptom
    severity: Severity
    summary: str
    evidence: dict[str, Any]
    status: IncidentStatus
    status_reason: str | None
    detected_at: datetime
    updated_at: datetime
    closed_at: datetime | None
    acknowledged_by: str | None
    acknowledged_at: datetime | None
    #: Filled by `Store.get_incident`; empty in listings.
    actions: tuple[ActionRecord, ...] = field(default=())


@dataclass(frozen=True)
class ConfigVersionRecord(Record):
    id: int
    run_id: str
    version: int
    parent_version: int | None
    config: dict[str, Any]
    reason: str
    created_at: datetime


@dataclass(frozen=True)
class CheckpointRecord(Record):
    id: int
    run_id: str
    tag: str
    step: int
    loss: float | None
    valid: bool
    known_good: bool
    invalid_reason: str | None
    attempt: int | None
    config_version: int | None
    saved_at: datetime
    updated_at: datetime
    pruned_at: datetime | None


@dataclass(frozen=True)
class TelemetryCursorRecord(Record):
    run_id: str
    path: str
    inode: int
    offset: int
    last_step: int | None
    updated_at: datetime


@dataclass(frozen=True)
class MaintenanceResult(Record):
    """Outcome of `Store.maintenance()` (integrity check + WAL checkpoint)."""

    ok: bool
    integrity: list[str]
    #: wal_checkpoint(TRUNCATE) result: busy=1 means a reader kept it from finishing (harmless, retried next run).
    wal_busy: int
    wal_frames: int
    wal_checkpointed: int
    db_bytes: int
    wal_bytes_before: int
    wal_bytes_after: int
    seconds: float


@dataclass(frozen=True)
class RelaunchRecord(Record):
    """One attempt after a run's first, and what relaunched it (`Store.list_relaunches`)."""

    attempt: int
    started_at: datetime
    #: True when an operator command (pause + resume, restart) led to it: not a failure, not in the restart
    #: budget; False for the daemon's own relaunches (crash, hang, remediation, requeue): a restart.
    by_operator: bool


@dataclass(frozen=True)
class RelaunchCounts(Record):
    """A run's relaunches (attempts after the first), by cause (`Store.relaunch_counts`)."""

    #: the daemon's own relaunches: a crash, a hang, a remediation, a requeue.
    restarts: int
    #: relaunches an operator command led to (pause + resume, restart).
    operator_relaunches: int
