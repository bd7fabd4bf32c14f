"""Regressions of issue 13's input probes outside telemetry and the socket: a binary spec, a spec that is a
FIFO, run ids that escape the state dir, `diagnose` on a FIFO, `replay` on a 50,000-deep line. Each gets a
clear one-line error (or a counted bad line), no traceback, and nothing is created."""

from __future__ import annotations

import io
import json
import os
import signal
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import pytest

from ulyssesd.daemon.cli import EXIT_SPEC, run_daemon
from ulyssesd.daemon.operator.ctl import main as ctl_main
from ulyssesd.daemon.operator.ctl_offline import run_replay
from ulyssesd.daemon.spec import load_run_spec, run_id_problem
from ulyssesd.training.spec import SpecError

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


@contextmanager
def _no_blocking(seconds: int = 10):
    """Fail (instead of hanging the suite) if the body blocks, e.g. in open() of a FIFO."""
    def _alarm(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _daemon(spec, state_dir, run_id=None) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err), _no_blocking():
        code = run_daemon(str(spec), state_dir=str(state_dir), run_id=run_id, preflight=False)
    return code, err.getvalue()


def test_binary_and_special_specs_are_a_clear_error(tmp_path):
    binary = tmp_path / "run.toml"
    binary.write_bytes(TINY.read_bytes() + b"\n# \xff\xfe\x00\x9c\n")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"# x\n" * (300 << 10))
    for spec, fragment in ((binary, "not UTF-8 text (invalid byte 0xff"), (fifo, "not a regular file (a FIFO)"),
                           (tmp_path, "not a regular file (a directory)"), (huge, "a run spec is at most")):
        code, err = _daemon(spec, tmp_path / "state")
        assert code == EXIT_SPEC and fragment in err and "Traceback" not in err, err
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(SpecError, match="nest too deeply"):
        load_run_spec(deep)
    assert not (tmp_path / "state").exists()  # nothing was created
    assert load_run_spec(TINY).run.name == "tiny-cpu"  # positive control


@pytest.mark.parametrize("run_id", ["../../escape", "..", ".", "", "a/b", "x" * 97, ".hidden", "run id"])
def test_run_ids_that_are_no_plain_names_are_refused_before_anything_exists(tmp_path, run_id):
    code, err = _daemon(TINY, tmp_path / "state", run_id=run_id)
    assert code == EXIT_SPEC and "--run-id refused" in err and "nothing was started" in err, err
    assert not (tmp_path / "state").exists() and not (tmp_path / "escape").exists()


def test_run_id_rules_in_the_spec_too(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text(TINY.read_text().replace('[run]\n', '[run]\nrun_id = ".."\n', 1))
    with pytest.raises(SpecError, match="run.run_id"):
        load_run_spec(spec)
    assert run_id_problem("tiny-cpu-20261201-120000") is None and run_id_problem("a..b") is None


def test_diagnose_on_a_fifo_refuses_at_once(tmp_path, capsys):
    fifo = tmp_path / "job.log"
    os.mkfifo(fifo)
    with _no_blocking():
        assert ctl_main(["diagnose", str(fifo)]) == 2
    assert "not a regular file (a FIFO)" in capsys.readouterr().err


def test_replay_on_a_50000_deep_line_counts_a_bad_line(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(b'{"kind": "step", "step": 1, "loss": 2.0}\n' + b"[" * 50_000 + b"]" * 50_000 + b"\n"
                     + b'{"kind": "step", "step": 2, "loss": 2.0}\n')
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(path, as_json=True, out=out, err=err) == 0
    assert json.loads(out.getvalue())["bad_lines"] == [{"line": 2, "error": "JSON nests deeper than 32 levels"}]
    assert "Traceback" not in err.getvalue()


def test_replay_skips_a_line_longer_than_the_bound_without_holding_it(tmp_path):
    from ulyssesd.remediation.records import MAX_LINE_BYTES

    path = tmp_path / "telemetry.jsonl"
    with open(path, "wb") as fh:
        fh.write(b'{"kind": "step", "step": 1, "loss": 2.0}\n')
        fh.write(b'{"kind": "event", "event": "x", "blob": "' + b"a" * (3 * MAX_LINE_BYTES) + b'"}\n')
        fh.write(b'{"kind": "step", "step": 2, "loss": 2.0}\n')
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(path, as_json=True, out=out, err=err) == 0
    (bad,) = json.loads(out.getvalue())["bad_lines"]
    assert bad["line"] == 2 and f"at most {MAX_LINE_BYTES}" in bad["error"]


def test_a_hostile_checkpoint_manifest_makes_the_tag_invalid_not_the_daemon_crash(tmp_path):
    from ulyssesd.daemon.core.launch import tag_gib
    from ulyssesd.training.checkpoint import validate_tag

    tag = tmp_path / "step-00000010"
    tag.mkdir()
    for body, fragment in (
        (b'{"step": 10, "files": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
        (b'{"step": ' + b"[" * 500 + b"]" * 500 + b', "files": {}}', "'step' must be an integer, got list"),
        (b'{"step": 10, "files": {"a": {"size": [1], "sha256": "x"}}}', "needs integer 'size'"),
    ):
        (tag / "manifest.json").write_bytes(body)
        ok, reason = validate_tag(tag)
        assert ok is False and fragment in reason, reason
        assert tag_gib(tmp_path, tag.name) == 0.0


def test_damaged_exit_and_control_files_read_as_absent(tmp_path):
    from ulyssesd.daemon.host.process import read_exit_file
    from ulyssesd.daemon.job.config import read_control

    exit_file = tmp_path / "1.exit"
    for body in ("[1, 2]", "[" * 50_000, '{"returncode": "x", "signal": [9]}'):
        exit_file.write_text(body)
        status = read_exit_file(exit_file)
        assert status is None or (status.returncode is None and status.signal is None)
        (tmp_path / "control.json").write_text(body)
        assert isinstance(read_control(tmp_path), dict)  # a JSON object is returned as is, anything else: {}
    exit_file.write_text('{"returncode": 0, "signal": null}')  # positive control
    assert read_exit_file(exit_file).returncode == 0
