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

import psutil
import pytest
import torch
import train_job_helpers as h

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.telemetry import validate_record
from ulyssesd.training.train_checkpoints import ASYNC_WRITE_DELAY_ENV


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
    # The snapshot pool's sizing (every tensor here: on the CPU nothing is on a device) against what the save hands over.
    result["sized_bytes"] = ck.engine_snapshot_bytes(engine, device_only=False)
    result["handed_bytes"] = 0

    def collect(state_dict, path):
        result["handed_bytes"] += ck.snapshot_pool_bytes([state_dict], device_only=False)
        writer.collect(state_dict, path)

    engine.checkpoint_engine.save = collect
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
    # The snapshot pool sized from the engine after a step holds every tensor the save hands over (ZeRO-3:
    # fp32 partition + Adam moments, the module's placeholders), give or take its small non-state tensors.
    assert saved["handed_bytes"] > 64 * 64 * 4 * 3
    assert 0.98 * saved["handed_bytes"] <= saved["sized_bytes"] <= saved["handed_bytes"] * 1.02 + 4096, saved
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


# ------------------------------------------------ the job with [checkpoint] async_save (2 ranks, torchrun)
def _losses(run, attempt=None):
    return {step: (rec["loss"], rec["grad_norm"]) for step, rec in run.steps(attempt).items()}


@pytest.mark.slow
def test_job_with_async_save_completes_and_resumes_bit_exact(tmp_path):
    ref = h.launch(h.tiny_spec(), tmp_path / "sync")
    assert ref.returncode == 0, ref.output[-4000:]
    # Async on: the same 6 steps (saves at 2, 4 and 6, the last one waited for at exit) ...
    run_dir = tmp_path / "async"
    first = h.launch(h.tiny_spec(checkpoint={"async_save": True}), run_dir)
    assert first.returncode == 0, first.output[-4000:]
    assert _losses(first) == _losses(ref)   # exact, step by step (fp32 on CPU)
    saved = first.events("checkpoint_saved")
    assert [(e["tag"], e["step"], e["async_save"]) for e in saved] == [
        ("step-00000002", 2, True), ("step-00000004", 4, True), ("step-00000006", 6, True)]
    assert all(e["bytes"] > 0 and 0 <= e["blocked_seconds"] <= e["seconds"] for e in saved)
    root = run_dir / "checkpoints"
    for tag in ("step-00000002", "step-00000004", "step-00000006"):
        assert ck.validate_tag(root / tag) == (True, "ok")
        assert not [p.name for p in (root / tag).iterdir() if p.name.startswith(".")]   # no markers left
    assert ck.read_latest(root) == "step-00000006"
    # ... and a resume from the step-4 tag written in the background repeats steps 5 and 6 exactly.
    second = h.launch(h.tiny_spec(checkpoint={"async_save": True, "load": "step-00000004"}), run_dir, attempt=2)
    assert second.returncode == 0, second.output[-4000:]
    assert [e["tag"] for e in second.events("checkpoint_loaded", 2)] == ["step-00000004"]
    resumed = _losses(second, 2)
    assert sorted(resumed) == [5, 6] and resumed == {s: _losses(ref)[s] for s in (5, 6)}
    for rec in first.records() + second.records():
        assert validate_record(rec) == [], rec


@pytest.mark.slow
def test_sigkill_of_a_rank_during_the_jobs_background_write_keeps_the_previous_tag(tmp_path):
    spec = h.tiny_spec(checkpoint={"async_save": True})
    proc = h.start(spec, tmp_path, env={ASYNC_WRITE_DELAY_ENV: "2.0"})   # each shard write waits 2 s
    run = h.JobRun(tmp_path, None, "")
    # step-2 is durable (checkpoint_saved) and the step-4 save has handed its shards to the writer.
    h.wait_for(lambda: run.events("checkpoint_saving") and run.events("checkpoint_saving")[-1]["tag"]
               == "step-00000004" and run.events("checkpoint_saved"), 240, "the step-4 async save", proc)
    assert [e["tag"] for e in run.events("checkpoint_saved")] == ["step-00000002"]
    tag4 = tmp_path / "checkpoints" / "step-00000004"
    h.wait_for(lambda: list(tag4.glob("*.pt")), 60, "the first step-4 shard on disk", proc)   # then 2 s to the next
    ranks = [p for p in psutil.Process(proc.pid).children() if "ulyssesd.training" in " ".join(p.cmdline())]
    assert len(ranks) == 2, ranks
    ranks[-1].send_signal(signal.SIGKILL)
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    root = tmp_path / "checkpoints"
    assert not (tag4 / ck.MANIFEST_NAME).exists() and len(list(tag4.glob("*.pt"))) < 4   # killed mid-write
    assert ck.validate_tag(root / "step-00000004")[0] is False
    assert ck.latest_valid_tag(root) == "step-00000002" and ck.read_latest(root) == "step-00000002"
    again = h.launch(spec, tmp_path, attempt=2)
    assert again.returncode == 0, again.output[-4000:]
    assert [e["tag"] for e in again.events("checkpoint_loaded", 2)] == ["step-00000002"]
    assert sorted(again.steps(2)) == [3, 4, 5, 6]


def test_async_save_is_off_by_default_and_validated():
    from ulyssesd.training.spec import SpecError

    assert h.tiny_spec().checkpoint.async_save is False
    assert h.tiny_spec(checkpoint={"async_save": True}).checkpoint.async_save is True
    with pytest.raises(SpecError, match="async_save"):
        h.tiny_spec(checkpoint={"async_save": "sometimes"})


