"""The daemon over plain scripts whose only telemetry is their printed wording (real processes, real store):
the user's `INFO step 11/30 | loss 2.9539 | lr 3.00e-03` lines become records with the line's total, one
odd Megatron line (`iteration 10000000000000000000000000/ 900`) is a bad line and does not blind the run,
a job that exits 0 at step 8 of 30 is flagged (warning incident, state reason) instead of silently COMPLETED,
`ulyssesctl status` shows step, loss and age of such a run, and a job whose wording is not understood is
reported as silent (journal/webhook text, status) with the setting that fixes it."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
from uls_client_helpers import run_supervised

from ulyssesd.daemon.store.enums import RunState

pytestmark = pytest.mark.slow

SCRIPT = """
import sys, time
steps = int(sys.argv[1]); stop_at = int(sys.argv[2]); style = sys.argv[3]
for i in range(1, steps + 1):
    if i > stop_at:
        break
    if style == "odd":
        print(f"E3 it#{i} L={3 - i / 100:.4f}", flush=True)
    else:
        print(f"INFO step {i}/{steps} | loss {3 - i / 100:.4f} | lr 3.00e-03", flush=True)
    if i == 4 and style == "plain":
        print(" iteration 10000000000000000000000000/ 900 | lm loss: 2.9E+00 |", flush=True)
    time.sleep(0.05 if style == "plain" else 1.0)
"""


def _spec(tmp: Path, stop_at: int, style: str, steps: int = 30, extra_tel: str = "") -> Path:
    (tmp / "train.py").write_text(SCRIPT)
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    (tmp / "run.toml").write_text(f"""
[run]
name = "wording"
[job]
kind = "command"
command = ["train.py", "{steps}", "{stop_at}", "{style}"]
[telemetry]
source = "stdout"
{extra_tel}
[launcher]
kind = "local"
python = "{sys.executable}"
[daemon]
state_dir = "{tmp / 'state'}"
socket_path = "{sock}"
tick_s = 0.1
stop_grace_s = 5.0
backoff_base_s = 0.2
backoff_max_s = 1.0
early_death_s = 0.5
preflight = false
[detectors]
warmup_steps = 3
window = 10
hang_timeout_floor_s = 60.0
""")
    return tmp / "run.toml"


def _status_ctx(monkeypatch, tmp_path: Path) -> None:
    from ulyssesd.daemon.operator.ctl_common import CTX

    monkeypatch.setattr(CTX, "state_dir", tmp_path / "state", raising=False)  # what `ulyssesctl --state-dir` sets


def test_user_wording_an_odd_line_and_an_early_exit_0(tmp_path, monkeypatch):
    from ulyssesd.daemon.operator.ctl_status import status_data

    _status_ctx(monkeypatch, tmp_path)
    sup, say = run_supervised(_spec(tmp_path, stop_at=8, style="plain"))
    assert sup.state == RunState.COMPLETED, say
    assert sup.last_step == 8  # the odd line at step 4 did not blind the parser
    health_said = [s for s in say if "TELEMETRY SILENT" in s]
    assert health_said == []
    short = [i for i in sup.store.list_incidents(sup.run_id) if "before its declared total" in (i.summary or "")]
    assert len(short) == 1 and short[0].step == 8 and "30" in short[0].summary, \
        [(i.symptom, i.summary) for i in sup.store.list_incidents(sup.run_id)]
    run = sup.store.get_run(sup.run_id)
    assert "before its declared total 30" in run.state_reason
    d = status_data(sup.store, run)
    assert d["step"] == 8 and d["loss"] == pytest.approx(2.92) and d["total_steps"] == 30
    assert d["last_step_age_s"] is not None and d["total_steps_source"] == "job telemetry"
    assert d["telemetry_health"]["bad_lines"] == 1 and d["telemetry_health"]["step_records"] == 8


def test_a_run_that_reaches_its_total_is_not_flagged(tmp_path):
    sup, say = run_supervised(_spec(tmp_path, stop_at=30, style="plain"))
    assert sup.state == RunState.COMPLETED and sup.last_step == 30, say
    assert not [i for i in sup.store.list_incidents(sup.run_id) if "declared total" in (i.summary or "")]


def test_a_job_whose_wording_is_not_understood_is_reported_with_the_fix(tmp_path, monkeypatch):
    from ulyssesd.daemon.operator.ctl_status import status_data

    _status_ctx(monkeypatch, tmp_path)
    sup, say = run_supervised(_spec(tmp_path, stop_at=9, steps=9, style="odd", extra_tel="silent_after_s = 5"))
    assert sup.state == RunState.COMPLETED, say
    silent = [s for s in say if "TELEMETRY SILENT" in s]
    assert len(silent) == 1 and "[telemetry] pattern" in silent[0] and "E3 it#" in silent[0], say
    health = status_data(sup.store, sup.store.get_run(sup.run_id))["telemetry_health"]
    assert health["step_records"] == 0 and health["fix"] and "E3 it#" in health["unparsed_sample"]
