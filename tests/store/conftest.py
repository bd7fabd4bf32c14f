"""Fixtures for the incident-store tests: a fresh SQLite file per test, opened through the real API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ulyssesd.daemon.store import open_store

WORKER = Path(__file__).with_name("store_worker.py")


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "ulyssesd.db"


@pytest.fixture
def store(db_path: Path):
    st = open_store(db_path)
    yield st
    st.close()


@pytest.fixture
def run_id(store) -> str:
    store.create_run("run-1", spec={"model": {"layers": 2}}, run_dir="/tmp/run-1")
    return "run-1"


@pytest.fixture
def start_worker():
    """Start real separate processes running tests/store/store_worker.py; killed at teardown if alive."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, bufsize=1)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
