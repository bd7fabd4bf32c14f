"""`ulyssesd --version` and `ulyssesctl --version`: the installed executables print the version pip recorded."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("prog", ["ulyssesd", "ulyssesctl"])
def test_version_flag_prints_the_installed_package_version(prog):
    exe = BIN / prog
    assert exe.is_file(), f"{exe}: the console script is not installed in this venv"
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{prog} {version('ulyssesd')}"
    assert version("ulyssesd")[0].isdigit()  # a real version, not the "not installed" fallback
