"""The incidents listing reads a bounded number of statements however many incidents there are: one query for
the incidents joined with all their actions (`Store.list_incidents(with_actions=True)`), not one per incident
(the table's action column read each incident's actions on its own before: 200 incidents, 200+ queries).
Counted with SQLAlchemy's `before_cursor_execute` on a real SQLite store, through `ulyssesctl` itself."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.store import open_store


@contextmanager
def counted():
    """Every SQL statement any engine runs meanwhile (SQLite's connection pragmas included)."""
    seen: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", count)


def _store_with(tmp_path, n: int):
    """Two runs; the newer one has `n` incidents, every other one with two actions (a hot fix, its stop)."""
    store = open_store(tmp_path / "state" / "ulyssesd.db")
    store.create_run("old-run", run_dir=str(tmp_path / "old"))
    store.record_incident("old-run", attempt=1, symptom="crash", step=1, summary="old crash")
    store.create_run("new-run", run_dir=str(tmp_path / "new"))
    for i in range(n):
        iid = store.record_incident("new-run", attempt=1, symptom="loss_spike", step=i, summary=f"spike {i}")
        if i % 2 == 0:
            store.record_action("new-run", "hot_control", incident_id=iid, mode="hot",
                                config_diff={"train.gradient_clipping": [1.0, 0.5]})
            store.record_action("new-run", "stop", incident_id=iid)
    store.close()
    return ["--state-dir", str(tmp_path / "state")]


def _ctl(capsys, argv):
    capsys.readouterr()
    with counted() as statements:
        assert main(argv) == 0
    return capsys.readouterr().out, statements


@pytest.mark.parametrize("extra", [[], ["--json"], ["--all-runs", "--json"], ["--kind", "loss_spike"]],
                         ids=["table", "json", "all runs json", "filtered table"])
def test_the_listing_costs_the_same_statements_for_20_and_200_incidents(tmp_path, capsys, extra):
    small = _ctl(capsys, [*_store_with(tmp_path / "small", 20), "incidents", *extra])[1]
    out, big = _ctl(capsys, [*_store_with(tmp_path / "big", 200), "incidents", *extra])
    assert len(big) == len(small) <= 12, (len(small), len(big), big)
    if "--json" in extra:
        rows = json.loads(out)
        assert len(rows) == 200 + ("--all-runs" in extra)
        by_summary = {r["summary"]: [a["kind"] for a in r["actions"]] for r in rows}
        assert by_summary["spike 0"] == ["hot_control", "stop"] and by_summary["spike 1"] == []
    else:
        assert "hot_control (hot), stop" in out


def test_the_store_listing_carries_each_incidents_actions_in_one_statement(tmp_path):
    _store_with(tmp_path, 200)
    store = open_store(tmp_path / "state" / "ulyssesd.db", readonly=True)
    store.list_incidents("new-run")  # the connection's own set-up statements are not the listing's
    with counted() as statements:
        rows = store.list_incidents("new-run", with_actions=True)
    assert len(rows) == 200 and [a.kind.value for a in rows[0].actions] == ["hot_control", "stop"]
    assert rows[1].actions == () and rows[0].actions[0].config_diff == {"train.gradient_clipping": [1.0, 0.5]}
    queries = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(queries) == 1, queries
    newest = store.list_incidents("new-run", with_actions=True, limit=3, newest_first=True)
    assert [r.summary for r in newest] == ["spike 199", "spike 198", "spike 197"]
    assert [len(r.actions) for r in newest] == [0, 2, 0]  # the limit applies to the incidents, not the actions
    # The counter can fail: reading each incident's actions on its own (what the table did) is one per incident.
    with counted() as statements:
        for r in rows:
            store.list_actions(incident_id=r.id)
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 200
    store.close()
