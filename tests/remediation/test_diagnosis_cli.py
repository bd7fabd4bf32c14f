"""`ulyssesctl diagnose` through Typer's CliRunner: JSON and panel output, exit codes, bad paths, tail-only reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ulyssesd.daemon.operator.ctl_diagnose import read_log_tail, register_diagnose
from ulyssesd.remediation.diagnosis import TAIL_BYTES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
OOM_FIXTURE = FIXTURES / "cuda_oom" / "01-rank3-oom-peers-nccl-error-torchrun.log"


@pytest.fixture()
def app() -> typer.Typer:
    app = typer.Typer()
    register_diagnose(app)

    @app.command("version")  # a second command, as in the real ulyssesctl, so `diagnose` is a subcommand
    def _version() -> None:
        typer.echo("0")

    return app


def run(app, *args):
    return CliRunner().invoke(app, list(args))


def test_json_output_names_label_and_evidence(app):
    r = run(app, "diagnose", str(OOM_FIXTURE), "--exit-code", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["label"] == "cuda_oom"
    assert any("torch.OutOfMemoryError: CUDA out of memory" in e for e in out["evidence"])
    assert set(out) >= {"label", "evidence", "reason", "confidence", "secondary"}


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*/*.log"))[::7], ids=lambda p: p.stem)
def test_cli_agrees_with_the_library_on_fixture_files(app, path):
    meta = json.loads(path.with_suffix(".json").read_text())
    args = ["diagnose", str(path), "--json"]
    if meta["exit_code"] is not None:
        args += ["--exit-code", str(meta["exit_code"])]
    if meta["signal"] is not None:
        args += ["--signal", str(meta["signal"])]
    r = run(app, *args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["label"] == path.parent.name


def test_panel_output_is_readable(app):
    r = run(app, "diagnose", str(OOM_FIXTURE))
    assert r.exit_code == 0, r.output
    assert "cuda_oom" in r.stdout and "evidence" in r.stdout and "OutOfMemoryError" in r.stdout


def test_negative_exit_code_and_signal_options(app, tmp_path):
    log = tmp_path / "attempt-3.log"
    log.write_text("[rank0]:[ulyssesd.training] step 120 loss 2.31\n")
    r = run(app, "diagnose", str(log), "--exit-code", "-9", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["label"] == "host_oom_killed"
    r = run(app, "diagnose", str(log), "--signal", "11", "--json")
    assert json.loads(r.stdout)["label"] == "segfault"
    r = run(app, "diagnose", str(log), "--json")
    assert json.loads(r.stdout)["label"] == "healthy"


def test_missing_file_is_a_clear_error_exit_2(app, tmp_path):
    missing = tmp_path / "nope.log"
    r = run(app, "diagnose", str(missing))
    assert r.exit_code == 2
    assert "log file not found" in r.stderr and str(missing) in r.stderr


def test_directory_is_a_clear_error_exit_2(app, tmp_path):
    r = run(app, "diagnose", str(tmp_path), "--json")
    assert r.exit_code == 2 and "directory" in r.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read anything")
def test_unreadable_file_is_a_clear_error_exit_2(app, tmp_path):
    f = tmp_path / "secret.log"
    f.write_text("x")
    f.chmod(0)
    r = run(app, "diagnose", str(f))
    assert r.exit_code == 2 and "permission denied" in r.stderr


def test_only_the_tail_of_a_large_file_is_read(tmp_path):
    f = tmp_path / "big.log"
    with open(f, "w") as fh:
        fh.write("torch.OutOfMemoryError: CUDA out of memory.\n")
        fh.write(("step 1 loss 2.3\n") * (3 * TAIL_BYTES // 16))
        fh.write("NCCL INFO tail marker\n")
    text = read_log_tail(f)
    assert len(text.encode()) == TAIL_BYTES
    assert "OutOfMemoryError" not in text and text.endswith("NCCL INFO tail marker\n")


def test_undecodable_bytes_do_not_crash(app, tmp_path):
    f = tmp_path / "binary.log"
    f.write_bytes(b"\xff\xfe\x00garbage\nSegmentation fault (core dumped)\n")
    r = run(app, "diagnose", str(f), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["label"] == "segfault"
