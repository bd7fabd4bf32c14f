"""ulyssesctl against a real store written by a real supervised (fake-job) run; the daemon is down."""

from __future__ import annotations

import json

from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.store.enums import RunState


def _json(capsys, argv, code=0):
    capsys.readouterr()
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)


def test_ctl_reads_the_story_of_a_run_with_the_daemon_down(tmp_path, make_sup, capsys):
    spec = fake_spec(tmp_path, steps=30, interval=5, faults=[{"kind": "sigkill", "at_step": 12},
                                                             {"kind": "nan_loss", "at_step": 20, "attempts": [2]}],
                     remediation={"known_good_steps": 2, "rollback_steps_back": 1, "skip_min_batches": 2,
                                  "skip_max_batches": 4})
    sup = make_sup(spec)
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=90)
    sd = ["--state-dir", str(tmp_path / "state")]
    st = _json(capsys, [*sd, "status", "--json"])
    assert st["state"] == "COMPLETED" and st["step"] == 30 and st["daemon"] == "not running"
    assert st["restarts"] == 2 and "data.skip_ranges" in st["config_diff_from_v1"]
    incs = _json(capsys, [*sd, "incidents", "--json"])
    assert [i["symptom"] for i in incs] == ["crash", "nan_loss"]
    only = _json(capsys, [*sd, "incidents", "--json", "--kind", "nan_loss"])
    assert len(only) == 1
    # The listing carries each incident's actions (it printed "actions": [] for every incident before).
    assert [a["kind"] for a in only[0]["actions"]] == ["rollback_skip"]
    inc = _json(capsys, [*sd, "incident", str(only[0]["id"]), "--json"])
    assert inc["actions"][0]["kind"] == "rollback_skip" and "data.skip_ranges" in inc["actions"][0]["config_diff"]
    cfg = _json(capsys, [*sd, "config", "--json"])
    assert cfg["version"] == st["config_version"] and cfg["diff_from_v1"]
    v1 = _json(capsys, [*sd, "config", "--version", "1", "--json"])
    assert v1["config"]["data"]["skip_ranges"] == []
    assert main([*sd, "incident", "999"]) == 4
    assert main([*sd, "config", "--version", "99"]) == 4
    assert main([*sd, "incidents", "--kind", "bogus"]) == 2
    assert main([*sd, "stop"]) == 3  # mutating command, no daemon
    ack = _json(capsys, [*sd, "ack", str(only[0]["id"]), "--by", "alice", "--json"])
    assert ack["via"].startswith("database")
    assert _json(capsys, [*sd, "incident", str(only[0]["id"]), "--json"])["acknowledged_by"] == "alice"
    assert main([*sd, "status"]) == 0  # rich table renders
