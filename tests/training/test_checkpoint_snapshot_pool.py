"""The async writer's registered snapshot pool (training/checkpoint/snapshot.py SnapshotPool): built in the
background chunk by chunk, carved into views of any dtype, reused by every save, released in the right order,
and refused when the host lacks the memory. The driver calls go through a fake registrar (the seam), so this
runs on the CPU; tests/training/test_checkpoint_async_cuda.py runs the real cudaHostRegister on a GPU."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint.saving import pool_refusal
from ulyssesd.training.checkpoint.snapshot import POOL_ALIGN_BYTES, aligned_bytes

KIB = 1024


class FakeRegistrar:
    """Records every register/unregister; can hold a registration (a slow driver) or fail the n-th one."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None):
        self.calls: list[tuple[str, int, int]] = []
        self.live: dict[int, int] = {}
        self.fail_at, self.gate = fail_at, gate
        self.pool: ck.SnapshotPool | None = None
        self.freed_while_registered = False

    def register(self, ptr, nbytes):
        if self.gate is not None:
            assert self.gate.wait(10), "the test never let the registration go on"
        if self.fail_at is not None and len(self.live) == self.fail_at:
            raise RuntimeError("cudaHostRegister failed: CUDA error 2 (out of memory)")
        self.calls.append(("register", ptr, nbytes))
        self.live[ptr] = nbytes

    def unregister(self, ptr):
        # The memory must still be there when the driver lets go of it.
        if self.pool is not None and self.pool._buffer is None:
            self.freed_while_registered = True
        self.calls.append(("unregister", ptr, self.live.pop(ptr)))


def _ready_pool(nbytes, chunk=4 * KIB, registrar=None):
    registrar = registrar or FakeRegistrar()
    pool = ck.SnapshotPool(nbytes, registrar, chunk_bytes=chunk, pause_s=0.0)
    registrar.pool = pool
    pool.start()
    assert pool.wait_ready(10), pool.state
    return pool, registrar


def test_the_pool_registers_its_whole_arena_in_chunks_in_the_background():
    pool, reg = _ready_pool(10 * KIB + 100, chunk=4 * KIB)
    assert pool.nbytes == aligned_bytes(10 * KIB + 100) == 10 * KIB + 256
    # Three chunks, back to back from the arena's start, covering it exactly.
    sizes = [n for _, _, n in reg.calls]
    ptrs = [p for _, p, _ in reg.calls]
    assert sizes == [4 * KIB, 4 * KIB, 2 * KIB + 256]
    assert ptrs == [pool._base, pool._base + 4 * KIB, pool._base + 8 * KIB]
    assert pool.ready and pool.describe() == "ready" and pool.registered_bytes == pool.nbytes
    assert pool.build_s >= pool.register_s >= 0


def test_the_builder_paces_its_chunks():
    reg = FakeRegistrar()
    pool = ck.SnapshotPool(4 * 4 * KIB, reg, chunk_bytes=4 * KIB, pause_s=0.1).start()
    assert not pool.ready   # still filling right after start
    assert pool.wait_ready(10)
    assert pool.build_s >= 0.3   # three pauses between four chunks, none after the last
    assert len(reg.calls) == 4


def test_snapshot_bytes_round_each_device_tensor_and_skip_host_ones():
    assert aligned_bytes(1) == POOL_ALIGN_BYTES and aligned_bytes(0) == 0 and aligned_bytes(512) == 512
    # Off-GPU state holds no device tensors: nothing to register.
    assert ck.snapshot_pool_bytes([{"a": torch.zeros(10), "b": [torch.zeros(3)]}]) == 0


def test_views_of_any_dtype_and_shape_are_carved_without_overlap_and_reused_after_reset():
    pool, _ = _ready_pool(64 * KIB)
    likes = [torch.zeros(3, 5, dtype=torch.float32), torch.zeros(7, dtype=torch.bfloat16),
             torch.zeros((), dtype=torch.int64), torch.zeros(0, 4), torch.zeros(9, dtype=torch.bool)]
    views = [pool.take(like) for like in likes]
    spans = []
    for like, view in zip(likes, views, strict=True):
        assert view is not None and view.dtype == like.dtype and view.shape == like.shape
        off = view.data_ptr() - pool._base if view.numel() else None
        if off is not None:
            assert off % POOL_ALIGN_BYTES == 0
            spans.append((off, off + view.numel() * view.element_size()))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))   # in order, disjoint
    assert pool.used_bytes == sum(x.numel() * x.element_size() for x in likes)
    views[0].copy_(torch.arange(15.0).view(3, 5))
    views[1].fill_(2.5)
    assert torch.equal(views[0], torch.arange(15.0).view(3, 5)) and bool((views[1] == 2.5).all())
    # The next save (after reset) gets the same memory again: nothing new is allocated or registered.
    pool.reset()
    again = pool.take(likes[0])
    assert again.data_ptr() == views[0].data_ptr() and pool.used_bytes == 60


