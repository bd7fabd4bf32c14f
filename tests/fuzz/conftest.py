"""Fixtures of the fuzz suite (its settings and helpers live in fuzz_helpers.py: a unique module name, as
several test folders have a conftest.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def fuzz_dir(tmp_path):
    """Where fuzz cases are written: tmpfs when there is one (thousands of small writes; a loaded disk made
    them the main cost), else tmp_path."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="ulyssesd-fuzz-", dir=base)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sockdir():
    # AF_UNIX paths are at most 107 bytes; pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="ufz-")
    yield path
    shutil.rmtree(path, ignore_errors=True)
