"""The repository: the ONLY module that issues queries against the store.

Every write is one short transaction (BEGIN IMMEDIATE … COMMIT) so the daemon never holds the write lock
across I/O, and every method returns frozen records (see records.py), never live ORM objects.
Enum-typed arguments accept the enum or its text; unknown text raises `InvalidValueError` naming the
allowed values before anything reaches SQLite (the table CHECKs are the second line of defence).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, func, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from .engine import BUSY_TIMEOUT_MS
from .enums import (
    TERMINAL_INCIDENT_STATUSES,
    TERMINAL_RUN_STATES,
    ActionKind,
    ActionOutcome,
    ApplyMode,
    IncidentStatus,
    RunState,
    Severity,
    Symptom,
)
from .errors import InvalidValueError, NotFoundError, ReadOnlyStoreError
from .models import (
    Action,
    Attempt,
    Checkpoint,
    ConfigVersion,
    Incident,
    Run,
    StateTransition,
    TelemetryCursor,
    utcnow,
)
from .records import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    ConfigVersionRecord,
    IncidentRecord,
    MaintenanceResult,
    RunRecord,
    StateTransitionRecord,
    TelemetryCursorRecord,
)

Timestamp = datetime | float | int | None
CHECKPOINT_BUSY_MS = 1000
_E = TypeVar("_E", bound=enum.Enum)

# Incident status moves the store accepts; everything else is a bug in the caller.
_INCIDENT_MOVES: dict[IncidentStatus, frozenset[IncidentStatus]] = {
    IncidentStatus.open: frozenset(IncidentStatus) - {IncidentStatus.open},
    IncidentStatus.remediating: frozenset(IncidentStatus) - {IncidentStatus.remediating},
    # An escalated incident is waiting for a human; they may still close it either way.
    IncidentStatus.escalated: frozenset({IncidentStatus.resolved, IncidentStatus.failed}),
    IncidentStatus.resolved: frozenset(),
    IncidentStatus.failed: frozenset(),
}

_ATTEMPT_FIELDS = frozenset(
    {"pid", "pgid", "proc_start_time", "host", "ended_at", "returncode", "signal", "diagnosis",
     "diagnosis_evidence", "resumed_from", "config_version", "command"}
)


def _parse(enum_cls: type[_E], value: _E | str) -> _E:
    try:
        return enum_cls.parse(value)  # type: ignore[attr-defined,no-any-return]
    except ValueError as e:
        raise InvalidValueError(str(e)) from None


def _ts(value: Timestamp) -> datetime:
    """None → now; epoch seconds (telemetry's `time`) or aware datetime → aware UTC datetime."""
    if value is None:
        return utcnow()
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidValueError(f"naive datetime {value!r}: pass a timezone-aware datetime (UTC)")
        return value.astimezone(timezone.utc)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    raise InvalidValueError(f"timestamp must be a datetime or epoch seconds, got {type(value).__name__}")


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def flat_diff(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> dict[str, list[Any]]:
    """{dotted.key: [before, after]} for every leaf that differs (missing = None)."""
    out: dict[str, list[Any]] = {}
    for key in sorted(set(before) | set(after), key=str):
        b, a = before.get(key), after.get(key)
        name = f"{prefix}{key}"
        if isinstance(b, dict) and isinstance(a, dict):
            out.update(flat_diff(b, a, f"{name}."))
        elif b != a:
            out[name] = [b, a]
    return out


class Store:
    """Repository over one SQLite file. Build it with `ulyssesd.daemon.store.open_store`."""

    def __init__(self, engine: Engine, path: Path, *, readonly: bool) -> None:
        self._engine = engine
        self.path = path
        self.readonly = readonly
        self._bind(engine)

    def _bind(self, engine: Engine) -> None:
        self._engine = engine
        self._write_session = sessionmaker(engine, expire_on_commit=False)
        # Reads use a plain (deferred) BEGIN even on the writer engine: no write lock for a SELECT.
        self._read_session = sessionmaker(engine.execution_options(ulyssesd_read=True), expire_on_commit=False)
        # (st_dev, st_ino) of the file this store writes: a file deleted or replaced under the daemon is
        # noticed by `file_problem()` before history goes to an inode nobody can read any more.
        self.file_id = _file_id(self.path)

    # -- plumbing ---------------------------------------------------------------------------------------
    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} is open read-only; writes go through the daemon")
        with self._write_session.begin() as s:
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._read_session() as s, s.begin():
            yield s

    @staticmethod
    def _run_row(s: Session, run_id: str) -> Run:
        run = s.get(Run, run_id)
        if run is None:
            raise NotFoundError(f"no run {run_id!r}")
        return run

    # -- runs and state transitions ----------------------------------------------------------------------
    def create_run(
        self,
        run_id: str,
        *,
        spec: dict[str, Any] | None = None,
        run_dir: str | Path | None = None,
        spec_path: str | Path | None = None,
        state: RunState | str = RunState.STARTING,
        reason: str = "created",
        at: Timestamp = None,
    ) -> RunRecord:
        """Insert a run and its first state transition (from None). Fails if the id exists."""
        state = _parse(RunState, state)
        now = _ts(at)
        with self._write() as s:
            if s.get(Run, run_id) is not None:
                raise InvalidValueError(f"run {run_id!r} already exists")
            run = Run(id=run_id, spec=spec or {}, run_dir=str(run_dir) if run_dir else None,
                      spec_path=str(spec_path) if spec_path else None, state=state, state_reason=reason,
                      created_at=now, updated_at=now)
            s.add(run)
            s.add(StateTransition(run_id=run_id, from_state=None, to_state=state, reason=reason, at=now))
            s.flush()
            return RunRecord.from_row(run)

    def get_run(self, run_id: str) -> RunRecord:
        with self._read() as s:
            return RunRecord.from_row(self._run_row(s, run_id))

    def latest_run(self) -> RunRecord | None:
        with self._read() as s:
            run = s.scalars(select(Run).order_by(Run.created_at.desc(), Run.id.desc()).limit(1)).first()
            return RunRecord.from_row(run) if run else None

    def list_runs(self, limit: int | None = None) -> list[RunRecord]:
        with self._read() as s:
            q = select(Run).order_by(Run.created_at.desc(), Run.id.desc())
            if limit:
                q = q.limit(limit)
            return [RunRecord.from_row(r) for r in s.scalars(q)]

    def set_run_state(
        self,
        run_id: str,
        to_state: RunState | str,
        reason: str,
        *,
        attempt: int | None = None,
        allow_same: bool = False,
        at: Timestamp = None,
    ) -> StateTransitionRecord | None:
        """Move the run to `to_state` and record the transition in the same transaction.

        Returns None (and writes nothing) when the run is already in `to_state`, unless `allow_same`.
        Legality of the move is the supervisor's state machine's business, not the store's.
        """
        new = _parse(RunState, to_state)
        now = _ts(at)
        with self._write() as s:
            run = self._run_row(s, run_id)
            if run.state == new and not allow_same:
                return None
            tr = StateTransition(run_id=run_id, from_state=run.state, to_state=new, reason=reason,
                                 attempt=attempt, at=now)
            run.state, run.state_reason, run.updated_at = new, reason, now
            run.ended_at = now if new in TERMINAL_RUN_STATES else None
            s.add(tr)
            s.flush()
            return StateTransitionRecord.from_row(tr)

    def list_transitions(self, run_id: str) -> list[StateTransitionRecord]:
        with self._read() as s:
            q = select(StateTransition).where(StateTransition.run_id == run_id).order_by(StateTransition.id)
            return [StateTransitionRecord.from_row(t) for t in s.scalars(q)]

    # -- attempts ----------------------------------------------------------------------------------------
    def add_attempt(
        self,
        run_id: str,
        *,
        command: list[str],
        number: int | None = None,
        config_version: int | None = None,
        host: str | None = None,
        pid: int | None = None,
        pgid: int | None = None,
        proc_start_time: float | None = None,
        resumed_from: str | None = None,
        started_at: Timestamp = None,
    ) -> AttemptRecord:
        """Record a launch. `number` defaults to the run's last attempt number + 1 (first is 1)."""
        with self._write() as s:
            self._run_row(s, run_id)
            if number is None:
                last = s.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run_id))
                number = (last or 0) + 1
            att = Attempt(run_id=run_id, number=number, command=list(command), config_version=config_version,
                          host=host, pid=pid, pgid=pgid, proc_start_time=proc_start_time,
                          resumed_from=resumed_from, started_at=_ts(started_at))
            s.add(att)
            s.flush()
            return AttemptRecord.from_row(att)

    def _attempt_row(self, s: Session, run_id: str, number: int) -> Attempt:
        att = s.scalars(select(Attempt).where(Attempt.run_id == run_id, Attempt.number == number)).first()
        if att is None:
            raise NotFoundError(f"no attempt {number} of run {run_id!r}")
        return att

    def update_attempt(self, run_id: str, number: int, **changes: Any) -> AttemptRecord:
        """Set any of: pid, pgid, proc_start_time, host, ended_at, returncode, signal, diagnosis,
        diagnosis_evidence, resumed_from, config_version, command."""
        unknown = set(changes) - _ATTEMPT_FIELDS
        if unknown:
            raise InvalidValueError(f"unknown attempt field(s) {sorted(unknown)}; allowed: {sorted(_ATTEMPT_FIELDS)}")
        if "ended_at" in changes and changes["ended_at"] is not None:
            changes["ended_at"] = _ts(changes["ended_at"])
        with self._write() as s:
            att = self._attempt_row(s, run_id, number)
            for k, v in changes.items():
                setattr(att, k, v)
            s.flush()
            return AttemptRecord.from_row(att)

    def end_attempt(
        self,
        run_id: str,
        number: int,
        *,
        returncode: int | None,
        signal: int | None = None,
        diagnosis: str | None = None,
        diagnosis_evidence: Any = None,
        ended_at: Timestamp = None,
    ) -> AttemptRecord:
        return self.update_attempt(run_id, number, returncode=returncode, signal=signal, diagnosis=diagnosis,
                                   diagnosis_evidence=diagnosis_evidence, ended_at=_ts(ended_at))

    def get_attempt(self, run_id: str, number: int) -> AttemptRecord:
        with self._read() as s:
            return AttemptRecord.from_row(self._attempt_row(s, run_id, number))

    def list_attempts(self, run_id: str) -> list[AttemptRecord]:
        with self._read() as s:
            q = select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)
            return [AttemptRecord.from_row(a) for a in s.scalars(q)]

    def open_attempt(self, run_id: str) -> AttemptRecord | None:
        """The newest attempt without `ended_at` (what a restarted daemon tries to re-adopt), or None."""
        with self._read() as s:
            q = (select(Attempt).where(Attempt.run_id == run_id, Attempt.ended_at.is_(None))
                 .order_by(Attempt.number.desc()).limit(1))
            att = s.scalars(q).first()
            return AttemptRecord.from_row(att) if att else None

    # -- incidents ---------------------------------------------------------------------------------------
    def record_incident(
        self,
        run_id: str,
        *,
        attempt: int,
        symptom: Symptom | str,
        step: int,
        severity: Severity | str = Severity.warning,
        summary: str = "",
        evidence: dict[str, Any] | None = None,
        status: IncidentStatus | str = IncidentStatus.open,
        detected_at: Timestamp = None,
    ) -> int:
        """Insert-or-ignore on (run_id, attempt, symptom, step); returns the incident's id either way.

        `step` is the step the symptom was seen at (the last telemetry step for crashes; 0 if none), so a
        daemon re-reading telemetry after re-adoption finds the incident it already recorded.
        """
        return self.add_incident_if_new(
            run_id, attempt=attempt, symptom=symptom, step=step, severity=severity, summary=summary,
            evidence=evidence, status=status, detected_at=detected_at)[0]

    def add_incident_if_new(
        self,
        run_id: str,
        *,
        attempt: int,
        symptom: Symptom | str,
        step: int,
        severity: Severity | str = Severity.warning,
        summary: str = "",
        evidence: dict[str, Any] | None = None,
        status: IncidentStatus | str = IncidentStatus.open,
        detected_at: Timestamp = None,
    ) -> tuple[int, bool]:
        """Like `record_incident`, returning (id, created): created=False means it was already recorded
        (e.g. replayed telemetry after re-adoption) and must not trigger a second remediation."""
        sym = _parse(Symptom, symptom)
        now = _ts(detected_at)
        values = dict(run_id=run_id, attempt=int(attempt), step=int(step), symptom=sym,
                      severity=_parse(Severity, severity), summary=summary, evidence=evidence or {},
                      status=_parse(IncidentStatus, status), detected_at=now, updated_at=now)
        with self._write() as s:
            self._run_row(s, run_id)
            stmt = sqlite_insert(Incident).values(**values).on_conflict_do_nothing(
                index_elements=["run_id", "attempt", "symptom", "step"]
            )
            created = s.execute(stmt).rowcount == 1  # type: ignore[attr-defined]
            inc_id = s.scalar(select(Incident.id).where(
                Incident.run_id == run_id, Incident.attempt == int(attempt), Incident.symptom == sym,
                Incident.step == int(step)))
            assert inc_id is not None
            return inc_id, created

    def find_incident(self, run_id: str, attempt: int, symptom: Symptom | str, step: int) -> IncidentRecord | None:
        symptom = _parse(Symptom, symptom)
        with self._read() as s:
            inc = s.scalars(select(Incident).where(
                Incident.run_id == run_id, Incident.attempt == attempt, Incident.symptom == symptom,
                Incident.step == step)).first()
            return IncidentRecord.from_row(inc) if inc else None

    def _incident_row(self, s: Session, incident_id: int) -> Incident:
        inc = s.get(Incident, incident_id)
        if inc is None:
            raise NotFoundError(f"no incident {incident_id}")
        return inc

    def update_incident_status(
        self, incident_id: int, status: IncidentStatus | str, reason: str | None = None, *, at: Timestamp = None
    ) -> IncidentRecord:
        """open → remediating → resolved | escalated | failed; resolved/failed are final."""
        new = _parse(IncidentStatus, status)
        now = _ts(at)
        with self._write() as s:
            inc = self._incident_row(s, incident_id)
            if inc.status != new:
                if new not in _INCIDENT_MOVES[inc.status]:
                    raise InvalidValueError(f"incident {incident_id} is {inc.status.value}; cannot move to {new.value}")
                inc.status = new
                inc.closed_at = now if new in TERMINAL_INCIDENT_STATUSES else None
            if reason is not None:
                inc.status_reason = reason
            inc.updated_at = now
            s.flush()
            return IncidentRecord.from_row(inc)

    def ack_incident(self, incident_id: int, by: str, *, at: Timestamp = None) -> IncidentRecord:
        """Mark acknowledged by an operator; the first acknowledgement is kept."""
        if not by or not by.strip():
            raise InvalidValueError("ack needs a non-empty operator name")
        with self._write() as s:
            inc = self._incident_row(s, incident_id)
            if inc.acknowledged_at is None:
                inc.acknowledged_by, inc.acknowledged_at = by.strip(), _ts(at)
            s.flush()
            return IncidentRecord.from_row(inc)

    def list_incidents(
        self,
        run_id: str | None = None,
        symptom: Symptom | str | None = None,
        status: IncidentStatus | str | None = None,
        since: Timestamp = None,
        *,
        unacknowledged: bool = False,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[IncidentRecord]:
        """Filtered incidents (without their actions). `limit` keeps the newest N."""
        # Core rows, not ORM entities: listings can be thousands of rows and ulyssesctl should stay snappy.
        q = select(Incident.__table__)
        if run_id is not None:
            q = q.where(Incident.run_id == run_id)
        if symptom is not None:
            q = q.where(Incident.symptom == _parse(Symptom, symptom))
        if status is not None:
            q = q.where(Incident.status == _parse(IncidentStatus, status))
        if since is not None:
            q = q.where(Incident.detected_at >= _ts(since))
        if unacknowledged:
            q = q.where(Incident.acknowledged_at.is_(None))
        q = q.order_by(Incident.id.desc())
        if limit:
            q = q.limit(limit)
        with self._read() as s:
            rows = [IncidentRecord.from_row(i) for i in s.execute(q)]
        return rows if newest_first else rows[::-1]

    def get_incident(self, incident_id: int) -> IncidentRecord:
        """The incident with its actions (oldest first)."""
        with self._read() as s:
            inc = self._incident_row(s, incident_id)
            acts = s.scalars(select(Action).where(Action.incident_id == incident_id).order_by(Action.id))
            return IncidentRecord.from_row(inc, actions=tuple(ActionRecord.from_row(a) for a in acts))

    # -- actions -----------------------------------------------------------------------------------------
    def record_action(
        self,
        run_id: str,
        kind: ActionKind | str,
        *,
        incident_id: int | None = None,
        parameters: dict[str, Any] | None = None,
        config_before: dict[str, Any] | None = None,
        config_after: dict[str, Any] | None = None,
        config_diff: dict[str, Any] | None = None,
        mode: ApplyMode | str = ApplyMode.none,
        from_config_version: int | None = None,
        to_config_version: int | None = None,
        observe_only: bool = False,
        applied_at: Timestamp = None,
    ) -> ActionRecord:
        """Record an action (or, with observe_only, what it would have been).

        Give either `config_diff` ({key: [before, after]}) or `config_before`/`config_after` (diffed here).
        The outcome starts as `pending` until `verify_action`.
        """
        kind = _parse(ActionKind, kind)
        mode = _parse(ApplyMode, mode)
        if config_diff is None:
            config_diff = flat_diff(config_before or {}, config_after or {})
        with self._write() as s:
            self._run_row(s, run_id)
            if incident_id is not None:
                self._incident_row(s, incident_id)
            act = Action(run_id=run_id, incident_id=incident_id, kind=kind, parameters=parameters or {},
                         config_diff=config_diff, mode=mode, from_config_version=from_config_version,
                         to_config_version=to_config_version, observe_only=observe_only,
                         applied_at=_ts(applied_at), outcome=ActionOutcome.pending)
            s.add(act)
            s.flush()
            return ActionRecord.from_row(act)

    def verify_action(
        self,
        action_id: int,
        outcome: ActionOutcome | str,
        detail: dict[str, Any] | None = None,
        *,
        at: Timestamp = None,
    ) -> ActionRecord:
        result = _parse(ActionOutcome, outcome)
        with self._write() as s:
            act = s.get(Action, action_id)
            if act is None:
                raise NotFoundError(f"no action {action_id}")
            act.outcome, act.outcome_detail, act.verified_at = result, detail, _ts(at)
            s.flush()
            return ActionRecord.from_row(act)

    def list_actions(self, run_id: str | None = None, incident_id: int | None = None) -> list[ActionRecord]:
        q = select(Action).order_by(Action.id)
        if run_id is not None:
            q = q.where(Action.run_id == run_id)
        if incident_id is not None:
            q = q.where(Action.incident_id == incident_id)
        with self._read() as s:
            return [ActionRecord.from_row(a) for a in s.scalars(q)]

    # -- config versions ---------------------------------------------------------------------------------
    def add_config_version(
        self,
        run_id: str,
        config: dict[str, Any],
        *,
        reason: str,
        parent_version: int | None = None,
        version: int | None = None,
        make_current: bool = True,
        at: Timestamp = None,
    ) -> ConfigVersionRecord:
        """Store an effective config; `version` defaults to last + 1 (first is 1). Optionally make it the
        run's current `config_version`."""
        with self._write() as s:
            run = self._run_row(s, run_id)
            if version is None:
                last = s.scalar(select(func.max(ConfigVersion.version)).where(ConfigVersion.run_id == run_id))
                version = (last or 0) + 1
            cv = ConfigVersion(run_id=run_id, version=version, parent_version=parent_version, config=config,
                               reason=reason, created_at=_ts(at))
            s.add(cv)
            if make_current:
                run.config_version = version
                run.updated_at = _ts(at)
            s.flush()
            return ConfigVersionRecord.from_row(cv)

    def get_config_version(self, run_id: str, version: int | None = None) -> ConfigVersionRecord:
        """`version` or, when None, the run's current one (else its newest)."""
        with self._read() as s:
            run = self._run_row(s, run_id)
            q = select(ConfigVersion).where(ConfigVersion.run_id == run_id)
            want = version if version is not None else run.config_version
            q = q.where(ConfigVersion.version == want) if want is not None else q.order_by(ConfigVersion.version.desc())
            cv = s.scalars(q.limit(1)).first()
            if cv is None:
                raise NotFoundError(f"no config version {want if want is not None else '(any)'} of run {run_id!r}")
            return ConfigVersionRecord.from_row(cv)

    def list_config_versions(self, run_id: str) -> list[ConfigVersionRecord]:
        with self._read() as s:
            q = select(ConfigVersion).where(ConfigVersion.run_id == run_id).order_by(ConfigVersion.version)
            return [ConfigVersionRecord.from_row(c) for c in s.scalars(q)]

    # -- telemetry cursor --------------------------------------------------------------------------------
    def set_telemetry_cursor(
        self, run_id: str, *, path: str | Path, inode: int, offset: int, last_step: int | None = None
    ) -> TelemetryCursorRecord:
        """Remember how far telemetry.jsonl was processed (byte offset just after the last full line)."""
        if offset < 0:
            raise InvalidValueError(f"telemetry offset must be >= 0, got {offset}")
        with self._write() as s:
            self._run_row(s, run_id)
            cur = s.get(TelemetryCursor, run_id)
            if cur is None:
                cur = TelemetryCursor(run_id=run_id)
                s.add(cur)
            cur.path, cur.inode, cur.offset, cur.last_step, cur.updated_at = (
                str(path), int(inode), int(offset), last_step, utcnow())
            s.flush()
            return TelemetryCursorRecord.from_row(cur)

    def get_telemetry_cursor(self, run_id: str) -> TelemetryCursorRecord | None:
        with self._read() as s:
            cur = s.get(TelemetryCursor, run_id)
            return TelemetryCursorRecord.from_row(cur) if cur else None

    # -- checkpoints -------------------------------------------------------------------------------------
    def upsert_checkpoint(
        self,
        run_id: str,
        tag: str,
        step: int,
        *,
        loss: float | None = None,
        valid: bool = True,
        known_good: bool | None = None,
        invalid_reason: str | None = None,
        attempt: int | None = None,
        config_version: int | None = None,
        saved_at: Timestamp = None,
    ) -> CheckpointRecord:
        """Insert or update a seen tag. `known_good=None` keeps the stored flag; an invalid tag is never
        known-good."""
        now = utcnow()
        with self._write() as s:
            self._run_row(s, run_id)
            ck = s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.tag == tag)).first()
            if ck is None:
                ck = Checkpoint(run_id=run_id, tag=tag, saved_at=_ts(saved_at), known_good=False)
                s.add(ck)
            ck.step, ck.valid, ck.updated_at = int(step), bool(valid), now
            if loss is not None:
                ck.loss = float(loss)
            if attempt is not None:
                ck.attempt = attempt
            if config_version is not None:
                ck.config_version = config_version
            ck.invalid_reason = None if valid else (invalid_reason or "invalid")
            if known_good is not None:
                ck.known_good = bool(known_good)
            if not valid:
                ck.known_good = False
            s.flush()
            return CheckpointRecord.from_row(ck)

    def mark_checkpoint_pruned(self, run_id: str, tag: str) -> CheckpointRecord:
        """The tag's files were removed by retention; the row stays for the history."""
        with self._write() as s:
            ck = s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.tag == tag)).first()
            if ck is None:
                raise NotFoundError(f"no checkpoint {tag!r} of run {run_id!r}")
            ck.pruned_at = ck.updated_at = utcnow()
            s.flush()
            return CheckpointRecord.from_row(ck)

    def list_checkpoints(self, run_id: str, *, include_pruned: bool = False) -> list[CheckpointRecord]:
        """Tags by step, oldest first."""
        q = select(Checkpoint).where(Checkpoint.run_id == run_id)
        if not include_pruned:
            q = q.where(Checkpoint.pruned_at.is_(None))
        with self._read() as s:
            return [CheckpointRecord.from_row(c) for c in s.scalars(q.order_by(Checkpoint.step, Checkpoint.id))]

    def latest_checkpoint(self, run_id: str, *, known_good: bool = False) -> CheckpointRecord | None:
        """Newest valid, unpruned tag (with `known_good=True`: newest known-good one)."""
        q = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.valid.is_(True),
                                     Checkpoint.pruned_at.is_(None))
        if known_good:
            q = q.where(Checkpoint.known_good.is_(True))
        with self._read() as s:
            ck = s.scalars(q.order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(1)).first()
            return CheckpointRecord.from_row(ck) if ck else None

    # -- file identity, online backup ------------------------------------------------------------------
    def file_problem(self) -> str | None:
        """None while `path` is still the file this store writes; else what happened to it (one stat)."""
        now = _file_id(self.path)
        if now is None:
            return f"database file {self.path} was deleted while the daemon had it open"
        if now != self.file_id:
            return f"database file {self.path} was replaced by another file (inode {self.file_id} -> {now})"
        return None

    def backup_into(self, dest: str | Path, *, pages_per_step: int = 256) -> None:
        """Online copy of the whole database into `dest` (a new file, mode 0640) with SQLite's backup API.

        Consistent while the daemon writes (the copy restarts if a write lands mid-copy, which with a few
        MB and 256-page steps finishes in milliseconds). Works on a store whose file was deleted: the open
        connection still reads the old inode, which is how `recovery.mend_replaced_file` saves its history.
        """
        import sqlite3

        from .permissions import private_file

        dest = Path(dest)
        private_file(dest)
        raw = self._engine.raw_connection()
        try:
            target = sqlite3.connect(str(dest))
            try:
                raw.driver_connection.backup(target, pages=pages_per_step)  # type: ignore[union-attr]
            finally:
                target.close()
        finally:
            raw.close()

    def rebind(self) -> None:
        """Reconnect to `path` (after the file was re-created there): new engine, new file identity."""
        from .engine import make_engine

        old = self._engine
        old.dispose()
        self._bind(make_engine(self.path, readonly=self.readonly))

    # -- maintenance -------------------------------------------------------------------------------------
    def maintenance(self, *, quick: bool = False) -> MaintenanceResult:
        """`PRAGMA integrity_check` (or quick_check) + `wal_checkpoint(TRUNCATE)`; for the scheduler.

        Runs outside any transaction on a raw connection (checkpointing inside a transaction is an error).
        A reader holding an old snapshot makes the checkpoint give up after ~1 s with `wal_busy=1`
        (retried next time) rather than stall the daemon's writes. In read-only mode only the integrity
        check runs.
        """
        t0 = time.monotonic()
        wal = Path(f"{self.path}-wal")
        wal_before = wal.stat().st_size if wal.exists() else 0
        raw = self._engine.raw_connection()
        try:
            cur = raw.cursor()
            rows = cur.execute("PRAGMA quick_check" if quick else "PRAGMA integrity_check").fetchall()
            integrity = [str(r[0]) for r in rows]
            busy = frames = done = 0
            if not self.readonly:
                # A TRUNCATE checkpoint blocks new writers while it waits for readers; wait at most
                # CHECKPOINT_BUSY_MS (well under the writers' busy_timeout) and report busy instead.
                cur.execute(f"PRAGMA busy_timeout = {CHECKPOINT_BUSY_MS}")
                try:
                    busy, frames, done = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                finally:
                    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cur.close()
        finally:
            raw.close()
        return MaintenanceResult(
            ok=integrity == ["ok"], integrity=integrity, wal_busy=int(busy), wal_frames=int(frames),
            wal_checkpointed=int(done), db_bytes=os.path.getsize(self.path),
            wal_bytes_before=wal_before, wal_bytes_after=wal.stat().st_size if wal.exists() else 0, seconds=round(time.monotonic() - t0, 4),
        )