def test_a_saved_view_writes_its_own_bytes_not_the_whole_arena(tmp_path):
    # A slice of one big tensor would make torch.save write the arena's whole storage with every shard.
    pool, _ = _ready_pool(16 << 20, chunk=4 << 20)
    a = pool.take(torch.zeros(1000))
    b = pool.take(torch.zeros(10, dtype=torch.bfloat16))
    a.copy_(torch.arange(1000.0))
    b.fill_(1.5)
    ck.durable_torch_save({"a": a, "b": b}, tmp_path / "shard.pt")
    assert (tmp_path / "shard.pt").stat().st_size < 16 * KIB   # 4 KB of tensors, not 16 MiB
    back = torch.load(tmp_path / "shard.pt")
    assert torch.equal(back["a"], torch.arange(1000.0)) and bool((back["b"] == 1.5).all())
    size, _ = ck.write_shard_direct({"a": a}, str(tmp_path / "direct.pt"))
    assert size < 16 * KIB


def test_a_tensor_that_does_not_fit_gets_none_and_smaller_ones_still_fit():
    pool, _ = _ready_pool(4 * KIB, chunk=4 * KIB)
    assert pool.take(torch.zeros(2 * KIB // 4)) is not None   # 2 KiB of 4
    assert pool.take(torch.zeros(3 * KIB // 4)) is None      # 3 KiB more does not fit
    assert pool.take(torch.zeros(KIB // 4)) is not None      # 1 KiB does


def test_copy_into_splits_at_registration_boundaries_and_equals_a_plain_copy():
    pool, _ = _ready_pool(64 * KIB, chunk=4 * KIB)
    pool.take(torch.zeros(300, dtype=torch.uint8))   # later views start mid-chunk
    src = torch.randn(5000)   # 20000 bytes: spans six chunks
    out = pool.take(src)
    pieces = []
    real_copy = torch.Tensor.copy_

    def spy(self, other, non_blocking=False):
        pieces.append((self.data_ptr() - pool._base, self.numel() * self.element_size()))
        return real_copy(self, other, non_blocking=non_blocking)

    torch.Tensor.copy_ = spy
    try:
        pool.copy_into(out, src)
    finally:
        torch.Tensor.copy_ = real_copy
    assert torch.equal(out, src)
    assert len(pieces) == 6 and sum(n for _, n in pieces) == src.numel() * 4
    for start, n in pieces:   # each piece lies inside one registered chunk
        assert start // (4 * KIB) == (start + n - 1) // (4 * KIB)
    small = pool.take(torch.zeros(10))
    pool.copy_into(small, torch.ones(10))   # inside one chunk: one copy
    assert torch.equal(small, torch.ones(10))


def test_not_ready_means_no_views_and_release_while_filling_unregisters_before_freeing():
    gate = threading.Event()
    reg = FakeRegistrar(gate=gate)
    pool = ck.SnapshotPool(16 * KIB, reg, chunk_bytes=4 * KIB, pause_s=0.2)
    reg.pool = pool
    pool.start()
    assert pool.take(torch.zeros(4)) is None and pool.describe().startswith("filling (0.00 of")
    gate.set()
    deadline = time.monotonic() + 10
    while not reg.live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.take(torch.zeros(4)) is None   # partly registered is not ready
    assert pool.release(timeout_s=10)
    assert pool.state == "released" and not pool.ready and pool._buffer is None
    registered = [p for kind, p, _ in reg.calls if kind == "register"]
    unregistered = [p for kind, p, _ in reg.calls if kind == "unregister"]
    assert registered and unregistered == registered[::-1] and not reg.live   # every chunk, newest first
    assert not reg.freed_while_registered
    assert len(registered) < 4   # the pause was cut short: the builder stopped


def test_release_of_a_ready_pool_unregisters_every_chunk_then_frees():
    pool, reg = _ready_pool(12 * KIB, chunk=4 * KIB)
    assert pool.release()
    assert [k for k, _, _ in reg.calls] == ["register"] * 3 + ["unregister"] * 3
    assert not reg.live and not reg.freed_while_registered and pool._buffer is None
    assert pool.take(torch.zeros(4)) is None


def test_a_failed_registration_holds_nothing_and_says_why():
    reg = FakeRegistrar(fail_at=2)
    pool = ck.SnapshotPool(16 * KIB, reg, chunk_bytes=4 * KIB, pause_s=0.0)
    reg.pool = pool
    pool.start()
    assert not pool.wait_ready(10)
    assert pool.state.startswith("failed: RuntimeError: cudaHostRegister failed")
    assert not reg.live and not reg.freed_while_registered and pool._buffer is None   # the two chunks undone
    assert pool.take(torch.zeros(4)) is None


def test_bad_sizes_are_refused_with_their_value():
    with pytest.raises(ValueError, match="positive, got 0 bytes"):
        ck.SnapshotPool(0, FakeRegistrar())
    with pytest.raises(ValueError, match="chunk of 1000 bytes"):
        ck.SnapshotPool(4 * KIB, FakeRegistrar(), chunk_bytes=1000)


def test_a_pool_that_does_not_fit_the_host_is_refused_politely(caplog):
    gib = 1 << 30
    assert pool_refusal(17 * gib, 1, 120 * gib, 125 * gib) is None
    why = pool_refusal(17 * gib, 8, 120 * gib, 125 * gib)   # 8 ranks on the host: 146 GB of pools
    assert why is not None and "8 x 18.25 GB" in why and "128.8 GB of host memory available" in why
    writer = ck.AsyncCheckpointWriter(0)
    with caplog.at_level(logging.WARNING, logger="ulyssesd.training"):
        state = writer.prepare_pool(17 * gib, FakeRegistrar(), ranks_on_host=8, memory=(120 * gib, 125 * gib))
    assert state.startswith("refused: 8 x") and writer.snapshot_pool is None
    assert "no snapshot pool" in caplog.text and "pinned buffers" in caplog.text
    writer.begin("/nonexistent/step-1")
    assert writer.pool_fields()["snapshot_pool"].startswith("refused")


def test_the_writer_builds_its_pool_once_and_releases_it_on_close(tmp_path):
    writer = ck.AsyncCheckpointWriter(0)
    reg = FakeRegistrar()
    state = writer.prepare_pool(8 * KIB, reg, chunk_bytes=4 * KIB, pause_s=0.0, memory=(100 << 30, 100 << 30))
    assert state.startswith("filling") or state == "ready"
    assert writer.snapshot_pool.wait_ready(10)
    assert writer.prepare_pool(8 * KIB, reg, memory=(100 << 30, 100 << 30)) == "ready"   # no second pool
    tag_dir = tmp_path / ck.tag_for_step(1)
    writer.begin(tag_dir)
    assert writer.pool_fields() == {"snapshot_pool": "ready", "snapshot_pool_bytes": 0, "snapshot_fallback_bytes": 0}
    # Host tensors are copied into plain memory, never into the pool (off-GPU nothing is registered for them).
    writer.collect({"w": torch.ones(100)}, str(tag_dir / "a.pt"))
    assert writer.pool_fields()["snapshot_pool_bytes"] == 0 and writer.snapshot_pool.used_bytes == 0
    writer.start(commit=lambda: ck.commit_when_durable(tag_dir, 1, 1, 1.0, 8, 1, timeout_s=10))
    writer.close()
    assert writer.snapshot_pool is None and not reg.live
    assert [k for k, _, _ in reg.calls] == ["register", "register", "unregister", "unregister"]
    assert ck.validate_tag(tag_dir) == (True, "ok")


def test_the_gpu_tests_save_helpers_work_on_the_cpu(tmp_path):
    """The CUDA tests' save/check helpers, run here on CPU tensors for two saves in a row: the lent GPU
    machine is scarce, so their own mistakes should show up on this box first."""
    from test_checkpoint_async_cuda import _check_written, _save

    writer = ck.AsyncCheckpointWriter(0)
    state = {"optimizer_state_dict": {"state": {0: {"exp_avg_sq": torch.arange(10.0)}}},
             "fp32_flat_groups": [torch.ones(4, dtype=torch.bfloat16)]}
    for step in (1, 2):
        tag_dir = tmp_path / ck.tag_for_step(step)
        assert _save(writer, tag_dir, state) >= 0
        _check_written(writer, tag_dir, state)
        assert ck.read_manifest(tag_dir)["step"] == step
