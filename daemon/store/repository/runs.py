"""Runs, their state transitions and their attempts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..enums import TERMINAL_RUN_STATES, RunState
from ..errors import InvalidValueError, NotFoundError
from ..models import Attempt, Run, StateTransition
from ..records import AttemptRecord, RelaunchCounts, RelaunchRecord, RunRecord, StateTransitionRecord
from .base import StoreBase, Timestamp, parse_enum

#: The reason of the state transition an operator command causes starts with this ("operator pause by uid
#: 1000", "operator restart", "operator stop by uid 0"): the supervisor writes them so, and the store tells an
#: operator relaunch from a restart by it. Only the command's own transition counts: a launch that merely
#: quotes it ("attempt 3 launched (operator resume) from ...") comes after that attempt started.
OPERATOR_REASON_PREFIX = "operator "


def is_operator_reason(reason: str | None) -> bool:
    """Whether a state transition's reason says an operator command caused it."""
    return (reason or "").startswith(OPERATOR_REASON_PREFIX)


_ATTEMPT_FIELDS = frozenset(
    {"pid", "pgid", "proc_start_time", "host", "ended_at", "returncode", "signal", "diagnosis",
     "diagnosis_evidence", "resumed_from", "config_version", "command"}
)


class RunsRepository(StoreBase):
    """Queries of the runs, state_transitions and attempts tables."""

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
        state = parse_enum(RunState, state)
        now = self._to_utc(at)
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
        new = parse_enum(RunState, to_state)
        now = self._to_utc(at)
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

    def list_relaunches(self, run_id: str) -> list[RelaunchRecord]:
        """The attempts after the first, oldest first, each with whether an operator command led to it: one
        did when an operator command's transition lies between the previous attempt's start and its own."""
        with self._read() as s:
            self._require_run(s, run_id)
            starts = s.execute(select(Attempt.number, Attempt.started_at).where(Attempt.run_id == run_id)
                               .order_by(Attempt.number)).all()
            reasons = s.execute(select(StateTransition.at, StateTransition.reason)
                                .where(StateTransition.run_id == run_id)).all()
        operator_at = [at for at, reason in reasons if is_operator_reason(reason)]
        return [RelaunchRecord(attempt=number, started_at=started,
                               by_operator=any(prev_started < at <= started for at in operator_at))
                for (_, prev_started), (number, started) in zip(starts, starts[1:], strict=False)]

    def relaunch_counts(self, run_id: str) -> RelaunchCounts:
        """How often the run was relaunched: `restarts` (the daemon's own: crash, hang, remediation, requeue)
        and `operator_relaunches` (pause + resume, restart: not failures, not in the restart budget)."""
        relaunches = self.list_relaunches(run_id)
        by_operator = sum(r.by_operator for r in relaunches)
        return RelaunchCounts(restarts=len(relaunches) - by_operator, operator_relaunches=by_operator)

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
            self._require_run(s, run_id)
            if number is None:
                last = s.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run_id))
                number = (last or 0) + 1
            att = Attempt(run_id=run_id, number=number, command=list(command), config_version=config_version,
                          host=host, pid=pid, pgid=pgid, proc_start_time=proc_start_time,
                          resumed_from=resumed_from, started_at=self._to_utc(started_at))
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
            changes["ended_at"] = self._to_utc(changes["ended_at"])
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
                                   diagnosis_evidence=diagnosis_evidence, ended_at=self._to_utc(ended_at))

    def get_attempt(self, run_id: str, number: int) -> AttemptRecord:
        with self._read() as s:
            return AttemptRecord.from_row(self._attempt_row(s, run_id, number))

    def list_attempts(self, run_id: str) -> list[AttemptRecord]:
        with self._read() as s:
            q = select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)
            return [AttemptRecord.from_row(a) for a in s.scalars(q)]

    def latest_attempt(self, run_id: str) -> AttemptRecord | None:
        """The run's newest attempt (highest number), or None before its first launch: one row, however many."""
        with self._read() as s:
            att = s.scalars(select(Attempt).where(Attempt.run_id == run_id)
                            .order_by(Attempt.number.desc()).limit(1)).first()
            return AttemptRecord.from_row(att) if att else None

    def open_attempt(self, run_id: str) -> AttemptRecord | None:
        """The newest attempt without `ended_at` (what a restarted daemon tries to re-adopt), or None."""
        with self._read() as s:
            q = (select(Attempt).where(Attempt.run_id == run_id, Attempt.ended_at.is_(None))
                 .order_by(Attempt.number.desc()).limit(1))
            att = s.scalars(q).first()
            return AttemptRecord.from_row(att) if att else None

    def list_open_attempts(self, run_id: str) -> list[AttemptRecord]:
        """The run's attempts without `ended_at`, oldest first: what the stale-attempt sweep looks at (a long run's
        thousand ended attempts are not read on every sweep)."""
        with self._read() as s:
            q = select(Attempt).where(Attempt.run_id == run_id, Attempt.ended_at.is_(None)).order_by(Attempt.number)
            return [AttemptRecord.from_row(a) for a in s.scalars(q)]
