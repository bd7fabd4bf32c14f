"""The run's incident log: every incident and action goes to the store through here, and here they are settled.

The supervisor owns one `IncidentLog` and hands it to the tick's parts (decisions, exits, relaunch, disk):
they record what they saw (`incident`) and what they did about it (`action`); the log remembers which
incidents wait for proof that their fix worked (`remedied`: resolved once a checkpoint follows the fix) and
which findings no decision has acted on yet (`unacted`: settled when they recover inside the grace window
or the attempt ends). It never changes the run's state: that stays with the supervisor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, Severity, Symptom
from ulyssesd.remediation.detectors import Finding

log = get_logger("ulyssesd.supervisor")

#: Symptoms logged as errors (journalctl -p err) even at warning severity: the job itself is in trouble.
SERIOUS = frozenset({"crash", "crash_loop", "hang", "launch_failure"})


@dataclass(frozen=True)
class Position:
    """Where the run is when something is recorded: which run, attempt and last step."""

    run_id: str
    attempt: int
    last_step: int | None


@dataclass(frozen=True)
class Remedied:
    """An incident whose fix was applied: the action to verify, and the step it was applied at."""

    action_id: int
    step: int


def jsonable(x: Any) -> Any:
    """Evidence and parameters as plain JSON (tuples/sets as lists, arrays via tolist, the rest as str)."""
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else (
        list(o) if isinstance(o, tuple | set) else str(o))))


class IncidentLog:
    def __init__(self, store: Any, position: Callable[[], Position], *,
                 alert: Callable[..., None], say: Callable[[str], None]) -> None:
        self.store = store
        self.position = position  # the supervisor's run id, attempt and last step, read at each record
        self.alert = alert  # queues a webhook event (never blocks): alert(event, text, **details)
        self.say = say  # one line for the operator's console
        self.remedied: dict[int, Remedied] = {}  # incident id -> its applied fix, until a checkpoint verifies it
        # symptom -> [(incident id, step)] of findings no decision has acted on yet (grace window)
        self.unacted: dict[str, list[tuple[int, int]]] = {}
        self.counts: dict[str, int] = {}  # for the metrics: incidents of this daemon's run, by symptom
        self.actions_by_kind: dict[str, int] = {}  # for the metrics: actions of this daemon's run, by kind

    # ------------------------------------------------------------------------------ recording
    def incident(self, symptom: Symptom, step: int, severity: Severity, summary: str, evidence: dict[str, Any],
                 attempt: int | None = None) -> int:
        """Record an incident (deduplicated by the store on run, attempt, symptom, step); returns its id."""
        where = self.position()
        iid = self.store.record_incident(where.run_id, attempt=attempt if attempt is not None else where.attempt,
                                         symptom=symptom, step=step, severity=severity, summary=summary,
                                         evidence=jsonable(evidence))
        self.counts[symptom.value] = self.counts.get(symptom.value, 0) + 1
        # Warning for what the ladder handles; error for a crash, a hang, a failed launch or a critical one.
        serious = severity == Severity.critical or symptom.value in SERIOUS
        (log.error if serious else log.warning)("incident", run_id=where.run_id, id=iid, symptom=symptom.value,
                                                step=step, severity=severity.value, summary=summary)
        self.alert("hang" if symptom.value == "hang" else "incident", f"incident #{iid} {symptom.value} at step "
                   f"{step}: {summary}", incident_id=iid, symptom=symptom.value, step=step, severity=severity.value)
        self.say(f"INCIDENT #{iid} {symptom.value} at step {step}: {summary}")
        return iid

    def action(self, incident_id: int | None, kind: ActionKind, params: dict[str, Any], diff: dict[str, Any],
               mode: ApplyMode, from_v: int | None = None, to_v: int | None = None, observe_only: bool = False) -> int:
        """Record an action (on an incident, which then waits for its verification); returns its id."""
        where = self.position()
        aid = self.store.record_action(where.run_id, kind, incident_id=incident_id, parameters=jsonable(params),
                                       config_diff=jsonable(diff), mode=mode, from_config_version=from_v,
                                       to_config_version=to_v, observe_only=observe_only).id
        if incident_id is not None:
            self.remedied[incident_id] = Remedied(aid, where.last_step or 0)
        log.warning("action", run_id=where.run_id, id=aid, incident=incident_id, kind=kind.value, mode=mode.value,
                    observe_only=observe_only, config_from=from_v, config_to=to_v, rung=params.get("rung"))
        self.actions_by_kind[kind.value] = self.actions_by_kind.get(kind.value, 0) + 1
        self.alert("action", f"action #{aid} {kind.value} ({mode.value})"
                   + (f" for incident #{incident_id}" if incident_id is not None else ""),
                   action_id=aid, incident_id=incident_id, kind=kind.value, mode=mode.value)
        return aid

    def stopped(self, incident_id: int, reason: str) -> None:
        """The incident ends the run: a `stop` action on it, and the incident failed, both saying why."""
        self.action(incident_id, ActionKind.stop, {"reason": reason}, {}, ApplyMode.none)
        self.store.update_incident_status(incident_id, IncidentStatus.failed, reason)

    def finding(self, fnd: Finding) -> int:
        """A detector's finding as an incident, remembered as unacted until a decision takes it."""
        step = fnd.step if fnd.step is not None else (self.position().last_step or 0)
        iid = self.incident(Symptom(fnd.symptom), step, Severity(fnd.severity), fnd.message or fnd.symptom,
                            dict(fnd.evidence or {}))
        # A decision on this symptom (now, or after the grace window) belongs to this incident.
        lst = self.unacted.setdefault(fnd.symptom, [])
        if all(i != iid for i, _ in lst):
            lst.append((iid, step))
        return iid

    def take_unacted(self, symptom: str) -> list[tuple[int, int]]:
        """The unacted findings of `symptom`, handed to the decision that acts on them (and forgotten here)."""
        return self.unacted.pop(symptom, [])

    # ------------------------------------------------------------------------------ settling
    def settle_unacted(self, reason: str, before_step: int | None = None) -> None:
        """Findings that never led to a decision (a spike that recovered inside the grace window, as
        BLOOM-176B's did) are resolved without action instead of staying open forever."""
        for symptom, lst in list(self.unacted.items()):
            keep = []
            for iid, step in lst:
                if before_step is None or step < before_step:
                    try:
                        self.store.update_incident_status(iid, IncidentStatus.resolved, reason)
                    except Exception as exc:  # noqa: BLE001 - bookkeeping only
                        log.warning("could not settle incident", id=iid, error=repr(exc))
                else:
                    keep.append((iid, step))
            if keep:
                self.unacted[symptom] = keep
            else:
                self.unacted.pop(symptom, None)

    def verify(self, ckpt_step: int, grace_steps: int) -> None:
        """A checkpoint at `ckpt_step`: an incident whose fix came before it, with no recurrence, is resolved,
        and findings older than the grace window that nothing acted on are settled."""
        self.settle_unacted(f"recovered by itself: no action needed within the {grace_steps}-step grace window "
                            f"(checkpoint at step {ckpt_step})", before_step=ckpt_step - grace_steps)
        for iid, fix in list(self.remedied.items()):
            if ckpt_step > fix.step:
                try:
                    self.store.verify_action(fix.action_id, "effective",
                                             {"verified_by": f"checkpoint at step {ckpt_step}"})
                    self.store.update_incident_status(iid, IncidentStatus.resolved,
                                                      f"training progressed to a checkpoint at step {ckpt_step}")
                except Exception as exc:  # noqa: BLE001 - verification bookkeeping is best effort
                    log.warning("could not resolve incident", id=iid, error=repr(exc))
                self.remedied.pop(iid, None)

    def resolve_all(self, reason: str) -> None:
        """The run completed: every applied fix worked, and nothing still open is left to act on (a finding
        inside its grace window at the end, an internal error of a step that no longer runs or of a control
        request nobody retried, an incident an earlier attempt or daemon left open): all are resolved, their
        reason saying so. Escalated incidents stay as they are: they wait for a human."""
        for iid, fix in list(self.remedied.items()):
            try:
                self.store.verify_action(fix.action_id, "effective", {"verified_by": reason})
                self.store.update_incident_status(iid, IncidentStatus.resolved, reason)
            except Exception as exc:  # noqa: BLE001 - bookkeeping only
                log.warning("could not resolve incident", id=iid, error=repr(exc))
        self.remedied.clear()
        self.unacted.clear()
        run_id = self.position().run_id
        for status in (IncidentStatus.open, IncidentStatus.remediating):
            try:
                left = self.store.list_incidents(run_id, status=status)
            except Exception as exc:  # noqa: BLE001 - bookkeeping only: the run completes all the same
                log.warning("could not list the incidents left open", status=status.value, error=repr(exc))
                continue
            for inc in left:
                try:
                    self.store.update_incident_status(
                        inc.id, IncidentStatus.resolved,
                        f"{reason}: nothing left to act on (still {status.value} when the run completed)")
                except Exception as exc:  # noqa: BLE001 - bookkeeping only
                    log.warning("could not resolve incident", id=inc.id, error=repr(exc))

    def fail_all(self, reason: str) -> None:
        """The run failed: the incidents still waiting for their fix to be verified failed with it."""
        for iid in list(self.remedied):
            try:
                self.store.update_incident_status(iid, IncidentStatus.failed, f"run failed: {reason}")
            except Exception as exc:  # noqa: BLE001 - bookkeeping only
                log.warning("could not fail incident", id=iid, error=repr(exc))
        self.remedied.clear()

    # ------------------------------------------------------------------------------ re-adoption
    def pick_up(self, run_id: str) -> None:
        """A previous daemon's bookkeeping lives in the store, not in its memory: take it up again."""
        for inc in self.store.list_incidents(run_id, status="remediating", with_actions=True):
            if inc.actions:
                self.remedied[inc.id] = Remedied(inc.actions[-1].id, inc.step)
        for inc in self.store.list_incidents(run_id, status="open"):
            self.unacted.setdefault(inc.symptom.value, []).append((inc.id, inc.step))

    def forget_unknown(self, known: set[int]) -> None:
        """A restored store lacks some incidents: forget the in-memory references to them."""
        self.remedied = {k: v for k, v in self.remedied.items() if k in known}
        self.unacted = {s: [(i, st) for i, st in v if i in known] for s, v in self.unacted.items()}
