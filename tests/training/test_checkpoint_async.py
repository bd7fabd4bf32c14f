"""Asynchronous checkpoint writes (training/checkpoint/saving.py AsyncCheckpointWriter): snapshot, background write,
commit only when durable, one save in flight; real DeepSpeed ZeRO-3 output and a real SIGKILL mid-write."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ulyssesd.training import checkpoint as ck


def _commit(tag_dir, world=1, step=2, timeout_s=10.0):
    return lambda: ck.commit_when_durable(tag_dir, world, step, 1.0, 8, 1, timeout_s=timeout_s)


def test_snapshot_is_taken_at_collect_and_committed_after_the_write(tmp_path):
    tag_dir = tmp_path / "ckpt" / ck.tag_for_step(2)
    seen = []
    writer = ck.AsyncCheckpointWriter(0, write_hook=lambda p: (seen.append(p), time.sleep(0.3)))
    w = torch.ones(1000)
    assert writer.begin(tag_dir) == pytest.approx(0.0, abs=0.05)
    writer.collect({"w": w, "meta": {"lr": [0.1]}}, str(tag_dir / "a.pt"))
    writer.start(commit=_commit(tag_dir))
    w.add_(1.0)   # training goes on: the snapshot must keep the value at collect time
    assert writer.in_flight and not (tag_dir / ck.MANIFEST_NAME).exists()
    assert ck.latest_valid_tag(tmp_path / "ckpt") is None   # nothing vouched for before it is durable
    assert writer.wait(10)
    assert torch.equal(torch.load(tag_dir / "a.pt")["w"], torch.ones(1000))
    assert ck.validate_tag(tag_dir) == (True, "ok")
    assert not list(tag_dir.glob(f"{ck.DONE_PREFIX}*")) and not list(tag_dir.glob(".*.tmp-*"))
    assert ck.read_latest(tmp_path / "ckpt") == tag_dir.name and writer.last_bytes > 4000


def test_one_save_in_flight_back_pressure(tmp_path):
    writer = ck.AsyncCheckpointWriter(0, write_hook=lambda p: time.sleep(0.6))
    t1 = tmp_path / ck.tag_for_step(1)
    writer.begin(t1)
    writer.collect({"x": torch.zeros(4)}, str(t1 / "a.pt"))
    writer.start(commit=_commit(t1, step=1))
    t2 = tmp_path / ck.tag_for_step(2)
    waited = writer.begin(t2)   # the next save is due while the first still writes: it waits for it
    assert waited >= 0.4
    assert ck.validate_tag(t1) == (True, "ok")
    with pytest.raises(TimeoutError, match="still writing"):
        writer.collect({"x": torch.zeros(4)}, str(t2 / "a.pt"))
        writer.start(commit=_commit(t2))
        writer.begin(tmp_path / ck.tag_for_step(3), timeout_s=0.05)


def test_a_failed_background_write_leaves_no_manifest_and_is_raised_by_the_next_save(tmp_path):
    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    tag_dir = tmp_path / ck.tag_for_step(2)
    writer = ck.AsyncCheckpointWriter(0, write_hook=full)
    writer.begin(tag_dir)
    writer.collect({"x": torch.zeros(4)}, str(tag_dir / "a.pt"))
    writer.start(commit=_commit(tag_dir))
    assert writer.wait(10)
    assert not (tag_dir / ck.MANIFEST_NAME).exists()
    with pytest.raises(ck.AsyncSaveError, match="ENOSPC") as info:
        writer.begin(tmp_path / ck.tag_for_step(3))
    assert info.value.failure["tag"] == tag_dir.name and info.value.failure["rank"] == 0


def test_commit_waits_for_every_rank_and_gives_up_bounded(tmp_path):
    tag_dir = tmp_path / ck.tag_for_step(2)
    writer = ck.AsyncCheckpointWriter(0)
    writer.begin(tag_dir)
    writer.collect({"x": torch.zeros(4)}, str(tag_dir / "a.pt"))
    writer.start(commit=_commit(tag_dir, world=2, timeout_s=0.3))   # rank 1 never writes its marker
    assert writer.wait(10)
    assert not (tag_dir / ck.MANIFEST_NAME).exists()
    with pytest.raises(ck.AsyncSaveError, match=r"ranks \[1\] did not finish"):
        writer.begin(tmp_path / ck.tag_for_step(3))


# ------------------------------------------------------------------- real DeepSpeed ZeRO-3, real SIGKILL
SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    import deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # avoid a JIT build on CPU
    from ulyssesd.training import checkpoint as ck

    mode, ckpt_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def weights():
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().clone().flatten().tolist() for p in engine.module.parameters()]

    def train():
        loss = engine(torch.randn(2, 64)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        return loss.item()

    if mode == "load":
        path, client = engine.load_checkpoint(ckpt_dir)  # whatever `latest` names
        json.dump({"path": path, "client": client, "weights": weights()}, open(out, "w"))
        sys.exit(0)
    result = {}
    loss = train()
    tag = ck.tag_for_step(1)
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"step": 1}, save_latest=False)
    ck.write_manifest(f"{ckpt_dir}/{tag}", 1, loss, 2, 1)
    ck.point_latest_to(ckpt_dir, tag)
    result[tag] = weights()
    loss = train()
    tag = ck.tag_for_step(2)
    calls = []

    def hook(path):  # kill: the first shard lands, the second never does (SIGKILL mid-save); save: slow disk
        calls.append(path)
        if mode == "save" or len(calls) > 1:
            time.sleep(3600.0 if mode == "kill" else 1.0)

    writer = ck.AsyncCheckpointWriter(0, write_hook=hook)
    writer.begin(f"{ckpt_dir}/{tag}")
    real = engine.checkpoint_engine.save
    engine.checkpoint_engine.save = writer.collect
    t0 = time.monotonic()
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"step": 2}, save_latest=False)
    del engine.checkpoint_engine.save
    commit = lambda: ck.commit_when_durable(f"{ckpt_dir}/{tag}", 1, 2, loss, 4, 1, timeout_s=60)
    writer.start(commit=commit)
    result["blocked_s"] = time.monotonic() - t0
    result[tag] = weights()
    if mode == "kill":
        while len(calls) < 2:   # the first shard is durable, the second is being written
            time.sleep(0.01)
    print("WRITING", flush=True)
    train()   # training goes on while the shards are written
    result["step3"] = weights()
    assert writer.wait(120)
    writer.begin(f"{ckpt_dir}/{ck.tag_for_step(3)}")  # raises if the background save failed
    json.dump(result, open(out, "w"))
""")


