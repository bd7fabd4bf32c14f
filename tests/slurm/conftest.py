"""A real Slurm cluster for the Slurm tests: munged, slurmctld and 3 slurmd (n1, n2 + the spare n3), each slurmd
in its own network namespace (bench/slurm_cluster.py says how it is built and which fault helpers it has).

``slurm_cluster`` is session-wide (starting it costs a few seconds); ``slurm_cluster_clean`` is the same
cluster after ``reset()`` (jobs cancelled, killed/frozen/DOWN nodes restored, every node idle): use it in a test
that needs all nodes up after an earlier test broke one. Both skip, saying why, where the machine cannot host
the cluster (not root, no `ip netns`, slurm-wlm or munge not installed).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

import slurm_cluster as sc  # noqa: E402  (bench/ is not a package)

CLUSTER_NODES = 3  # 2 for a 2-node job + 1 spare to replace a lost node


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sc.SlurmTestCluster]:
    reason = sc.missing_prerequisites()
    if reason:
        pytest.skip(f"no Slurm test cluster: {reason}")
    cluster = sc.SlurmTestCluster(sc.ClusterConfig(base_dir=tmp_path_factory.mktemp("slurm"), nodes=CLUSTER_NODES))
    try:
        cluster.up()
    except sc.ClusterUnavailable as e:
        pytest.skip(f"no Slurm test cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.down(check=True)  # raises (a teardown error) when a namespace, link or daemon is left behind


@pytest.fixture()
def slurm_cluster_clean(slurm_cluster: sc.SlurmTestCluster) -> sc.SlurmTestCluster:
    slurm_cluster.reset()
    return slurm_cluster
