"""The Slurm test cluster's CLI (bench/slurm_cluster.py) with bad arguments (an outside check): a usage error
or one line naming what is wrong, never a traceback, and nothing claimed or started. Run as a real process;
none of these cases needs Slurm, root or a network namespace (they are refused before any of it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "slurm_cluster.py"
CLAIMS = Path("/run/ulyssesd-slurm-test")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def _claims() -> set[str]:
    return {p.name for p in CLAIMS.iterdir()} if CLAIMS.is_dir() else set()


@pytest.mark.parametrize("nodes, why", [("0", "0 nodes: give 1..200"), ("-1", "-1 nodes: give 1..200"),
                                        ("201", "201 nodes: give 1..200"), ("x", "'x' is not a whole number")])
def test_bad_node_counts_are_usage_errors(tmp_path, nodes, why):
    claims = _claims()
    done = _cli("up", "--nodes", nodes, "--dir", str(tmp_path / "c"))
    assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "c").exists() and _claims() == claims  # nothing made, nothing claimed


@pytest.mark.parametrize("sub", ["", "sub"])
def test_a_file_in_the_way_of_the_cluster_dir_is_one_line(tmp_path, sub):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    claims = _claims()
    done = _cli("up", "--nodes", "1", "--dir", str(blocker / sub) if sub else str(blocker))
    assert done.returncode == 2 and "a file is in the way" in done.stderr and "Traceback" not in done.stderr
    assert blocker.read_text() == "keep me" and _claims() == claims


def test_down_and_status_without_up_say_there_is_no_cluster(tmp_path):
    for action in ("down", "status"):
        done = _cli(action, "--dir", str(tmp_path / "never"))
        assert done.returncode == 1 and "holds no test cluster" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "never").exists()
