"""`model.offload_checkpoints`: checkpointed block inputs go to host memory in forward and come back for
their recompute in backward. Same math bit for bit (the same kernels run on the same values), the device
copies really die, the restored copies really feed the recompute, and the option is refused without
recompute."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from model_helpers import tiny_model as _model
from model_helpers import token_batch as _batch
from train_job_helpers import launch, tiny_spec

from ulyssesd.training.model import offload
from ulyssesd.training.spec import SpecError, job_spec_from_dict

H, TOKENS = 64, 2 * 32   # tiny preset width; token_batch's b·s


def _loss_and_grads(m):
    loss = m(*_batch())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


CASES = {
    "every layer": dict(checkpoint_every=1),
    "chunks of 2": dict(checkpoint_every=2),
    "first block only": dict(checkpoint_layers=1),
    "keep attention + TiledMLP + tiled loss": dict(checkpoint_every=1, loss_chunk_tokens=24,
                                                  model={"checkpoint_keep_attention": True,
                                                         "mlp_chunk_tokens": 16, "mlp": "swiglu"}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_offload_gives_bit_identical_loss_and_grads(case):
    kw = CASES[case]
    model_kw = kw.get("model", {})
    ref = _model(**{**kw, "model": model_kw})
    off = _model(**{**kw, "model": {**model_kw, "offload_checkpoints": True}})
    (l1, g1), (l2, g2) = _loss_and_grads(ref), _loss_and_grads(off)
    assert torch.equal(l1, l2), (l1, l2)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
    # Every checkpointed chunk input went to the host and came back exactly once; nothing else did.
    chunks = {"every layer": 4, "chunks of 2": 2, "first block only": 1}.get(case, 4)
    stats = off.last_offload
    assert (stats.tensors, stats.restored, stats.bytes) == (chunks, chunks, chunks * TOKENS * H * 4)
    assert ref.last_offload is None


def test_the_device_copies_die_and_only_the_host_copies_are_kept():
    """Without offload autograd keeps each checkpointed input alive until backward; with it nothing on
    the device refers to them after forward (on the GPU that is the memory the option frees)."""
    def alive_inputs(offload_on: bool) -> int:
        m = _model(checkpoint_every=1, model={"offload_checkpoints": offload_on})
        refs = []
        for blk in m.blocks:
            blk.register_forward_pre_hook(lambda mod, args: refs.append(weakref.ref(args[0])))
        loss = m(*_batch())
        gc.collect()
        # Forward only (recompute in backward would add more): one input per block.
        alive = sum(r() is not None for r in refs[:len(m.blocks)])
        loss.backward()
        return alive

    assert alive_inputs(False) == 4
    assert alive_inputs(True) == 0


def test_the_recompute_really_reads_the_restored_host_copy(monkeypatch):
    """Negative control: corrupt what comes back from the host and the gradients change (so the equality
    above is not the device copy being used behind the offloader's back)."""
    ref_loss, ref_grads = _loss_and_grads(_model(checkpoint_every=1))
    restore = offload.CheckpointInputOffloader._restore

    def corrupted(self, packed):
        out = restore(self, packed)
        return out * 0.5 if isinstance(packed, int) else out

    monkeypatch.setattr(offload.CheckpointInputOffloader, "_restore", corrupted)
    loss, grads = _loss_and_grads(_model(checkpoint_every=1, model={"offload_checkpoints": True}))
    assert torch.equal(loss, ref_loss)   # forward is untouched
    assert any(not torch.equal(grads[n], ref_grads[n]) for n in grads if n.startswith("blocks."))


def test_eval_and_no_grad_forward_offload_nothing():
    m = _model(checkpoint_every=1, model={"offload_checkpoints": True})
    with torch.no_grad():
        m(*_batch())
    m.eval()
    m(*_batch())
    assert m.last_offload is None


def test_a_first_forward_that_would_not_fit_host_ram_fails_with_the_numbers_and_later_ones_are_not_rechecked(
        monkeypatch):
    each = TOKENS * H * 4
    # Room for 3 of the 4 block inputs after the reserve: the 4th is refused, naming the option.
    monkeypatch.setattr(offload, "host_bytes_available", lambda: offload.HOST_RESERVE_BYTES + 3 * each)
    m = _model(checkpoint_every=1, model={"offload_checkpoints": True})
    with pytest.raises(offload.HostMemoryError, match=r"model\.offload_checkpoints: checkpointed block input 4"):
        m(*_batch())
    # Enough room: the same first forward passes; afterwards the pinned blocks are reused, no new check.
    monkeypatch.setattr(offload, "host_bytes_available", lambda: offload.HOST_RESERVE_BYTES + 4 * each)
    m(*_batch()).backward()
    assert m.last_offload.host_bytes == 4 * each
    monkeypatch.setattr(offload, "host_bytes_available", lambda: 0)
    m(*_batch()).backward()
    # Ranks of one node share its RAM.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(offload, "host_bytes_available", lambda: offload.HOST_RESERVE_BYTES + 8 * each)
    assert offload.first_forward_host_budget() == 2 * each


def test_offloader_bounds_its_in_flight_copies():
    with pytest.raises(ValueError, match="max_in_flight=0"):
        offload.CheckpointInputOffloader(max_in_flight=0)


def test_spec_default_off_and_refused_without_recompute_naming_the_keys():
    assert job_spec_from_dict({"model": {"preset": "tiny"}}).resolved_model().offload_checkpoints is False
    with pytest.raises(SpecError) as exc:
        job_spec_from_dict({"model": {"preset": "tiny", "offload_checkpoints": True}})
    msg = str(exc.value)
    assert "model.offload_checkpoints" in msg and "activation_checkpoint_every" in msg
    with pytest.raises(SpecError):
        job_spec_from_dict({"model": {"preset": "tiny", "offload_checkpoints": True},
                            "train": {"activation_checkpoint_every": 1, "activation_checkpoint_layers": 0}})
    for train in ({"activation_checkpoint_every": 1}, {"activation_checkpoint_layers": 2}):
        spec = job_spec_from_dict({"model": {"preset": "tiny", "offload_checkpoints": True}, "train": train})
        assert spec.resolved_model().offload_checkpoints


@pytest.mark.slow
def test_deepspeed_zero3_sp2_job_losses_are_identical_step_by_step(tmp_path):
    """Real job: 2 gloo ranks, ZeRO-3 + Ulysses SP=2, fp32, every block recomputed, 4 steps: the loss and
    grad norm of every step are equal (0 tolerance) with and without the offload."""
    runs = {}
    for on in (False, True):
        spec = tiny_spec(model={"offload_checkpoints": on},
                         train={"steps": 4, "activation_checkpoint_every": 1}, checkpoint={"save_at_end": False})
        runs[on] = run = launch(spec, tmp_path / f"offload{int(on)}")
        assert run.returncode == 0, run.output[-4000:]
    assert "offload_checkpoints: 4 checkpointed block inputs" in runs[True].output
    assert "offload_checkpoints:" not in runs[False].output
    ref, off = runs[False].steps(), runs[True].steps()
    assert sorted(ref) == sorted(off) == [1, 2, 3, 4]
    for step in ref:
        assert off[step]["loss"] == ref[step]["loss"], step
        assert off[step]["grad_norm"] == ref[step]["grad_norm"], step


@pytest.mark.parametrize("kw,keep,offloaded", [(dict(checkpoint_every=1), 2, 2), (dict(checkpoint_every=1), 4, 0),
                                               (dict(checkpoint_every=1), 9, 0), (dict(checkpoint_every=2), 1, 1),
                                               (dict(checkpoint_layers=3), 1, 2)],
                         ids=["every layer keep 2", "keep all", "keep more than there are", "chunks of 2 keep 1",
                              "first 3 blocks keep 1"])
def test_keep_last_leaves_the_last_chunks_on_the_device_and_the_math_unchanged(kw, keep, offloaded):
    """`model.offload_keep_last=N`: the last N checkpointed chunks are not offloaded (backward needs them
    first); the others are, and loss and gradients stay bit-identical to no offload."""
    ref = _model(**kw)
    off = _model(**kw, model={"offload_checkpoints": True, "offload_keep_last": keep})
    (l1, g1), (l2, g2) = _loss_and_grads(ref), _loss_and_grads(off)
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    stats = off.last_offload
    assert (stats.tensors, stats.restored, stats.bytes) == (offloaded, offloaded, offloaded * TOKENS * H * 4)


def test_keep_last_without_offload_is_refused_naming_both_keys():
    with pytest.raises(SpecError) as exc:
        job_spec_from_dict({"model": {"preset": "tiny", "offload_keep_last": 2},
                            "train": {"activation_checkpoint_every": 1}})
    assert "model.offload_keep_last=2" in str(exc.value) and "model.offload_checkpoints" in str(exc.value)
    with pytest.raises(SpecError, match="offload_keep_last"):
        job_spec_from_dict({"model": {"preset": "tiny", "offload_checkpoints": True, "offload_keep_last": -1},
                            "train": {"activation_checkpoint_every": 1}})
