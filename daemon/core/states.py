"""The supervisor's run state machine: one explicit transition table, nothing implicit.

Every allowed edge carries the reason it exists. `check_transition` is the only gate; the supervisor
records each transition in the store with its reason, so `ulyssesctl incident`/`status` can tell the
story of a run from the table alone.
"""

from __future__ import annotations

from ulyssesd.daemon.store.enums import TERMINAL_RUN_STATES, RunState

S = RunState

# (from, to): why the edge exists. Into STOPPING the table says only what happens ("job asked to stop": SIGTERM,
# its final save): a stop, a pause, a playbook stop and an internal error all take it, and the caller says which.
TRANSITIONS: dict[tuple[RunState, RunState], str] = {
    # STARTING -> RUNNING because the job emitted `started` or its first step record.
    (S.STARTING, S.RUNNING): "job reported progress",
    # STARTING -> BACKOFF because the attempt died before making progress (launch failure / early crash).
    (S.STARTING, S.BACKOFF): "attempt died before progress",
    # STARTING -> RESTARTING because a crash during start-up was diagnosed and a fix must be relaunched.
    (S.STARTING, S.RESTARTING): "crash during start-up, relaunching",
    # STARTING -> FAILED because the launcher cannot be started at all (retries exhausted) or budget is spent.
    (S.STARTING, S.FAILED): "launch impossible or budget spent",
    # STARTING -> STOPPING because the operator asked to stop before the job got going.
    (S.STARTING, S.STOPPING): "job asked to stop",
    # STARTING -> COMPLETED because a resumed job found nothing left to train and exited 0.
    (S.STARTING, S.COMPLETED): "job finished immediately",
    # STARTING -> REMEDIATING because a detector fired on the first records (e.g. NaN at step 1).
    (S.STARTING, S.REMEDIATING): "detector fired during start-up",
    # RUNNING -> REMEDIATING because a detector or the crash path produced a decision to apply.
    (S.RUNNING, S.REMEDIATING): "anomaly detected",
    # RUNNING -> RESTARTING because the job crashed and the playbook says relaunch, or the operator restarted.
    (S.RUNNING, S.RESTARTING): "crash or restart, relaunching",
    # RUNNING -> BACKOFF because the job crashed and the next launch must wait.
    (S.RUNNING, S.BACKOFF): "crash, waiting before relaunch",
    # RUNNING -> PAUSED because the operator paused (the job saved and exited on SIGTERM).
    (S.RUNNING, S.PAUSED): "operator pause",
    # RUNNING -> STOPPING because the operator asked to stop, or a `stop` decision.
    (S.RUNNING, S.STOPPING): "job asked to stop",
    # RUNNING -> COMPLETED because the job reached train.steps and exited 0.
    (S.RUNNING, S.COMPLETED): "reached final step",
    # RUNNING -> FAILED because the restart budget / no-progress rule was hit on a crash.
    (S.RUNNING, S.FAILED): "budget exhausted or an unrecoverable error",
    # REMEDIATING -> RUNNING because the decision was hot (control.json) or observe-only: no restart.
    (S.REMEDIATING, S.RUNNING): "hot fix applied",
    # REMEDIATING -> RESTARTING because the decision needs a relaunch (new config version / rollback).
    (S.REMEDIATING, S.RESTARTING): "fix needs a relaunch",
    # REMEDIATING -> BACKOFF because the job exited while we remediated and the relaunch must wait.
    (S.REMEDIATING, S.BACKOFF): "waiting before relaunch",
    # REMEDIATING -> STOPPING because the ladder is exhausted (stop + alert) or the operator stopped.
    (S.REMEDIATING, S.STOPPING): "job asked to stop",
    # REMEDIATING -> FAILED because the restart budget / no-progress rule forbids another attempt.
    (S.REMEDIATING, S.FAILED): "budget exhausted or an unrecoverable error",
    # REMEDIATING -> COMPLETED because the job finished its last step while we were acting.
    (S.REMEDIATING, S.COMPLETED): "reached final step",
    # REMEDIATING -> PAUSED because the operator paused during a remediation.
    (S.REMEDIATING, S.PAUSED): "operator pause",
    # RESTARTING -> STARTING because the new attempt has been launched.
    (S.RESTARTING, S.STARTING): "next attempt launched",
    # RESTARTING -> BACKOFF because the launch must wait (restart spacing or launch error).
    (S.RESTARTING, S.BACKOFF): "waiting before relaunch",
    # RESTARTING -> FAILED because the budget is spent or no checkpoint can be loaded.
    (S.RESTARTING, S.FAILED): "cannot relaunch",
    # RESTARTING -> STOPPING because the operator asked to stop while we were relaunching.
    (S.RESTARTING, S.STOPPING): "job asked to stop",
    # RESTARTING -> COMPLETED because the job finished while being asked to restart.
    (S.RESTARTING, S.COMPLETED): "reached final step",
    # RESTARTING -> PAUSED because the operator paused while the old attempt was shutting down.
    (S.RESTARTING, S.PAUSED): "operator pause",
    # BACKOFF -> STARTING because the backoff delay elapsed and the next attempt was launched.
    (S.BACKOFF, S.STARTING): "backoff elapsed, next attempt launched",
    # BACKOFF -> FAILED because the launch failed again and retries/budget are exhausted.
    (S.BACKOFF, S.FAILED): "cannot relaunch",
    # BACKOFF -> STOPPED because the operator stopped a run that had no live job.
    (S.BACKOFF, S.STOPPED): "operator stop with no live job",
    # BACKOFF -> PAUSED because the operator paused while we waited.
    (S.BACKOFF, S.PAUSED): "operator pause",
    # PAUSED -> STARTING because the operator resumed (relaunch from latest valid checkpoint).
    (S.PAUSED, S.STARTING): "operator resume",
    # PAUSED -> STOPPED because the operator stopped a paused run (no job to signal).
    (S.PAUSED, S.STOPPED): "operator stop while paused",
    # STOPPING -> STOPPED because the job exited after the stop request (operator stop).
    (S.STOPPING, S.STOPPED): "job exited after stop",
    # STOPPING -> FAILED because the stop came from an exhausted ladder or an internal error: the run did not make it.
    (S.STOPPING, S.FAILED): "stopped by the playbook or an internal error",
    # STOPPING -> COMPLETED because the job reached its final step while stopping.
    (S.STOPPING, S.COMPLETED): "reached final step",
    # STOPPING -> PAUSED because the stop was a pause (the job saved and exited).
    (S.STOPPING, S.PAUSED): "paused after save",
}

