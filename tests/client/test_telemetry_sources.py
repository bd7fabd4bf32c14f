"""Derived telemetry sources beside the log parser: HF trainer_state.json and TensorBoard event files read
into the run's telemetry file, and the silence watch that says (journal, webhook, health file for status) when
a running job's output gives no step record, with the setting that fixes it and the line it did not read."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from ulyssesd.daemon.telemetry import log_source
from ulyssesd.daemon.telemetry.framework_files import tag_role
from ulyssesd.remediation.records import parse_record


def _sup(tmp_path: Path, telemetry: dict, clock: list[float]) -> SimpleNamespace:
    (tmp_path / "logs").mkdir(exist_ok=True)
    said, alerts = [], []
    return SimpleNamespace(config={"telemetry": telemetry, "job": {"kind": "command", "total_steps": 30}},
                           attempt=1, run_dir=tmp_path, config_version=1, run_id="r1", job=object(),
                           os=SimpleNamespace(time=lambda: clock[0]), said=said, alerts=alerts,
                           say=said.append, alert=lambda event, text, **kw: alerts.append((event, text, kw)))


def _records(tmp_path: Path) -> list[dict]:
    path = tmp_path / log_source.STDOUT_TELEMETRY_NAME
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for r in recs:
        parse_record(r)
    return recs


def test_a_job_whose_lines_are_not_understood_is_reported_once_with_the_fix_and_the_line(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, {"source": "stdout", "silent_after_s": 60}, clock)
    log = tmp_path / "logs" / "attempt-1.log"
    log.write_text("".join(f"E3 it#{i} L=2.{i}\n" for i in range(5)))
    log_source.pump(sup)
    assert sup.alerts == [] and not log_source.read_health(tmp_path)["silent"]  # not yet: within 60 s
    clock[0] += 61
    log_source.pump(sup)
    log_source.pump(sup)  # said once, not every tick
    assert len(sup.alerts) == 1 and len(sup.said) == 1
    event, text, details = sup.alerts[0]
    assert event == "telemetry" and "no step record" in text and "[telemetry] pattern" in text
    assert details["example_line"] == "E3 it#4 L=2.4"
    health = log_source.read_health(tmp_path)
    assert health["silent"] and health["step_records"] == 0 and "pattern" in health["fix"]


def test_a_job_printing_step_lines_is_not_reported_and_its_health_counts_them(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, {"source": "stdout", "silent_after_s": 60}, clock)
    log = tmp_path / "logs" / "attempt-1.log"
    for i in range(1, 6):
        with log.open("a") as fh:
            fh.write(f"INFO step {i}/30 | loss 2.9{i} | lr 3.00e-03\n")
        log_source.pump(sup)
        clock[0] += 50  # 250 s in all, never 60 s without a record
    assert sup.alerts == []
    health = log_source.read_health(tmp_path)
    assert not health["silent"] and health["step_records"] == 5
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3, 4, 5]


def test_the_users_pattern_reads_the_wording_and_keeps_the_job_from_being_silent(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, {"source": "stdout", "silent_after_s": 60,
                          "pattern": r"it#(?P<step>\d+) L=(?P<loss>\S+)"}, clock)
    (tmp_path / "logs" / "attempt-1.log").write_text("".join(f"E3 it#{i} L=2.{i}\n" for i in range(1, 4)))
    log_source.pump(sup)
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(1, 2.1), (2, 2.2), (3, 2.3)]


def test_hf_trainer_state_json_is_read_instead_of_stdout(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-20").mkdir(parents=True)
    history = [{"epoch": 0.1, "grad_norm": 1.5, "learning_rate": 4e-5, "loss": 2.5, "step": 10},
               {"epoch": 0.2, "eval_loss": 2.4, "eval_runtime": 1.0, "step": 20},
               {"epoch": 0.2, "grad_norm": 1.1, "learning_rate": 3e-5, "loss": 2.2, "step": 20}]
    (out / "checkpoint-20" / "trainer_state.json").write_text(json.dumps(
        {"global_step": 20, "max_steps": 100, "log_history": history}))
    clock = [1000.0]
    sup = _sup(tmp_path, {"source": "trainer_state", "files": str(out)}, clock)
    log_source.pump(sup)
    recs = _records(tmp_path)
    assert [(r["step"], r["loss"]) for r in recs] == [(10, 2.5), (20, 2.2)]  # the eval entry is not a step
    assert recs[0]["lr"] == 4e-5 and recs[0]["grad_norm"] == 1.5 and recs[0]["total_steps"] == 100
    history.append({"epoch": 0.3, "grad_norm": 0.9, "learning_rate": 2e-5, "loss": 2.0, "step": 30})
    (out / "checkpoint-30").mkdir()
    (out / "checkpoint-30" / "trainer_state.json").write_text(json.dumps({"max_steps": 100, "log_history": history}))
    log_source.pump(sup)
    assert [r["step"] for r in _records(tmp_path)] == [10, 20, 30]  # only the new entry


def test_tensorboard_event_files_are_read_instead_of_stdout(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    runs = tmp_path / "runs"
    w = SummaryWriter(str(runs / "run1"))
    for step in range(1, 6):
        w.add_scalar("train/loss", 3.0 - step / 10, step)
        w.add_scalar("eval/loss", 9.0, step)  # never the training loss
        w.add_scalar("train/learning_rate", 1e-4, step)
    w.flush()
    clock = [1000.0]
    sup = _sup(tmp_path, {"source": "tensorboard", "files": str(runs)}, clock)
    log_source.pump(sup)
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[0]["loss"] == 2.9000000953674316 or abs(recs[0]["loss"] - 2.9) < 1e-6
    assert abs(recs[0]["lr"] - 1e-4) < 1e-9
    w.add_scalar("train/loss", 2.0, 6)
    w.flush()
    w.close()
    log_source.pump(sup)
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_tensorboard_tags_are_classified_by_their_words():
    assert tag_role("train/loss") == ("loss", 3) and tag_role("Loss/train") == ("loss", 3)
    assert tag_role("lm loss") == ("loss", 2) and tag_role("eval/loss") is None and tag_role("val_loss") is None
    assert tag_role("train/learning_rate") == ("lr", 1) and tag_role("grad_norm") == ("grad_norm", 1)
    assert tag_role("loss_scale") is None and tag_role("throughput") is None


def test_a_backlog_is_parsed_over_several_ticks_within_the_time_bound_and_nothing_is_lost(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(log_source, "MAX_PARSE_S", 0.02)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "attempt-1.log").write_text("".join(f"step {i} loss 2.5 lr 1e-4\n" for i in range(1, 20001)))
    src = log_source.LogSource(tmp_path, attempt=1)
    pumps, worst = 0, 0.0
    while True:
        t0 = time.monotonic()
        n = src.pump(now=1.0)
        worst = max(worst, time.monotonic() - t0)
        pumps += 1
        if n == 0:
            break
    assert pumps > 2 and worst < 1.0  # bounded per tick, not one pass over the whole backlog
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, 20001))


def test_the_reader_never_raises_and_stays_bounded_on_hostile_lines():
    import random
    import time

    from ulyssesd.remediation.log_telemetry import LogTelemetryParser

    rng = random.Random(7)
    p = LogTelemetryParser()
    hostile = ["aaaa bbbb " * 100_000, "loss 1.0 " * 100_000, "1" * 1_000_000, "1/2 [" * 200_000,
               "step " + "9" * 5000 + " loss 1", "step 1e400 loss 1", "loss=nan step=-3", "\x00\xff" * 1000,
               "".join(rng.choice("ab1 :=/.[]()'\"-_eE+\r{}") for _ in range(200_000))]
    for line in hostile:
        t0 = time.monotonic()
        for rec in p.feed(line):
            parse_record(rec)
        assert time.monotonic() - t0 < 2.0, line[:40]


def test_a_file_source_needs_a_hang_floor_beyond_the_frameworks_write_interval(tmp_path):
    import pytest

    from ulyssesd.daemon.spec import run_spec_from_dict
    from ulyssesd.training.spec import SpecError

    base = {"job": {"kind": "command", "command": ["t.py"]},
            "telemetry": {"source": "trainer_state", "files": "out"}}
    with pytest.raises(SpecError, match="hang_timeout_floor_s above that interval"):
        run_spec_from_dict(base, base_dir=tmp_path)
    rs = run_spec_from_dict({**base, "detectors": {"hang_timeout_floor_s": 900}}, base_dir=tmp_path)
    assert rs.job.telemetry.files == str((tmp_path / "out").resolve())  # relative to the spec file
