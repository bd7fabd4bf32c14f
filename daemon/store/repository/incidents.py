"""Incidents and the actions taken on them."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

from sqlalchemy import Select, func, or_, select, text
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ..enums import (
    TERMINAL_INCIDENT_STATUSES,
    ActionKind,
    ActionOutcome,
    ApplyMode,
    IncidentStatus,
    Severity,
    Symptom,
)
from ..errors import InvalidValueError, NotFoundError
from ..models import INCIDENT_KEY_WHERE, Action, Incident
from ..records import ActionRecord, IncidentRecord
from .base import StoreBase, Timestamp, parse_enum

_P = ParamSpec("_P")

# Incident status moves the store accepts; everything else is a bug in the caller.
_INCIDENT_MOVES: dict[IncidentStatus, frozenset[IncidentStatus]] = {
    IncidentStatus.open: frozenset(IncidentStatus) - {IncidentStatus.open},
    IncidentStatus.remediating: frozenset(IncidentStatus) - {IncidentStatus.remediating},
    # An escalated incident is waiting for a human; they may still close it either way.
    IncidentStatus.escalated: frozenset({IncidentStatus.resolved, IncidentStatus.failed}),
    IncidentStatus.resolved: frozenset(),
    IncidentStatus.failed: frozenset(),
}


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


def _id_only(add: Callable[_P, tuple[int, bool]], name: str) -> Callable[_P, int]:
    """`add` with the same parameters, answering only the id of its (id, created): one parameter list for
    the callers that do not care whether the incident was new."""

    @functools.wraps(add)
    def record(*args: _P.args, **kwargs: _P.kwargs) -> int:
        return add(*args, **kwargs)[0]

    record.__name__, record.__qualname__ = name, add.__qualname__.rsplit(".", 1)[0] + f".{name}"
    record.__doc__ = "Insert-or-ignore like `add_incident_if_new`; returns the incident's id either way."
    record.__signature__ = inspect.signature(add).replace(return_annotation="int")  # type: ignore[attr-defined]
    return record


class IncidentsRepository(StoreBase):
    """Queries of the incidents and actions tables."""

    # -- incidents ---------------------------------------------------------------------------------------
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
        """Insert-or-ignore on (run_id, attempt, symptom, step): (id, created), where created=False means it
        was already recorded (e.g. replayed telemetry after re-adoption) and must not trigger a second
        remediation. An `internal_error` or `inner_restart` is always inserted (the step guard, the coexist watch deduplicate their own). `step` is the step the symptom was seen at (the last telemetry step for crashes; 0 if
        none). `record_incident` is the same call answering only the id."""
        sym = parse_enum(Symptom, symptom)
        now = self._to_utc(detected_at)
        values = dict(run_id=run_id, attempt=int(attempt), step=int(step), symptom=sym,
                      severity=parse_enum(Severity, severity), summary=summary, evidence=evidence or {},
                      status=parse_enum(IncidentStatus, status), detected_at=now, updated_at=now)
        with self._write() as s:
            self._require_run(s, run_id)
            stmt = sqlite_insert(Incident).values(**values).on_conflict_do_nothing(
                index_elements=["run_id", "attempt", "symptom", "step"], index_where=text(INCIDENT_KEY_WHERE)
            )
            created = s.execute(stmt).rowcount == 1  # type: ignore[attr-defined]
            # Newest first: internal errors are not unique on the key (models.INCIDENT_KEY_WHERE).
            inc_id = s.scalar(select(Incident.id).where(
                Incident.run_id == run_id, Incident.attempt == int(attempt), Incident.symptom == sym,
                Incident.step == int(step)).order_by(Incident.id.desc()).limit(1))
            assert inc_id is not None
            return inc_id, created

    #: `add_incident_if_new`, answering only the id (new or already recorded): what most callers need.
    record_incident = _id_only(add_incident_if_new, "record_incident")

    def find_incident(self, run_id: str, attempt: int, symptom: Symptom | str, step: int) -> IncidentRecord | None:
        symptom = parse_enum(Symptom, symptom)
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
        new = parse_enum(IncidentStatus, status)
        now = self._to_utc(at)
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
                inc.acknowledged_by, inc.acknowledged_at = by.strip(), self._to_utc(at)
            s.flush()
            return IncidentRecord.from_row(inc)

    def _incidents_query(self, run_id: str | None, symptom: Symptom | str | None, status: IncidentStatus | str | None,
                         since: Timestamp, unacknowledged: bool, before_id: int | None) -> Select[Any]:
        """The listing's filter (no order, no limit): shared by `list_incidents` and `count_incidents`."""
        q = select(Incident.__table__)
        if run_id is not None:
            q = q.where(Incident.run_id == run_id)
        if symptom is not None:
            q = q.where(Incident.symptom == parse_enum(Symptom, symptom))
        if status is not None:
            q = q.where(Incident.status == parse_enum(IncidentStatus, status))
        if since is not None:
            q = q.where(Incident.detected_at >= self._to_utc(since))
        if unacknowledged:
            q = q.where(Incident.acknowledged_at.is_(None))
        if before_id is not None:
            q = q.where(Incident.id < int(before_id))
        return q

    def list_incidents(
        self,
        run_id: str | None = None,
        symptom: Symptom | str | None = None,
        status: IncidentStatus | str | None = None,
        since: Timestamp = None,
        *,
        unacknowledged: bool = False,
        limit: int | None = None,
        before_id: int | None = None,
        newest_first: bool = False,
        with_actions: bool = False,
    ) -> list[IncidentRecord]:
        """Filtered incidents; `limit` keeps the newest N, `before_id` only those older than that id (the next
        page of a listing: pass the oldest id of the page before). Without their actions, unless
        `with_actions`: then each carries its actions (oldest first), in the same single query (a join)."""
        if limit is not None and limit < 0:
            raise InvalidValueError(f"limit must be >= 0 (0: no limit), got {limit}")
        # Core rows, not ORM entities: listings can be 10^5 rows and ulyssesctl should stay snappy.
        q = self._incidents_query(run_id, symptom, status, since, unacknowledged, before_id).order_by(Incident.id.desc())
        if limit:
            q = q.limit(limit)
        rows: list[IncidentRecord] = []
        with self._read() as s:
            if not with_actions:
                rows = [IncidentRecord.from_row(i) for i in s.execute(q)]
                return rows if newest_first else rows[::-1]
            # One statement: the page of incidents (its own order and limit) joined with all their actions.
            page = q.subquery()
            act = Action.__table__
            joined = (select(page, *(c.label(f"act_{c.name}") for c in act.columns))
                      .outerjoin(act, act.c.incident_id == page.c.id).order_by(page.c.id.desc(), act.c.id))
            actions: list[ActionRecord] = []
            names = [c.name for c in act.columns]
            for r in s.execute(joined):
                if not rows or rows[-1].id != r.id:
                    if rows:
                        rows[-1] = rows[-1].replace(actions=tuple(actions))
                    rows.append(IncidentRecord.from_row(r))
                    actions = []
                if r.act_id is not None:
                    actions.append(ActionRecord(**{n: getattr(r, f"act_{n}") for n in names}))
            if rows:
                rows[-1] = rows[-1].replace(actions=tuple(actions))
        return rows if newest_first else rows[::-1]

    def count_incidents(
        self,
        run_id: str | None = None,
        symptom: Symptom | str | None = None,
        status: IncidentStatus | str | None = None,
        since: Timestamp = None,
        *,
        unacknowledged: bool = False,
        before_id: int | None = None,
    ) -> int:
        """How many incidents `list_incidents` with the same filter lists without a limit (one COUNT)."""
        q = self._incidents_query(run_id, symptom, status, since, unacknowledged, before_id)
        with self._read() as s:
            return int(s.scalar(select(func.count()).select_from(q.subquery())) or 0)

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
        kind = parse_enum(ActionKind, kind)
        mode = parse_enum(ApplyMode, mode)
        if config_diff is None:
            config_diff = flat_diff(config_before or {}, config_after or {})
        with self._write() as s:
            self._require_run(s, run_id)
            if incident_id is not None:
                self._incident_row(s, incident_id)
            act = Action(run_id=run_id, incident_id=incident_id, kind=kind, parameters=parameters or {},
                         config_diff=config_diff, mode=mode, from_config_version=from_config_version,
                         to_config_version=to_config_version, observe_only=observe_only,
                         applied_at=self._to_utc(applied_at), outcome=ActionOutcome.pending)
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
        result = parse_enum(ActionOutcome, outcome)
        with self._write() as s:
            act = s.get(Action, action_id)
            if act is None:
                raise NotFoundError(f"no action {action_id}")
            act.outcome, act.outcome_detail, act.verified_at = result, detail, self._to_utc(at)
            s.flush()
            return ActionRecord.from_row(act)

    def list_actions(self, run_id: str | None = None, incident_id: int | None = None, *, limit: int | None = None,
                     rollbacks: bool = False) -> list[ActionRecord]:
        """Actions oldest first; `limit` keeps the newest N; `rollbacks` only those that rolled the run back
        (kind rollback_skip, or parameters naming `rollback_to_step`): what goodput needs of 10^5 actions."""
        q = select(Action).order_by(Action.id.desc())
        if run_id is not None:
            q = q.where(Action.run_id == run_id)
        if incident_id is not None:
            q = q.where(Action.incident_id == incident_id)
        if rollbacks:
            q = q.where(or_(Action.kind == ActionKind.rollback_skip,
                            func.json_extract(Action.parameters, "$.rollback_to_step").is_not(None)))
        if limit:
            q = q.limit(limit)
        with self._read() as s:
            return [ActionRecord.from_row(a) for a in s.scalars(q)][::-1]

    def count_actions(self, run_id: str) -> int:
        """How many actions the run has (one COUNT)."""
        with self._read() as s:
            return int(s.scalar(select(func.count()).select_from(Action).where(Action.run_id == run_id)) or 0)

    def ladder_rungs(self, run_id: str) -> list[tuple[Any, Any, int]]:
        """(ladder, rung, the step of its incident or 0) of every action of the run whose parameters name a
        ladder, oldest first: what a re-adopting daemon restores ladder positions from, in one query (the
        actions' JSON read by SQLite, not 10^5 records built in Python)."""
        ladder = func.json_extract(Action.parameters, "$.ladder")
        q = (select(ladder, func.json_extract(Action.parameters, "$.rung"), func.coalesce(Incident.step, 0))
             .select_from(Action)
             .outerjoin(Incident, (Incident.id == Action.incident_id) & (Incident.run_id == run_id))
             .where(Action.run_id == run_id, ladder.is_not(None)).order_by(Action.id))
        with self._read() as s:
            return [(a, b, int(c)) for a, b, c in s.execute(q)]

    def restart_actions(self, run_id: str, attempt: int) -> list[ActionRecord]:
        """The restart-mode actions (observe-only ones left out) on the incidents of one attempt, oldest first:
        the relaunch a previous daemon decided for it, read back without reading the run's other actions."""
        q = (select(Action).join(Incident, Incident.id == Action.incident_id)
             .where(Action.run_id == run_id, Incident.run_id == run_id, Incident.attempt == int(attempt),
                    Action.mode == ApplyMode.restart, Action.observe_only.is_(False)).order_by(Action.id))
        with self._read() as s:
            return [ActionRecord.from_row(a) for a in s.scalars(q)]