TERMINAL = TERMINAL_RUN_STATES

#: States in which a job process is expected to be alive (or about to be) for re-adoption.
LIVE_JOB_STATES = frozenset({S.STARTING, S.RUNNING, S.REMEDIATING, S.RESTARTING, S.STOPPING})


class IllegalTransition(RuntimeError):
    """A transition that the table does not allow; a bug in the supervisor, never silently ignored."""


def can_transition(src: RunState, dst: RunState) -> bool:
    return (src, dst) in TRANSITIONS


#: Words too small to say what a reason is about ("stop requested" and "operator stop" share "stop", not "or").
_FILLER_WORDS = frozenset({"a", "an", "the", "of", "in", "on", "by", "or", "and", "to", "its", "it", "is", "was",
                           "with", "after", "before", "for", "at", "from", "while", "no", "not", "be"})


def _content_words(text: str) -> set[str]:
    words = "".join(c if c.isalnum() or c in "_-" else " " for c in text.lower()).split()
    return {w for w in words if w not in _FILLER_WORDS}


def transition_reason(reason: str, table_reason: str) -> str:
    """The one line recorded for a transition: the caller's reason, with the table's reason for the edge in
    parentheses only when it is about something else. Sharing a word means the caller already said it in
    its own, more precise, words: "job exited after operator stop" needs no "(job exited after stop)",
    "operator stop by uid 0" no "(job asked to stop)", "internal error in engine: ..." no "(... or an
    unrecoverable error)"; "nan_loss: lr -10%" gets "(anomaly detected)"."""
    if _content_words(table_reason) & _content_words(reason):
        return reason
    return f"{reason} ({table_reason})"


def check_transition(src: RunState, dst: RunState) -> str:
    """Return the table's reason for src -> dst, or raise IllegalTransition naming both states."""
    if src in TERMINAL:
        raise IllegalTransition(f"run is {src.value} (terminal); cannot move to {dst.value}")
    try:
        return TRANSITIONS[(src, dst)]
    except KeyError:
        allowed = sorted(d.value for (s, d) in TRANSITIONS if s == src)
        raise IllegalTransition(
            f"illegal run state transition {src.value} -> {dst.value}; allowed from {src.value}: {allowed}"
        ) from None
