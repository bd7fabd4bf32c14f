"""Restarts counted apart from operator relaunches (`Store.relaunch_counts` / `list_relaunches`), on the
transitions the supervisor writes: a pause + resume or an operator restart is not a restart; a crash is, also
right after a resumed attempt whose own launch transition quotes the operator's command."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from ulyssesd.daemon.store import NotFoundError
from ulyssesd.daemon.store.enums import RunState as S

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _attempt(store, run_id: str, n: int, at: float, reason: str) -> None:
    """What the supervisor's launch writes: the attempt row, then (not from STARTING) its launch transition."""
    store.add_attempt(run_id, number=n, command=["python", "-m", "job"], started_at=_at(at))
    store.set_run_state(run_id, S.STARTING, f"attempt {n} launched ({reason}) from global_step8", attempt=n,
                        at=_at(at + 0.01))
    store.set_run_state(run_id, S.RUNNING, f"attempt {n} is training", attempt=n, at=_at(at + 1))


def test_pause_resume_is_an_operator_relaunch_and_the_crash_after_it_the_one_restart(store, run_id):
    store.add_attempt(run_id, number=1, command=["python", "-m", "job"], started_at=_at(0))
    store.set_run_state(run_id, S.RUNNING, "attempt 1 is training", attempt=1, at=_at(1))
    assert (store.relaunch_counts(run_id).restarts, store.list_relaunches(run_id)) == (0, [])

    store.set_run_state(run_id, S.STOPPING, "operator pause (uid 1000)", attempt=1, at=_at(10))
    store.set_run_state(run_id, S.PAUSED, "job exited, paused", attempt=1, at=_at(11))
    _attempt(store, run_id, 2, 20, "operator resume")
    # Attempt 2 crashes: its relaunch window holds "attempt 2 launched (operator resume)", which is not the
    # operator's command (that came before attempt 2 started) and must not make the crash an operator relaunch.
    store.set_run_state(run_id, S.BACKOFF, "relaunch in 0.2s (crash: signal 9)", attempt=2, at=_at(30))
    _attempt(store, run_id, 3, 31, "crash: signal 9")

    counts = store.relaunch_counts(run_id)
    assert (counts.restarts, counts.operator_relaunches) == (1, 1)
    assert [(r.attempt, r.by_operator) for r in store.list_relaunches(run_id)] == [(2, True), (3, False)]

    store.set_run_state(run_id, S.RESTARTING, "operator restart", attempt=3, at=_at(40))
    _attempt(store, run_id, 4, 41, "operator restart")
    assert store.relaunch_counts(run_id).to_dict() == {"restarts": 1, "operator_relaunches": 2}


def test_without_operator_commands_every_relaunch_is_a_restart(store, run_id):
    store.add_attempt(run_id, number=1, command=["python"], started_at=_at(0))
    for n in (2, 3):
        store.set_run_state(run_id, S.REMEDIATING, "cuda_oom: halve micro-batch", attempt=n - 1, at=_at(n * 10))
        store.set_run_state(run_id, S.RESTARTING, "cuda_oom: stopping attempt to apply", at=_at(n * 10 + 1))
        _attempt(store, run_id, n, n * 10 + 2, "cuda_oom")
    assert store.relaunch_counts(run_id).to_dict() == {"restarts": 2, "operator_relaunches": 0}


def test_relaunch_counts_of_an_unknown_run_is_an_error(store):
    with pytest.raises(NotFoundError, match="no run 'nope'"):
        store.relaunch_counts("nope")
