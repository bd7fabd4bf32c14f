"""Fixtures for the systemd-facing daemon parts: short socket dirs (AF_UNIX paths max 107 bytes)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture
def sockdir():
    # pytest's tmp_path can exceed AF_UNIX's 107-byte limit and is 0700 (unreachable for uid 65534);
    # a short /tmp dir with 0755 serves both the socket tests and the setuid-peer tests.
    path = tempfile.mkdtemp(prefix="uds-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
