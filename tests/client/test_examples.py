"""The examples run as real processes on the CPU (DeepSpeed, gloo): the printed-logs script under the log
parser (a loss spike found, none on the clean run), and the attach() loop taking a hot LR/clip change without
a restart, then SIGTERM -> checkpoint with a valid manifest -> exit 0 -> resume from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ulyssesd.client import validate_manifest
from ulyssesd.remediation.log_telemetry import LogTelemetryParser
from ulyssesd.remediation.records import parse_record
from ulyssesd.remediation.replay import replay

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", ULYSSESD_RUN_DIR=str(tmp_path), OMP_NUM_THREADS="1", **extra)
    return env


def _printed_logs_run(tmp_path: Path, **faults: str) -> tuple[list[dict], set[str]]:
    out = subprocess.run([sys.executable, str(EXAMPLES / "print_logs" / "train.py"), "--steps", "150"],
                         env=_env(tmp_path, **faults), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    parser = LogTelemetryParser(attempt=1)
    recs = [r for line in (out.stdout + out.stderr).splitlines() for r in parser.feed(line)]
    findings = {it.item.symptom for it in replay(parse_record(r) for r in recs) if it.kind == "finding"}
    return recs, findings


def test_printed_logs_example_is_supervised_from_its_lines(tmp_path):
    recs, findings = _printed_logs_run(tmp_path / "clean")
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 151))
    assert steps[-1]["loss"] < steps[0]["loss"] / 4 and steps[0]["lr"] == 1e-3  # it learns
    assert "loss_spike" not in findings and "nan_loss" not in findings
    _, spiked = _printed_logs_run(tmp_path / "spike", EXAMPLE_SPIKE_AT="110")
    assert "loss_spike" in spiked


def _events(path: Path, name: str) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == name]


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) while waiting for {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_attach_applies_hot_lr_and_clip_then_saves_on_sigterm_and_resumes(tmp_path):
    tel = tmp_path / "telemetry.jsonl"
    ckpt = tmp_path / "ckpt"
    script = str(EXAMPLES / "deepspeed_attach" / "train.py")
    proc = subprocess.Popen([sys.executable, script, "--steps", "100000", "--save-dir", str(ckpt), "--step-sleep",
                             "0.02"], env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _events(tel, "started"), 120, "started", proc)
        _wait(lambda: tel.read_text().count('"kind":"step"') >= 5, 60, "5 steps", proc)
        (tmp_path / "control.json.tmp").write_text(json.dumps({"version": 1, "lr_scale": 0.5, "gradient_clipping": 0.25}))
        os.replace(tmp_path / "control.json.tmp", tmp_path / "control.json")
        applied = _wait(lambda: _events(tel, "control_applied"), 30, "control_applied", proc)[0]
        assert applied["control_version"] == 1 and applied["gradient_clipping"] == 0.25  # read back from the engine
        assert applied["lr_scale"] == 0.5
        _wait(lambda: [r for r in map(json.loads, tel.read_text().splitlines())
                       if r["kind"] == "step" and r["step"] > applied["step"] + 2], 30, "steps after control", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = [json.loads(x) for x in tel.read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    before = [r["lr"] for r in steps if r["step"] < applied["step"]]
    after = [r["lr"] for r in steps if r["step"] >= applied["step"]]
    assert set(before) == {1e-3} and set(after) == {5e-4}  # hot: the same process, no restart
    assert len(_events(tel, "started")) == 1
    (saved,) = _events(tel, "checkpoint_saved")
    (exiting,) = _events(tel, "exiting")
    assert exiting["reason"] == "sigterm" and exiting["saved"] is True
    tag_dir = ckpt / saved["tag"]
    assert saved["step"] == steps[-1]["step"] and validate_manifest(tag_dir) == (True, "ok")
    # Resume from the saved tag: the new attempt starts where the SIGTERM left off.
    last = saved["step"]
    out = subprocess.run([sys.executable, script, "--steps", str(last + 3), "--save-dir", str(ckpt), "--resume"],
                         env=_env(tmp_path, ULYSSESD_ATTEMPT="2"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    recs2 = [json.loads(x) for x in tel.read_text().splitlines()][len(recs):]
    assert recs2[0]["event"] == "started" and recs2[0]["start_step"] == last and recs2[0]["attempt"] == 2
    assert [r["step"] for r in recs2 if r["kind"] == "step"] == [last + 1, last + 2, last + 3]
