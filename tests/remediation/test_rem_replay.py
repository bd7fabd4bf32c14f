"""Replay: a synthetic 5,000-step run with an injected spike, a NaN and a slow-rank period reports each at
the right step and nothing else; realistic noisy runs report nothing; the CLI streams a file, skipping
garbage lines with their line number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ulyssesd.daemon.operator import ctl_offline
from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision
from ulyssesd.remediation.records import parse_record
from ulyssesd.remediation.replay import replay
from ulyssesd.remediation.synthetic import Injection, TraceSpec, trace

SPIKE, NAN, SLOW = 1200, 2500, 3500


def _faulty() -> TraceSpec:
    return TraceSpec(steps=5000, seed=11, injections=[Injection("spike", SPIKE, 1, 3.0), Injection("nan", NAN),
                                                      Injection("slow_rank", SLOW, 200, 1.6)])


def test_replay_reports_each_injected_fault_at_the_right_step_and_nothing_else():
    items = list(replay(parse_record(d) for d in trace(_faulty())))
    findings = [(i.item.symptom, i.step) for i in items if isinstance(i.item, Finding)]
    onsets = sorted({(s, i.item.evidence["since_step"]) for i in items if isinstance(i.item, Finding)
                     for s in [i.item.symptom]})
    # One episode per injected fault, starting where it was injected (the straggler needs 10 steps to persist).
    assert onsets == [("loss_spike", SPIKE), ("nan_loss", NAN), ("straggler", SLOW + 9)]
    assert findings[0] == ("loss_spike", SPIKE) and findings[1] == ("nan_loss", NAN)
    assert all(SLOW <= s < SLOW + 200 for sym, s in findings if sym == "straggler")
    decisions = [(i.item.symptom, i.item.action_kind, i.step) for i in items if isinstance(i.item, Decision)]
    # The one-step spike recovers inside the grace window: no decision. The NaN rolls back at once.
    assert decisions[0] == ("nan_loss", "rollback_skip", NAN)
    assert [d[:2] for d in decisions[1:]] == [("straggler", "collect_evidence"), ("straggler", "alert")]
    nan_decision = next(i.item for i in items if isinstance(i.item, Decision))
    assert nan_decision.rollback_tag == "step-00002000"


def test_replay_without_time_uses_step_times_as_clock():
    recs = []
    for d in trace(_faulty()):
        d.pop("time", None)
        recs.append(parse_record(d))
    items = list(replay(recs))
    assert {(i.item.symptom, i.item.evidence["since_step"]) for i in items if isinstance(i.item, Finding)} == {
        ("loss_spike", SPIKE), ("nan_loss", NAN), ("straggler", SLOW + 9)}
    assert all(i.time == pytest.approx(i.step * 1.0, rel=0.1) for i in items)


@pytest.mark.parametrize("seed", range(4))
def test_realistic_noisy_loss_curve_raises_nothing(seed):
    # Power-law decay + 2-5 % noise + small bumps every 300-700 steps + GC hiccups + checkpoints.
    spec = TraceSpec(steps=5000, seed=100 + seed, loss_noise=0.02 + 0.01 * seed, bump_every=300 + 100 * seed)
    items = list(replay(parse_record(d) for d in trace(spec)))
    assert items == [], [(i.item.symptom, i.step) for i in items]


def test_observe_mode_from_a_spec_file(tmp_path: Path):
    tel = tmp_path / "telemetry.jsonl"
    with tel.open("w") as fh:
        for n, d in enumerate(trace(_faulty())):
            fh.write(json.dumps(d) + "\n")
            if n == 10:
                fh.write("{not json\n")
            if n == 20:
                fh.write('{"kind": "step", "loss": 1.0}\n')
    spec = tmp_path / "run.toml"
    spec.write_text('[remediation]\nmode = "observe"\n[detectors]\nstraggler_persist_steps = 30\n')
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """test app"""

    ctl_offline.register(app)
    res = CliRunner().invoke(app, ["replay", str(tel), "--spec", str(spec), "--json"])
    assert res.exit_code == 0, res.output
    body = res.output[res.output.index("{"):res.output.rindex("}") + 1]
    doc = json.loads(body)
    assert [b["line"] for b in doc["bad_lines"]] == [12, 23]
    assert "missing required field 'step'" in doc["bad_lines"][1]["error"]
    straggler = [i for i in doc["items"] if i["type"] == "finding" and i["symptom"] == "straggler"]
    assert straggler[0]["step"] == SLOW + 29  # the spec's threshold was used
    decisions = [i for i in doc["items"] if i["type"] == "decision"]
    assert decisions and all(d["apply"] == "none" and d["reason"].startswith("observe-only") for d in decisions)
    assert decisions[0]["would_apply"] == "rollback_skip" and decisions[0]["config_patch"]["data.skip_ranges"]

    table = CliRunner().invoke(app, ["replay", str(tel)])
    assert table.exit_code == 0 and "nan_loss" in table.output and "rollback_skip" in table.output
    assert f"{tel}:12: skipped: not JSON" in table.output

    missing = CliRunner().invoke(app, ["replay", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    bad_spec = tmp_path / "bad.toml"
    bad_spec.write_text("[detectors]\nloss_spike_madd = 3\n")
    res = CliRunner().invoke(app, ["replay", str(tel), "--spec", str(bad_spec)])
    assert res.exit_code == 2 and "loss_spike_madd" in res.output


def test_replay_accepts_configs_and_job_values():
    recs = [parse_record(d) for d in trace(_faulty())]
    items = list(replay(recs, DetectorsConfig(loss_spike_mad=200.0), RemediationConfig(), {"train.lr": 1e-4}))
    assert "loss_spike" not in {i.item.symptom for i in items}  # a looser threshold misses the 3x spike


def test_replay_reports_a_hang_gap_but_not_the_gap_between_attempts():
    from ulyssesd.remediation.records import EventRecord, StepRecord

    def steps(a, b, t0, attempt):
        return [StepRecord(step=s, loss=2.0, time=t0 + (s - a), attempt=attempt, step_time_s=1.0) for s in range(a, b)]
    # Attempt 1 stalls for 500 s after step 199 (a hang), then crashes; attempt 2 starts 300 s later.
    recs = steps(1, 200, 0.0, 1) + steps(200, 300, 700.0, 1) + [
        EventRecord("started", step=250, time=1100.0, attempt=2)] + steps(251, 400, 1130.0, 2)
    items = list(replay(recs))
    hangs = [i for i in items if isinstance(i.item, Finding) and i.item.symptom == "hang"]
    assert [(h.step, h.item.evidence["last_step"]) for h in hangs] == [(199, 199)]
    assert hangs[0].time == 700.0