def _env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


def _run(mode, ckpt_dir, out, tmp_path):
    script = tmp_path / "ds_job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mode, str(ckpt_dir), str(out)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_async_save_of_real_deepspeed_zero3_resumes_bit_exact(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    saved = _run("save", ckpt_dir, tmp_path / "saved.json", tmp_path)
    tag2 = ckpt_dir / "step-00000002"
    assert ck.validate_tag(tag2) == (True, "ok") and ck.read_latest(ckpt_dir) == "step-00000002"
    assert set(ck.read_manifest(tag2)["files"]) >= {"zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert saved["step3"] != saved["step-00000002"]   # training changed the weights during the write
    loaded = _run("load", ckpt_dir, tmp_path / "loaded.json", tmp_path)
    assert loaded["client"]["step"] == 2
    assert loaded["weights"] == saved["step-00000002"]   # the snapshot, not the weights of step 3


@pytest.mark.slow
def test_sigkill_during_the_background_write_leaves_the_previous_tag_loadable(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    script = tmp_path / "ds_job.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), "kill", str(ckpt_dir), str(tmp_path / "x.json")],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "WRITING" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "WRITING" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else "no WRITING"
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    tag2 = ckpt_dir / "step-00000002"
    assert tag2.is_dir() and not (tag2 / ck.MANIFEST_NAME).exists()   # mid-write: no manifest
    assert len([p for p in tag2.iterdir() if p.suffix == ".pt"]) == 1     # one shard landed, one did not
    assert ck.validate_tag(tag2)[0] is False
    assert ck.latest_valid_tag(ckpt_dir) == "step-00000001" and ck.read_latest(ckpt_dir) == "step-00000001"
    loaded = _run("load", ckpt_dir, tmp_path / "loaded.json", tmp_path)
    assert loaded["client"]["step"] == 1
