"""Issue 28: unknown is loud for stdout telemetry. A job that exits 0 with no step record understood does
not end "reached final step None"; a silence before any output names that no line looked like progress; a
SILENT run still STARTING shows it in status; progress-bar redraws are read (and timed) as they are written,
not when the epoch's newline comes."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from uls_client_helpers import run_supervised

from ulyssesd.daemon.operator import ctl_status
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.telemetry import log_source
from ulyssesd.daemon.telemetry.unread_exit import no_step_record_at_exit


def _sup(tmp_path: Path, clock: list[float], telemetry: dict | None = None) -> SimpleNamespace:
    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
    said, alerts = [], []
    return SimpleNamespace(config={"telemetry": telemetry or {"source": "stdout", "silent_after_s": 5},
                                   "job": {"kind": "command"}},
                           attempt=1, run_dir=tmp_path, config_version=1, run_id="r1", job=object(), last_step=None,
                           os=SimpleNamespace(time=lambda: clock[0]), said=said, alerts=alerts,
                           say=said.append, alert=lambda event, text, **kw: alerts.append((event, text, kw)))


def test_silence_before_any_output_says_no_line_looked_like_progress_yet(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, clock)
    (tmp_path / "logs" / "attempt-1.log").write_text("")  # torch still importing
    log_source.pump(sup)
    clock[0] += 6
    log_source.pump(sup)
    (event, text, details), = sup.alerts
    assert details["example_line"] == log_source.NO_PROGRESS_LINE_YET
    assert log_source.NO_PROGRESS_LINE_YET in text and "[telemetry] pattern" in text


def test_the_example_for_the_fix_prefers_a_loss_line_over_a_path_with_step_in_it(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, clock)
    (tmp_path / "logs" / "attempt-1.log").write_text(
        "E0 #12 train-loss~0.0366\nsaved /tmp/x/ckpt/step_000300.pt\n")
    log_source.pump(sup)
    assert log_source.read_health(tmp_path)["unparsed_sample"] == "E0 #12 train-loss~0.0366"


def test_an_exit_with_no_step_record_understood_is_said_with_the_fix_and_the_line(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, clock)
    (tmp_path / "logs" / "attempt-1.log").write_text("".join(f"E0 #{i} trainL~0.0{i}\n" for i in range(1, 9)))
    log_source.pump(sup)
    said = no_step_record_at_exit(sup)
    assert said is not None
    text, evidence = said
    assert "no step record was understood" in text and "[telemetry] pattern" in text and "E0 #8 trainL~0.08" in text
    assert evidence["lines"] == 8 and evidence["example_line"] == "E0 #8 trainL~0.08"

    ok = _sup(tmp_path / "ok", clock)
    (tmp_path / "ok" / "logs" / "attempt-1.log").write_text("step 1 loss 2.5\n")
    log_source.pump(ok)
    ok.last_step = 1
    assert no_step_record_at_exit(ok) is None
    assert no_step_record_at_exit(SimpleNamespace(config={"telemetry": {"source": "job"}}, last_step=None)) is None


def test_status_shows_silent_for_a_run_that_never_left_starting(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, clock)
    (tmp_path / "logs" / "attempt-1.log").write_text("E0 #1 trainL~0.5\n")
    log_source.pump(sup)
    clock[0] += 6
    log_source.pump(sup)
    run = SimpleNamespace(spec=sup.config, run_dir=str(tmp_path))
    for state, silent in (("STARTING", True), ("RUNNING", True), ("COMPLETED", False)):
        assert ctl_status._telemetry_health(run, state, 1)["silent"] is silent, state


def test_progress_bar_redraws_are_read_and_timed_as_they_are_written(tmp_path):
    """Lightning's bar: `\\r` redraws, one `\\n` per epoch. Each record carries the time its redraw was read."""
    clock = [1000.0]
    sup = _sup(tmp_path, clock, {"source": "stdout", "silent_after_s": 600})
    log = tmp_path / "logs" / "attempt-1.log"
    log.write_text("")
    for i in range(1, 11):
        with log.open("a") as fh:
            fh.write(f"\rEpoch 0:  {i * 10}%|█   | {i}/10 [00:0{i - 1}<00:01,  1.00it/s, v_num=0, train_loss={2.5 - i / 100}]")
            if i == 10:
                fh.write("\n")
        log_source.pump(sup)
        clock[0] += 1.0
    recs = [json.loads(x) for x in (tmp_path / log_source.STDOUT_TELEMETRY_NAME).read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["time"] for r in recs] == [1000.0 + i for i in range(10)]
    offsets = json.loads((tmp_path / log_source.OFFSETS_NAME).read_text())
    assert offsets["1"]["offset"] == log.stat().st_size  # every byte read once: a redraw is never parsed twice


def test_a_torn_redraw_waits_for_its_end(tmp_path):
    clock = [1000.0]
    sup = _sup(tmp_path, clock, {"source": "stdout", "silent_after_s": 600})
    log = tmp_path / "logs" / "attempt-1.log"
    log.write_text("\rEpoch 0:  10%| 1/10 [00:00<00:01, 1.00it/s, train_loss=2.4")
    log_source.pump(sup)
    assert not (tmp_path / log_source.STDOUT_TELEMETRY_NAME).exists()
    with log.open("a") as fh:
        fh.write("9]\r")
    log_source.pump(sup)
    recs = [json.loads(x) for x in (tmp_path / log_source.STDOUT_TELEMETRY_NAME).read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 2.49)]


SCRIPT = """
import time
for i in range(1, 31):
    print(f"E0 #{i}/30 trainL~{2.5 - i / 100:.3f}", flush=True)
    time.sleep(0.01)
"""


def test_a_command_job_that_exits_0_with_no_step_record_is_completed_with_a_warning_not_a_final_step(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    (tmp_path / "run.toml").write_text(f"""
[run]
name = "unread"
[job]
kind = "command"
command = [{json.dumps(sys.executable)}, {json.dumps(str(script))}]
[telemetry]
source = "stdout"
[launcher]
kind = "local"
python = {json.dumps(sys.executable)}
[daemon]
state_dir = {json.dumps(str(tmp_path / "state"))}
socket_path = {json.dumps(str(sock))}
tick_s = 0.1
preflight = false
""")
    sup, say = run_supervised(tmp_path / "run.toml", timeout=120)
    assert sup.state == RunState.COMPLETED, say
    run = sup.store.get_run(sup.run_id)
    assert "final step" in run.state_reason and "None" not in run.state_reason
    assert "no step record was understood" in run.state_reason
    inc = [i for i in sup.store.list_incidents(sup.run_id) if i.severity.value == "warning"]
    assert len(inc) == 1 and "[telemetry] pattern" in inc[0].summary and "E0 #30/30 trainL~2.200" in inc[0].summary
