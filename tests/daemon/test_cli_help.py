"""Every command's --help renders: each executable on the one CLI framework (daemon/operator/cli_app.py),
walked from its real command tree. No flag shows a `<bool>` metavar, bracketed words such as `[detectors]`
survive (the rich formatter ate them as markup), and every option and argument has its own help text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from ulyssesd.daemon import cli as ulyssesd_cli
from ulyssesd.daemon.operator import ctl

BIN = Path(sys.executable).parent


def _commands(group, path=()):
    """(path, command) for the group itself and every command under it, depth first."""
    yield path, group
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _commands(cmd, (*path, name))


EXECUTABLES = {"ulyssesctl": (ctl.app, ctl.main), "ulyssesd": (ulyssesd_cli.build_app(), ulyssesd_cli.main)}
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


def test_bracketed_words_survive_in_help():
    """The texts that lost their brackets to rich markup, rendered as an operator sees them (a subprocess)."""
    res = subprocess.run([str(BIN / "ulyssesctl"), "replay", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "its [detectors], [remediation] and job values" in " ".join(res.stdout.split())
    res = subprocess.run([str(BIN / "ulyssesctl"), "--help"], capture_output=True, text=True, timeout=60)
    assert "[env var: ULYSSESD_STATE_DIR]" in " ".join(res.stdout.split())
    assert "--version " in res.stdout and "<bool>" not in res.stdout


@pytest.mark.parametrize("exe", ["ulysses-train", "ulysses-preprocess"])
def test_job_side_executables_render_help(exe):
    """The job's own entry points (argparse, they run on every rank): help renders, no `<bool>`."""
    res = subprocess.run([str(BIN / exe), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith(f"usage: {exe}") and "<bool>" not in res.stdout