@pytest.mark.slow
def test_a_failed_background_write_is_exit_4_at_the_next_save(tmp_path):
    spec = h.tiny_spec(checkpoint={"async_save": True}, faults=[{"kind": "read_only_fs", "at_step": 4}])
    run = h.launch(spec, tmp_path)
    assert run.returncode != 0 and "exitcode  : 4" in run.output, run.output[-4000:]   # each rank's, via torchrun
    failed = run.events("checkpoint_save_failed")
    assert len(failed) == 1 and failed[0]["errno"] == "EROFS" and failed[0]["tag"] == "step-00000004"
    assert sorted(failed[0]["failed_ranks"]) == [0, 1]
    assert failed[0]["step"] == 6   # raised by the next save (step 6), which waited for step 4's write
    assert [e["tag"] for e in run.events("checkpoint_saved")] == ["step-00000002"]
    assert run.events("exiting")[-1]["reason"] == "checkpoint_save_failed"
    root = tmp_path / "checkpoints"
    assert ck.latest_valid_tag(root) == "step-00000002" and ck.read_latest(root) == "step-00000002"


# ----------------------------------------------------------------- write path of issue 21 (perf, same format)
def test_write_shard_hashes_on_the_way_and_loads_without_torch_crc(tmp_path):
    state = {"w": torch.randn(300_000), "meta": {"step": 3}}
    size, sha = ck.write_shard(state, tmp_path / "s.pt")
    assert size == (tmp_path / "s.pt").stat().st_size and sha == ck.sha256_file(tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt")
    assert torch.equal(back["w"], state["w"]) and back["meta"] == {"step": 3}
    assert torch.serialization.get_crc32_options() is True   # the process-wide switch was restored
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_commit_takes_the_writers_digests_and_rehashes_only_what_they_do_not_cover(tmp_path, monkeypatch):
    from ulyssesd.training.checkpoint import files

    tag_dir = tmp_path / ck.tag_for_step(2)
    writer = ck.AsyncCheckpointWriter(0)
    writer.begin(tag_dir)
    writer.collect({"x": torch.arange(50_000.0)}, str(tag_dir / "a.pt"))
    writer.start()   # no commit yet: the marker with the digests stays
    assert writer.wait(10) and writer.take_failure() is None
    marker = json.loads((tag_dir / f"{ck.DONE_PREFIX}0").read_text())
    assert marker["a.pt"]["sha256"] == ck.sha256_file(tag_dir / "a.pt")
    (tag_dir / "extra.txt").write_text("copied by DeepSpeed, not by the writer")
    hashed = []
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p, *a: (hashed.append(os.path.basename(p)), real(p, *a))[1])
    manifest = ck.commit_when_durable(tag_dir, 1, 2, 1.0, 8, 1, timeout_s=5)
    assert hashed == ["extra.txt"]   # the 200 KB shard was not read again
    assert manifest["files"]["a.pt"]["sha256"] == marker["a.pt"]["sha256"]
    monkeypatch.undo()
    assert ck.validate_tag(tag_dir, verify_checksums=True) == (True, "ok")


def test_commit_rehashes_a_file_whose_size_differs_from_the_marker(tmp_path):
    tag_dir = tmp_path / ck.tag_for_step(2)
    tag_dir.mkdir()
    (tag_dir / "a.pt").write_bytes(b"x" * 100)
    (tag_dir / f"{ck.DONE_PREFIX}0").write_text(json.dumps({"a.pt": {"size": 99, "sha256": "0" * 64}}))
    manifest = ck.commit_when_durable(tag_dir, 1, 2, 1.0, 8, 1, timeout_s=5)
    assert manifest["files"]["a.pt"]["sha256"] == ck.sha256_file(tag_dir / "a.pt")


def test_pinned_pool_hands_the_same_buffers_to_the_next_save():
    pool = ck.PinnedPool()
    like = torch.zeros(1000, dtype=torch.bfloat16)
    a = pool.take(like, pin=False)
    assert pool.allocated_bytes == 2000 and pool.held_bytes == 2000
    pool.give_back([a])
    pool.allocated_bytes = 0
    b = pool.take(like, pin=False)
    assert b is a and pool.allocated_bytes == 0 and pool.held_bytes == 2000
    assert pool.take(torch.zeros(1000, dtype=torch.float32), pin=False) is not a   # other dtype: new buffer


def test_direct_write_pipeline_equals_the_buffered_one_across_buffer_edges(tmp_path, monkeypatch):
    from ulyssesd.training.checkpoint import shard_io as saving

    monkeypatch.setattr(saving, "DIRECT_BUFFER_BYTES", 1 << 16)   # many full buffers plus a partial tail block
    monkeypatch.setattr(saving, "DIRECT_BUFFERS", 2)
    state = {"a": torch.randn(100_003), "b": torch.arange(7, dtype=torch.int16), "meta": [1, "x"]}
    size, sha = saving.write_shard_direct(state, tmp_path / "direct.pt", mode="whole")   # + the file's sha256
    assert size == (tmp_path / "direct.pt").stat().st_size and sha == ck.sha256_file(tmp_path / "direct.pt")
    back = torch.load(tmp_path / "direct.pt")
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"]) and back["meta"] == [1, "x"]
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_direct_write_failure_leaves_no_file_and_names_the_error(tmp_path, monkeypatch):
    from ulyssesd.training.checkpoint import shard_io as saving

    monkeypatch.setattr(saving, "DIRECT_BUFFER_BYTES", 1 << 16)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        saving.write_shard_direct({"a": torch.randn(50_000)}, tmp_path / "x.pt")
    assert not list(tmp_path.iterdir())
