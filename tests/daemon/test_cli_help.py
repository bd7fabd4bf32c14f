"""Every command's --help renders: all four executables (ulyssesd, ulyssesctl, ulysses-train,
ulysses-preprocess) on the one CLI framework (ulyssesd_pkg/cli_app.py), walked from their real command trees. No flag shows a `<bool>` metavar, bracketed words such as `[detectors]`
survive (the rich formatter ate them as markup), and every option and argument has its own help text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from ulyssesd.daemon import cli as ulyssesd_cli
from ulyssesd.daemon.operator import ctl
from ulyssesd.training import __main__ as train_cli
from ulyssesd.training.data import preprocess_cli

BIN = Path(sys.executable).parent


def _commands(group, path=()):
    """(path, command) for the group itself and every command under it, depth first."""
    yield path, group
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _commands(cmd, (*path, name))


EXECUTABLES = {"ulyssesctl": (ctl.app, ctl.main), "ulyssesd": (ulyssesd_cli.build_app(), ulyssesd_cli.main),
               "ulysses-train": (train_cli.build_app([]), train_cli.main),
               "ulysses-preprocess": (preprocess_cli.app, preprocess_cli.main)}
CASES = [(exe, path, cmd) for exe, (app, _) in EXECUTABLES.items()
         for path, cmd in _commands(typer.main.get_command(app))]


@pytest.mark.parametrize(("exe", "path", "cmd"), CASES, ids=[" ".join((c[0], *c[1])) for c in CASES])
def test_help_renders_with_every_flag_explained(exe, path, cmd, capsys):
    capsys.readouterr()
    assert EXECUTABLES[exe][1]([*path, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"Usage: {exe}") and "<bool>" not in text, text
    assert "\x1b[" not in text and "╭" not in text, text  # plain help: no colour codes, no rich panels
    for param in cmd.params:
        assert (param.help or "").strip(), f"{exe} {' '.join(path)}: {param.name} has no help text"
        for opt in getattr(param, "opts", []):
            if opt.startswith("-"):
                assert opt in text, f"{opt} missing from {exe} {' '.join(path)} --help"
        if not getattr(param, "is_flag", False) and param.param_type_name == "option":
            line = next(line for line in text.splitlines() if param.opts[-1] in line)
            assert "<bool>" not in line


#: A template placeholder left in rendered help: `{state-dir}` in a text, Typer's `{ID}` for a required argument.
PLACEHOLDER = re.compile(r"\{[^{}\s]*\}")


@pytest.mark.parametrize(("exe", "path", "cmd"), CASES, ids=[" ".join((c[0], *c[1])) for c in CASES])
def test_help_shows_no_brace_placeholder(exe, path, cmd, capsys):
    """Help reads as written for a person: a required argument is `ID` on the usage line (as click and
    argparse write it), not Typer's `{ID}`, and no help text shows a `{name}` template."""
    capsys.readouterr()
    assert EXECUTABLES[exe][1]([*path, "--help"]) == 0
    text = capsys.readouterr().out
    assert not PLACEHOLDER.findall(text), f"{exe} {' '.join(path)} --help: {PLACEHOLDER.findall(text)}\n{text}"


def test_required_arguments_read_plainly_on_the_usage_line(capsys):
    capsys.readouterr()
    assert ctl.main(["incident", "--help"]) == 0
    assert "Usage: ulyssesctl incident [OPTIONS] ID\n" in capsys.readouterr().out
    assert preprocess_cli.main(["--help"]) == 0
    assert "Usage: ulysses-preprocess [OPTIONS] INPUT...\n" in capsys.readouterr().out
    assert ctl.main(["diagnose", "--help"]) == 0
    assert "Usage: ulyssesctl diagnose [OPTIONS] LOGFILE\n" in capsys.readouterr().out


def test_bracketed_words_survive_in_help():
    """The texts that lost their brackets to rich markup, rendered as an operator sees them (a subprocess)."""
    res = subprocess.run([str(BIN / "ulyssesctl"), "replay", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "its [detectors], [remediation] and job values" in " ".join(res.stdout.split())
    res = subprocess.run([str(BIN / "ulyssesctl"), "--help"], capture_output=True, text=True, timeout=60)
    assert "[env var: ULYSSESD_STATE_DIR]" in " ".join(res.stdout.split())
    assert "--version " in res.stdout and "<bool>" not in res.stdout


@pytest.mark.parametrize("exe", ["ulysses-train", "ulysses-preprocess"])
def test_job_side_executables_render_help(exe):
    """The job's own entry points, as installed (they run on every rank): plain help, no `<bool>`."""
    res = subprocess.run([str(BIN / exe), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith(f"Usage: {exe} [OPTIONS]") and "<bool>" not in res.stdout


@pytest.mark.parametrize(("exe", "argv", "message"), [
    ("ulysses-train", [], "exactly one of --config, --spec, --standby-gate is required"),
    ("ulysses-train", ["--config", "a.json", "--spec", "b.toml"], "(got --config and --spec)"),
    ("ulysses-train", ["--spec", "b.toml", "--attempt", "two"], "Invalid value for '--attempt'"),
    ("ulysses-train", ["--spec", "b.toml", "--no-such-flag"], "No such option: --no-such-flag"),
    ("ulysses-preprocess", ["in.jsonl", "--output-prefix", "out"], "exactly one of --tokenizer, --train-tokenizer"),
    ("ulysses-preprocess", ["in.jsonl", "--output-prefix", "o", "--tokenizer", "t.json", "--text-unit", "page"],
     "--text-unit must be file or line"),
    ("ulysses-preprocess", ["--tokenizer", "t.json"], "Missing argument 'INPUT'"),
])
def test_job_side_usage_errors_exit_2_naming_the_problem(exe, argv, message):
    """A usage error exits 2 with one line naming it, as argparse did (the daemon reads 2 as 'config
    rejected'), and nothing is run."""
    res = subprocess.run([str(BIN / exe), *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_job_flags_parse_as_before_with_their_environment_defaults(monkeypatch):
    """Every flag the daemon passes to the job's ranks, and the ULYSSESD_* variables that stand in for them."""
    for var in ("ULYSSESD_RUN_DIR", "ULYSSESD_ATTEMPT", "ULYSSESD_CONFIG_VERSION"):
        monkeypatch.delenv(var, raising=False)
    args = train_cli._parse_args(["--config", "c.json", "--run-dir", "/r", "--attempt", "3", "--config-version", "2"])
    assert vars(args) == {"config": "c.json", "spec": None, "standby_gate": None, "run_dir": "/r", "attempt": 3,
                          "config_version": 2}
    assert vars(train_cli._parse_args(["--spec", "s.toml"])) == {
        "config": None, "spec": "s.toml", "standby_gate": None, "run_dir": None, "attempt": 1, "config_version": None}
    monkeypatch.setenv("ULYSSESD_RUN_DIR", "/env-run")
    monkeypatch.setenv("ULYSSESD_ATTEMPT", "4")
    monkeypatch.setenv("ULYSSESD_CONFIG_VERSION", "")  # empty: no version, as before
    args = train_cli._parse_args(["--standby-gate", "g.json"])
    assert (args.standby_gate, args.run_dir, args.attempt, args.config_version) == ("g.json", "/env-run", 4, None)
    monkeypatch.setenv("ULYSSESD_CONFIG_VERSION", "7")
    assert train_cli._parse_args(["--config", "c.json", "--attempt", "9"]).config_version == 7
    assert train_cli._parse_args(["--config", "c.json", "--attempt", "9"]).attempt == 9  # the flag wins
