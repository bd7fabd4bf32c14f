"""SQLAlchemy 2.0 models of the incident store (the schema at Alembic head).

Only the repository (`repository/`) queries these; everything else gets plain records.
Enums are stored as their readable `.value` text with a CHECK constraint, so a garbage state cannot land
in the database even through raw SQL. Adding an enum member therefore needs a migration that rewrites the
CHECK (batch mode) — `tests/store/test_store_migrations.py` fails if the model and the DB disagree.
Timestamps are stored as naive UTC and returned timezone-aware (UTC).
"""

from __future__ import annotations

import enum
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy import Enum as SAEnum
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ulyssesd.daemon.clock import utc_now

from .enums import ActionKind, ActionOutcome, ApplyMode, IncidentStatus, RunState, Severity, Symptom

# Deterministic constraint names: SQLite batch migrations recreate tables and must be able to name
# (and therefore drop/alter) every constraint.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return utc_now()


def row_now(context: Any) -> datetime:
    """A column default: the stamp of the store's clock (`StoreBase.clock`, carried as the connection's
    `ulyssesd_clock` execution option), else the system clock's (a session opened without the store)."""
    clock = context.execution_options.get("ulyssesd_clock") if context is not None else None
    return utc_now(clock) if clock is not None else utc_now()


class UTCDateTime(TypeDecorator[datetime]):
    """Stores naive UTC, returns aware UTC; rejects naive inputs (ambiguous local time)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware datetime (UTC)")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


def text_enum(enum_cls: type[enum.Enum], column: str) -> SAEnum:
    """An enum stored as its value text (not the member name), validated in Python and by a CHECK.

    `column` names the CHECK constraint (-> ck_<table>_<column>), so two columns of one enum type in
    a table get distinct constraint names.
    """
    return SAEnum(
        enum_cls,
        name=column,
        native_enum=False,
        create_constraint=True,
        validate_strings=True,
        length=32,
        values_callable=lambda cls: [m.value for m in cls],
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One supervised training run (spans many attempts and days)."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_dir: Mapped[str | None] = mapped_column(Text)
    spec_path: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    state: Mapped[RunState] = mapped_column(text_enum(RunState, "state"))
    state_reason: Mapped[str | None] = mapped_column(Text)
    config_version: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Attempt(Base):
    """One launch of the job: command, process identity (for re-adoption), exit and diagnosis."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    command: Mapped[list[str]] = mapped_column(JSON, default=list)
    config_version: Mapped[int | None] = mapped_column(Integer)
    host: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    # 0002: process group and the pid's start time (psutil create_time) so a re-adopting daemon can tell
    # "our job" from a recycled pid.
    pgid: Mapped[int | None] = mapped_column(Integer)
    proc_start_time: Mapped[float | None] = mapped_column(Float)
    resumed_from: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    returncode: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[int | None] = mapped_column(Integer)
    diagnosis: Mapped[str | None] = mapped_column(String(64))
    diagnosis_evidence: Mapped[list[Any] | dict[str, Any] | None] = mapped_column(JSON)


#: The rows the incidents' unique key covers (a partial index): every symptom but the guard's internal errors and
#: inner launchers' restarts (several can share a step; each is keyed by its ordinal, daemon/coexist/).
INCIDENT_KEY_WHERE = "symptom NOT IN ('internal_error', 'inner_restart')"


class Incident(Base):
    """Something a detector saw; (run_id, attempt, symptom, step) is unique so re-adoption cannot double it,
    except for internal errors: the step guard deduplicates those by their signature (migration 0005)."""

    __tablename__ = "incidents"
    __table_args__ = (Index("uq_incidents_run_id_attempt_symptom_step", "run_id", "attempt", "symptom", "step",
                            unique=True, sqlite_where=text(INCIDENT_KEY_WHERE)),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    symptom: Mapped[Symptom] = mapped_column(text_enum(Symptom, "symptom"), index=True)
    severity: Mapped[Severity] = mapped_column(text_enum(Severity, "severity"))
    summary: Mapped[str] = mapped_column(Text, default="")
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[IncidentStatus] = mapped_column(text_enum(IncidentStatus, "status"), index=True)
    status_reason: Mapped[str | None] = mapped_column(Text)
    detected_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now, index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    acknowledged_by: Mapped[str | None] = mapped_column(String(128))
    acknowledged_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Action(Base):
    """A remediation step (or what it would have been, in observe-only mode) and its verification."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    kind: Mapped[ActionKind] = mapped_column(text_enum(ActionKind, "kind"))
    parameters: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # {dotted.key: [before, after]} — the config diff this action made.
    config_diff: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    mode: Mapped[ApplyMode] = mapped_column(text_enum(ApplyMode, "mode"))
    from_config_version: Mapped[int | None] = mapped_column(Integer)
    to_config_version: Mapped[int | None] = mapped_column(Integer)
    observe_only: Mapped[bool] = mapped_column(Boolean, default=False)
    applied_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    outcome: Mapped[ActionOutcome] = mapped_column(text_enum(ActionOutcome, "outcome"))
    outcome_detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ConfigVersion(Base):
    """An effective job config of a run; v1 is the spec's, later ones come from actions."""

    __tablename__ = "config_versions"
    __table_args__ = (UniqueConstraint("run_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    parent_version: Mapped[int | None] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)


class StateTransition(Base):
    """Every RunState change, written in the same transaction as the change itself."""

    __tablename__ = "state_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    from_state: Mapped[RunState | None] = mapped_column(text_enum(RunState, "from_state"))
    to_state: Mapped[RunState] = mapped_column(text_enum(RunState, "to_state"))
    reason: Mapped[str] = mapped_column(Text, default="")
    attempt: Mapped[int | None] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)


class Checkpoint(Base):
    """A checkpoint tag the daemon has seen (0002). known_good = followed by an anomaly-free window."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "tag"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    tag: Mapped[str] = mapped_column(String(64))
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    valid: Mapped[bool] = mapped_column(Boolean, default=True)
    known_good: Mapped[bool] = mapped_column(Boolean, default=False)
    invalid_reason: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int | None] = mapped_column(Integer)
    config_version: Mapped[int | None] = mapped_column(Integer)
    saved_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
    pruned_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class TelemetryCursor(Base):
    """How far the daemon has processed a run's telemetry.jsonl (0002), for exact re-adoption."""

    __tablename__ = "telemetry_cursors"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    inode: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=row_now)
