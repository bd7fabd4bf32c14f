"""The store's listings at the scale of a long run: the incidents with their actions in one joined query give
what the per-incident reads gave; pages (`limit` + `before_id`) cover a listing exactly once; counts match the
listings; the newest attempt and the newest actions are read without the rest; only rollbacks feed goodput."""

from __future__ import annotations

import pytest

from ulyssesd.daemon.store.errors import InvalidValueError


def _fill(store, n: int = 40) -> list[int]:
    store.create_run("run-a", run_dir="/tmp/a")
    store.create_run("run-b", run_dir="/tmp/b")
    store.record_incident("run-a", attempt=1, symptom="crash", step=3, summary="other run")
    ids = []
    for i in range(n):
        iid = store.record_incident("run-b", attempt=1 + i // 10, symptom=("loss_spike", "hang", "slow_step")[i % 3],
                                    step=i, summary=f"incident {i}")
        ids.append(iid)
        if i % 3 == 0:
            store.record_action("run-b", "hot_control", incident_id=iid, mode="hot",
                                config_diff={"train.gradient_clipping": [1.0, 0.5]})
        if i % 5 == 0:
            store.record_action("run-b", "restart", incident_id=iid, mode="restart",
                                parameters={"rollback_to_step": i - 1} if i % 10 == 0 else {"why": "crash"})
        if i % 4 == 0:
            store.update_incident_status(iid, "resolved", "done")
    store.record_action("run-b", "rollback_skip", mode="restart")  # no incident
    return ids


def test_the_joined_listing_equals_reading_each_incidents_actions(store):
    _fill(store)
    for kw in ({}, {"run_id": "run-b"}, {"run_id": "run-b", "status": "resolved"}, {"symptom": "hang"},
               {"run_id": "run-b", "limit": 7, "newest_first": True}, {"run_id": "run-b", "before_id": 20}):
        joined = store.list_incidents(**kw, with_actions=True)
        plain = store.list_incidents(**kw)
        assert [r.id for r in joined] == [r.id for r in plain] and plain
        for j, p in zip(joined, plain, strict=True):
            assert j.replace(actions=()) == p
            assert j.actions == tuple(store.list_actions(incident_id=p.id))
    assert any(r.actions for r in store.list_incidents("run-b", with_actions=True))


def test_pages_cover_the_listing_once_in_order(store):
    ids = _fill(store, 40)
    everything = [r.id for r in store.list_incidents("run-b", newest_first=True)]
    assert everything == ids[::-1]
    pages, before = [], None
    while True:
        page = store.list_incidents("run-b", limit=7, before_id=before, newest_first=True, with_actions=True)
        if not page:
            break
        assert len(page) <= 7
        pages.append([r.id for r in page])
        before = page[-1].id
    assert [i for p in pages for i in p] == everything and len(pages) == 6
    # A filtered listing pages the same way, and its count is its length.
    hangs = store.list_incidents("run-b", symptom="hang")
    assert store.count_incidents("run-b", symptom="hang") == len(hangs) == 13
    assert store.count_incidents("run-b", symptom="hang", before_id=hangs[5].id) == 5
    assert store.count_incidents() == 41 and store.count_incidents("run-b", status="resolved") == 10
    with pytest.raises(InvalidValueError, match="limit"):
        store.list_incidents("run-b", limit=-1)


def test_newest_actions_attempt_and_the_rollbacks(store):
    _fill(store)
    every = store.list_actions("run-b")
    assert store.list_actions("run-b", limit=3) == every[-3:]
    assert store.count_actions("run-b") == len(every) and store.count_actions("run-a") == 0
    rollbacks = store.list_actions("run-b", rollbacks=True)
    # The old filter, in Python: a rollback kind, or parameters naming a rollback step.
    assert rollbacks == [a for a in every if a.kind.value == "rollback_skip"
                         or (a.parameters or {}).get("rollback_to_step") is not None]
    assert len(rollbacks) == 5  # steps 0, 10, 20, 30 and the bare rollback_skip; the crash restarts are not
    assert store.latest_attempt("run-b") is None
    for n in (1, 2, 3):
        store.add_attempt("run-b", command=["python", "train.py"], number=n)
    assert store.latest_attempt("run-b").number == 3 and store.latest_attempt("run-a") is None


def test_ladder_rungs_is_what_the_actions_parameters_and_incident_steps_say(store):
    _fill(store)
    iid = store.record_incident("run-b", attempt=9, symptom="nan_loss", step=77)
    store.record_action("run-b", "rollback_skip", incident_id=iid, mode="restart",
                        parameters={"ladder": "loss", "rung": "rollback_skip", "rollback_to_step": 70})
    store.record_action("run-b", "hot_control", mode="hot", parameters={"ladder": "loss", "rung": "lr_cut"})
    store.record_action("run-b", "restart", incident_id=iid, parameters={"ladder": 3, "rung": None})
    other = store.record_incident("run-a", attempt=1, symptom="hang", step=5)
    store.record_action("run-a", "restart", incident_id=other, parameters={"ladder": "hang", "rung": "restart"})
    # The derivation from full records (what re-adoption did before), for comparison.
    steps = {i.id: i.step for i in store.list_incidents("run-b")}
    expected = [(a.parameters.get("ladder"), a.parameters.get("rung"), steps.get(a.incident_id, 0))
                for a in store.list_actions("run-b") if (a.parameters or {}).get("ladder") is not None]
    assert store.ladder_rungs("run-b") == expected == [("loss", "rollback_skip", 77), ("loss", "lr_cut", 0),
                                                      (3, None, 77)]
    assert store.ladder_rungs("run-a") == [("hang", "restart", 5)]


def test_restart_actions_are_those_on_the_attempts_incidents(store):
    _fill(store)
    for attempt in (1, 2, 4, 9):
        incidents = {i.id for i in store.list_incidents("run-b") if i.attempt == attempt}
        expected = [a for a in store.list_actions("run-b")
                    if a.incident_id in incidents and a.mode.value == "restart" and not a.observe_only]
        assert store.restart_actions("run-b", attempt) == expected
    assert store.restart_actions("run-b", 1)  # the comparison saw some
    iid = store.record_incident("run-b", attempt=7, symptom="crash", step=999)
    store.record_action("run-b", "restart", incident_id=iid, mode="restart", observe_only=True)
    assert store.restart_actions("run-b", 7) == []
