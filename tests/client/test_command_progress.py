"""A command job's total steps (`ulyssesctl status`'s "step / total", progress and ETA) is the job's own: what
its telemetry reports (`Reporter(total_steps=...)` / `set_total_steps`, the HF callback's max_steps), else the
spec's `[job] total_steps`, else "unknown", never the built-in job's `[train] steps`. The field is optional
in the telemetry contract: old records stay valid, a bad value is ignored, not fatal. Real supervised runs of
a small script (the client library only, no torch) read back with `ulyssesctl status`."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from uls_client_helpers import run_supervised

from ulyssesd.client import Reporter, schema, validate_record
from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.operator.ctl_status import total_steps_of
from ulyssesd.daemon.spec import run_spec_from_dict
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.remediation.records import parse_record
from ulyssesd.training.spec import SpecError

CMD = {"job": {"kind": "command", "command": ["t.py"]}}


def _rec(**extra):
    return [{"kind": "step", "step": 5, "loss": 1.0, **extra}]


@pytest.mark.parametrize(("spec", "config", "recent", "expect"), [
    ({}, {"train": {"steps": 60}}, _rec(total_steps=7), (60, "train.steps")),  # builtin: its config
    (CMD, {"train": {"steps": 100}}, _rec(total_steps=40), (40, "job telemetry")),
    ({"job": {**CMD["job"], "total_steps": 50}}, {"train": {"steps": 100}}, _rec(total_steps=40),
     (40, "job telemetry")),  # the job's own report wins over the spec's declaration
    ({"job": {**CMD["job"], "total_steps": 50}}, {"train": {"steps": 100}}, _rec(), (50, "job.total_steps")),
    (CMD, {"train": {"steps": 100}}, _rec(), (None, None)),  # unknown: not the builtin's 100
    (CMD, {"train": {"steps": 100}}, [], (None, None)),
    (CMD, {}, _rec(total_steps=True), (None, None)),  # garbage is ignored, not shown
    (CMD, {}, _rec(total_steps=0), (None, None)),
    (CMD, {}, _rec(total_steps="60"), (None, None)),
])
def test_where_a_runs_total_comes_from(spec, config, recent, expect):
    assert total_steps_of(spec, config, recent) == expect


def test_the_reporters_total_is_in_every_step_record_and_stays_within_the_contract(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    with Reporter(path, attempt=1, config_version=1, rank=0, total_steps=30) as rep:
        rep.step(1, 2.0)
        rep.set_total_steps(45)  # learnt later (e.g. the Trainer's max_steps at train begin)
        rep.step(2, 1.9)
        rep.set_total_steps(None)
        rep.step(3, 1.8)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("total_steps") for r in recs] == [30, 45, None]
    import jsonschema

    tele = jsonschema.Draft202012Validator(schema("telemetry-record"))
    for r in recs:
        assert validate_record(r) == [] and tele.is_valid(r), r
        parse_record(r)
    # Old records (no total) and odd values from other producers: accepted by the daemon, flagged to producers.
    assert parse_record({"kind": "step", "step": 1, "loss": 1.0, "total_steps": "many"}).step == 1
    assert tele.is_valid({"kind": "step", "step": 1, "loss": 1.0, "total_steps": "many"})
    assert validate_record({"v": 1, "kind": "step", "step": 1, "loss": 1.0, "total_steps": 0})
    assert validate_record({"v": 1, "kind": "step", "step": 1, "loss": 1.0}) == []
    for bad in (0, -3, True, 2.5, "60"):
        with pytest.raises(ValueError, match="total_steps"):
            Reporter(path, rank=1, total_steps=bad)


def test_a_declared_total_is_a_command_jobs_only_and_positive():
    assert run_spec_from_dict({"job": {**CMD["job"], "total_steps": 12}}).job_section.total_steps == 12
    with pytest.raises(SpecError, match="total_steps is only used with kind='command'"):
        run_spec_from_dict({"job": {"total_steps": 12}})
    with pytest.raises(SpecError, match="total_steps"):
        run_spec_from_dict({"job": {**CMD["job"], "total_steps": 0}})


SCRIPT = r'''
import os, sys, time
from ulyssesd.client import Reporter
total = int(os.environ.get("REPORT_TOTAL", "0")) or None
with Reporter(total_steps=total) as rep:
    rep.event("started", 0)
    for step in range(1, 13):
        time.sleep(0.05)
        rep.step(step, 2.0 / step)
    rep.event("exiting", 12, reason="completed")
'''


def _write_spec(tmp: Path, job_extra: dict, env: dict[str, str]) -> Path:
    script = tmp / "reporting_job.py"
    script.write_text(SCRIPT)
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    job = {"kind": "command", "command": [str(script)], **job_extra}
    lines = ["[run]", 'name = "progress"', "[job]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in job.items()]
    lines += ["[train]", "steps = 999",  # the built-in job's length: a command job's status must not show it
              "[launcher]", 'kind = "local"', f"python = {json.dumps(sys.executable)}",
              "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }",
              "[daemon]", f"state_dir = {json.dumps(str(tmp / 'state'))}", f"socket_path = {json.dumps(str(sock))}",
              "tick_s = 0.1", "preflight = false", "early_death_s = 0.5"]
    (tmp / "run.toml").write_text("\n".join(lines) + "\n")
    return tmp / "run.toml"


@pytest.mark.parametrize(("job_extra", "env", "row", "source"), [
    ({"total_steps": 50}, {"REPORT_TOTAL": "12"}, "12 / 12 (100.0%)", "job telemetry"),
    ({"total_steps": 24}, {}, "12 / 24 (50.0%)", "job.total_steps"),
    ({}, {}, "12 / unknown", None),
])
def test_status_of_a_finished_command_job_shows_the_jobs_own_total(tmp_path, capsys, job_extra, env, row, source):
    sup, say = run_supervised(_write_spec(tmp_path, job_extra, env), timeout=90)
    assert sup.state == RunState.COMPLETED and sup.last_step == 12, say
    sd = ["--state-dir", str(tmp_path / "state")]
    capsys.readouterr()
    assert main([*sd, "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["total_steps_source"] == source and st["step"] == 12
    assert (st["progress"] is None) == (source is None)
    assert main([*sd, "status"]) == 0
    table = capsys.readouterr().out
    assert row in table and "999" not in table, table
    assert main([*sd, "runs"]) == 0
    assert row.split(" (")[0] in capsys.readouterr().out
