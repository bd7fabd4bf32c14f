"""The job's `in_process_restart` event (docs/CONTRACTS.md) recorded on an incident.

`path: "in_process"`: the job dropped a failed step and restored its host-memory snapshot in the same process
(no new process, no disk read); the incident (nan_loss for a non-finite loss, crash for an exception) gets the
job's action (`rollback_skip` / `restart`, mode `hot`, parameters `path`, `tag`, `restored_step`, `seconds`,
...) and is resolved at once: the process never stopped. `path: "fallback"`: the job could not restore in
process (why: `fallback_reason`); the incident stays open with that evidence and the usual path handles it
(the NaN step record reaches the detectors, or the crash reaches the exit handling), on the same incident
where the store deduplicates it (run, attempt, symptom, step).
Takes its collaborators as parameters (the incident log, the store, the say callable), not the supervisor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ulyssesd.daemon.store.enums import ActionKind, ApplyMode, IncidentStatus, Severity, Symptom

#: Fields of the event copied into the incident's evidence / the action's parameters.
_FIELDS = ("path", "reason", "error", "failed_step", "tag", "restored_step", "seconds", "verify_seconds",
           "load_seconds", "from_memory", "disk_reads", "skipped_samples", "loss", "restarts", "fallback_reason")


def record_in_process_restart(incidents: Any, store: Any, say: Callable[[str], None], step: int | None,
                              fields: dict[str, Any]) -> int:
    """Record one `in_process_restart` event; returns the incident id."""
    nan = fields.get("reason") == "nan_loss"
    symptom = Symptom.nan_loss if nan else Symptom.crash
    at = int(fields.get("failed_step") or step or 0)
    facts = {k: fields[k] for k in _FIELDS if k in fields} | {"source": "job"}
    if fields.get("path") == "in_process":
        iid = incidents.incident(symptom, at, Severity.warning,
                                 f"step {at} dropped ({fields.get('reason')}): {fields.get('error')}", facts)
        incidents.action(iid, ActionKind.rollback_skip if nan else ActionKind.restart,
                         facts | {"rung": "in_process_restart", "apply": "in_process"}, {}, ApplyMode.hot)
        store.update_incident_status(iid, IncidentStatus.resolved,
                                     f"the job restored {fields.get('tag')} from host memory in-process "
                                     f"in {fields.get('seconds')} s (no new process, no disk read)")
        say(f"  step {at} dropped ({fields.get('reason')}); {fields.get('tag')} restored in-process from host "
            f"memory in {fields.get('seconds')} s")
        return iid
    iid = incidents.incident(symptom, at, Severity.warning,
                             f"in-process restart not possible at step {at}: {fields.get('fallback_reason')}", facts)
    say(f"  in-process restart not possible at step {at} ({fields.get('fallback_reason')}); the usual path follows")
    return iid
