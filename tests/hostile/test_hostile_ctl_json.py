"""`ulyssesctl ... --json` is strict JSON for every command, also when the run's numbers are hostile: a NaN
loss (exactly what a diverging run reports), an infinite tokens/s, a 1e38 loss. Python's json writes the bare
tokens NaN/Infinity, which jq and other strict parsers refuse; the table must not print a 39-digit loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulyssesd.daemon.operator.ctl import main

REPO = Path(__file__).resolve().parents[2]


def _strict(text: str):
    def refuse(token: str):
        raise AssertionError(f"non-standard JSON token {token} in --json output")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def state_dir(tmp_path) -> Path:
    """Runs whose newest step record carries a NaN loss / an infinite rate / a huge loss, and a finite one."""
    from ulyssesd.daemon.store import open_store

    sd = tmp_path / "state"
    runs = {"nan": {"loss": float("nan"), "tokens_per_s": float("inf")}, "huge": {"loss": 1e38},
            "fine": {"loss": 2.5, "tokens_per_s": 700.0}}
    with open_store(sd / "ulyssesd.db") as store:
        for run_id, fields in runs.items():
            run_dir = sd / "runs" / run_id
            (run_dir / "logs").mkdir(parents=True)
            store.create_run(run_id, run_dir=run_dir, spec={"train": {"steps": 10}}, state="RUNNING")
            store.add_attempt(run_id, command=["train"])
            store.record_incident(run_id, attempt=1, symptom="nan_loss", step=3, summary="loss is NaN",
                                  evidence={"loss": fields["loss"], "window": [1.0, float("nan")]})
            (run_dir / "telemetry.jsonl").write_text(json.dumps({"kind": "step", "step": 3, **fields}) + "\n")
            (run_dir / "logs" / "attempt-1.log").write_text("[rank0]:step 3\n")
    return sd


def _json(capsys, argv, code=0):
    capsys.readouterr()
    assert main(argv) == code
    return _strict(capsys.readouterr().out)


def test_a_nan_loss_and_an_infinite_rate_are_strict_json_strings(state_dir, capsys):
    sd = ["--state-dir", str(state_dir)]
    doc = _json(capsys, [*sd, "--run", "nan", "status", "--json"])
    assert doc["loss"] == "NaN" and doc["tokens_per_s"] == "Infinity"
    assert _json(capsys, [*sd, "--run", "fine", "status", "--json"])["loss"] == 2.5  # finite numbers stay numbers
    incidents = _json(capsys, [*sd, "--run", "nan", "incidents", "--json"])
    assert incidents and all(isinstance(i, dict) for i in incidents)
    one = _json(capsys, [*sd, "incident", str(incidents[0]["id"]), "--json"])
    assert one["id"] == incidents[0]["id"]


@pytest.mark.parametrize("argv, code", [
    (["runs", "--json"], 0), (["status", "--json"], 0), (["incidents", "--json"], 0), (["db", "current", "--json"], 0),
    (["config", "--json"], 4), (["incident", "999", "--json"], 4), (["pause", "--json"], 3), (["stop", "--json"], 3),
])
def test_every_command_answers_strict_json_even_its_errors(state_dir, capsys, argv, code):
    doc = _json(capsys, ["--state-dir", str(state_dir), *argv], code)
    if code:
        assert doc["ok"] is False and doc["exit_code"] == code and doc["error"]


def test_the_table_prints_a_huge_loss_in_e_notation(state_dir, capsys):
    capsys.readouterr()
    assert main(["--state-dir", str(state_dir), "--run", "huge", "status"]) == 0
    text = capsys.readouterr().out
    assert "1.0000e+38" in text and "100000000000000" not in text
    assert main(["--state-dir", str(state_dir), "--run", "fine", "status"]) == 0
    assert "2.5000" in capsys.readouterr().out  # an ordinary loss keeps its 4 decimals


def test_replay_json_of_a_nan_telemetry_is_strict(tmp_path, capsys):
    tele = tmp_path / "telemetry.jsonl"
    tele.write_text('{"kind":"step","step":1,"loss":NaN,"step_time_s":0.1}\n'
                    '{"kind":"step","step":2,"loss":Infinity,"step_time_s":0.1}\n')
    doc = _json(capsys, ["replay", str(tele), "--spec", str(REPO / "configs" / "tiny-cpu.toml"), "--json"])
    assert len(doc["items"]) == 2


@pytest.mark.parametrize("interval", ["inf", "1e308", "86401", "nan", "0", "-1"])
def test_a_watch_interval_that_time_sleep_cannot_take_is_a_usage_error(state_dir, capsys, interval):
    """`--interval inf` passed the old min-only bound and died in time.sleep with an OverflowError traceback."""
    capsys.readouterr()
    assert main(["--state-dir", str(state_dir), "status", "--watch", "--json", "--interval", interval]) == 2
    captured = capsys.readouterr()  # under --json the usage error is JSON on stdout
    assert "--interval" in _strict(captured.out)["error"] and "Traceback" not in captured.err
