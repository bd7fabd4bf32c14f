"""The planner counts an async save's host snapshot (fp32 master + Adam m, v of every rank on the node, held
between saves by the registered snapshot pool) in the host RAM it requires; nothing without async saves or
with the optimizer offloaded (its states are in host memory already: nothing is copied)."""

from __future__ import annotations

from ulyssesd.training.planner import Cluster, plan
from ulyssesd.training.spec import JobSpec

ITEM = "async-save snapshot (registered/pinned)"


def _plan(async_save: bool, gpus: int = 1, offload: str = "none"):
    job = JobSpec.model_validate({
        "model": {"preset": "gpt-1b"}, "precision": {"dtype": "bf16"},
        "train": {"seq_len": 4096, "activation_checkpoint_every": 1},
        "checkpoint": {"async_save": async_save},
        "deepspeed": {"config": {"zero_optimization": {"offload_optimizer": {"device": offload}}}}})
    return plan(job, Cluster.preset("h200-141g", gpus_per_node=gpus, nodes=1, host_mem_gib=1024.0), search=False)


def _items(p):
    return {i.name: (i.bytes, i.where) for i in p.items}


def test_async_saves_add_each_ranks_optimizer_partition_to_the_host_ram_a_node_needs():
    sync, one, eight = _plan(False), _plan(True), _plan(True, gpus=8)
    got, where = _items(one)[ITEM]
    assert where == "host" and one.host_required - sync.host_required == got
    # gpt-1b on one GPU: 12 bytes per parameter = 16.97 GB, the size of its tag measured on the H200.
    assert got == 12 * sync.summary["params"] and 16.9e9 < got < 17.0e9, got
    # Eight GPUs share the partitions: the node holds the same total, one eighth per rank.
    assert abs(_items(eight)[ITEM][0] - got) <= 12 * 8
    assert ITEM not in _items(sync)


def test_an_offloaded_optimizer_needs_no_snapshot_copy():
    assert ITEM not in _items(_plan(True, offload="cpu"))
