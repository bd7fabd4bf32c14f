"""The planner counts an async save's host snapshot in the host RAM a node needs: each rank's registered
snapshot pool (what the job really registers: its optimizer partition + 1 % + 64 MiB), pinned buffers without
the pool, and with the optimizer offloaded the pageable copy a snapshot makes of the host-resident states."""

from __future__ import annotations

import pytest

from ulyssesd.training.planner import Cluster, plan
from ulyssesd.training.planner import host_extras as hx
from ulyssesd.training.spec import JobSpec

POOL = "async-save snapshot pool (registered)"
PINNED = "async-save snapshot buffers (pinned)"
COPY = "async-save snapshot copy (while a write runs)"
SNAPSHOT_ITEMS = (POOL, PINNED, COPY)
# The pool the job registered for gpt-1b on one H200 (its `snapshot_pool_ready` event, device call 13:
# bench/results/gpu_call13_ckpt.log).
MEASURED_GPT1B_POOL_BYTES = 17_206_062_592


def _plan(async_save: bool, gpus: int = 1, offload: str = "none", preset: str = "gpt-1b", pool: bool = True):
    job = JobSpec.model_validate({
        "model": {"preset": preset}, "precision": {"dtype": "bf16"},
        "train": {"seq_len": 4096, "activation_checkpoint_every": 1},
        "checkpoint": {"async_save": async_save, "snapshot_pool": pool},
        "deepspeed": {"config": {"zero_optimization": {"offload_optimizer": {"device": offload}}}}})
    return plan(job, Cluster.preset("h200-141g", gpus_per_node=gpus, nodes=1, host_mem_gib=4096.0), search=False)


def _items(p):
    return {i.name: (i.bytes, i.where) for i in p.items}


def test_the_pool_item_is_what_the_job_registers_and_only_with_async_saves():
    sync, one = _plan(False), _plan(True)
    assert not set(SNAPSHOT_ITEMS) & set(_items(sync))
    got, where = _items(one)[POOL]
    assert where == "host" and one.host_required - sync.host_required == got
    # Exactly the pool the job sized and registered on the H200 for gpt-1b (12·P + 1 % + 64 MiB, aligned).
    assert got == MEASURED_GPT1B_POOL_BYTES, got
    # Not just the optimizer partition (the formula before: 12·P = 16.97 GB, 237 MB short of the pool).
    assert got - 12 * one.summary["params"] > 200e6


@pytest.mark.parametrize("preset", ["gpt-1b", "gpt-7b"])
@pytest.mark.parametrize("gpus", [1, 8])
def test_pool_bytes_follow_the_formula_per_rank_times_ranks(preset, gpus):
    p = _plan(True, gpus=gpus, preset=preset)
    shard = -(-p.summary["params"] // gpus)
    per_rank = 12 * shard + 12 * shard // 100 + (64 << 20)
    per_rank = -(-per_rank // 256) * 256
    assert _items(p)[POOL][0] == per_rank * gpus
    # Eight ranks on a node hold about the one-GPU total plus seven more 64 MiB margins.
    if gpus == 8:
        assert abs(_items(p)[POOL][0] - _items(_plan(True, preset=preset))[POOL][0] - 7 * (64 << 20)) < 8 * 256 + 12 * 8


def test_without_the_pool_each_pinned_buffer_is_rounded_up_to_a_power_of_two():
    p = _plan(True, pool=False)
    got = _items(p)[PINNED][0]
    shard = p.summary["params"]          # one GPU: 1,414,105,088 numel; sub-groups of 1e9 and the rest
    assert got == 3 * (hx.pow2ceil(4 * 10**9) + hx.pow2ceil(4 * (shard - 10**9)))
    assert got == 3 * (4 << 30) + 3 * (2 << 30)    # 18 GiB against the pool's 16.0
    assert POOL not in _items(p)


def test_an_offloaded_optimizer_is_copied_while_a_write_runs():
    p, sync = _plan(True, offload="cpu"), _plan(False, offload="cpu")
    got, where = _items(p)[COPY]
    assert where == "host" and got == 12 * p.summary["params"] and p.host_required - sync.host_required == got
    assert POOL not in _items(p) and COPY not in _items(sync)


def test_the_snapshot_copies_host_tensors_into_fresh_memory():
    # Why the offloaded case holds a copy: host_snapshot never aliases a tensor, host-resident ones included.
    torch = pytest.importorskip("torch")
    from ulyssesd.training.checkpoint.snapshot import host_snapshot

    state = {"fp32_flat_groups": [torch.ones(1000)], "state": {0: {"exp_avg": torch.zeros(1000)}}}
    snap = host_snapshot(state, pin_memory=True)
    assert snap["fp32_flat_groups"][0].data_ptr() != state["fp32_flat_groups"][0].data_ptr()
    assert snap["state"][0]["exp_avg"].data_ptr() != state["state"][0]["exp_avg"].data_ptr()
    state["fp32_flat_groups"][0].add_(1)
    assert float(snap["fp32_flat_groups"][0][0]) == 1.0


def test_the_planners_pool_constants_are_the_jobs():
    pytest.importorskip("torch")
    from ulyssesd.training import train_checkpoints
    from ulyssesd.training.checkpoint import snapshot

    assert hx.POOL_MARGIN_BYTES == train_checkpoints.POOL_MARGIN_BYTES
    assert hx.POOL_ALIGN_BYTES == snapshot.POOL_ALIGN_BYTES
