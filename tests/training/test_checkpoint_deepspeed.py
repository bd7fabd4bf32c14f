"""The file-level checks on REAL DeepSpeed ZeRO-3 output (1 process, CPU, gloo, torch AdamW).

A subprocess saves two tags with DeepSpeed and writes our manifests; the test corrupts the newer tag,
checks that validation catches it and falls back, points `latest` at the older tag, and a second
subprocess loads it through DeepSpeed's own `latest` and gets the step-1 weights back.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from ulyssesd.training import checkpoint as ck

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # avoid a JIT build on CPU
    from ulyssesd.training import checkpoint as ck

    mode, ckpt_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def weights():
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().clone().flatten().tolist() for p in engine.module.parameters()]

    if mode == "save":
        result = {}
        for step in (1, 2):
            loss = engine(torch.randn(2, 8)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            tag = ck.tag_for_step(step)
            engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"data": {"next_sample": 2 * step}})
            torch.distributed.barrier()  # every rank's shard is on disk before rank 0 hashes
            ck.write_manifest(f"{ckpt_dir}/{tag}", step, loss.item(), 2 * step, 1)
            result[tag] = weights()
    else:
        path, client = engine.load_checkpoint(ckpt_dir)  # no tag: whatever `latest` names
        result = {"path": path, "client": client, "weights": weights()}
    with open(out, "w") as fh:
        json.dump(result, fh)
""")


def _run(mode, ckpt_dir, out, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    script = tmp_path / "ds_job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mode, str(ckpt_dir), str(out)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_manifest_checks_on_real_deepspeed_zero3_output(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    saved = _run("save", ckpt_dir, tmp_path / "saved.json", tmp_path)

    assert ck.list_tags(ckpt_dir) == ["step-00000001", "step-00000002"]
    assert ck.read_latest(ckpt_dir) == "step-00000002"  # DeepSpeed's own pointer, read by our parser
    tag2 = ckpt_dir / "step-00000002"
    manifest = ck.read_manifest(tag2)
    files = set(manifest["files"])
    # ZeRO-3 names the model states per rank too (not mp_rank_00_model_states.pt as in stages 0-2).
    assert files == {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert manifest["step"] == 2 and manifest["samples_seen"] == 4
    for tag in ck.list_tags(ckpt_dir):
        assert ck.validate_tag(ckpt_dir / tag) == (True, "ok")

    # Bit flip in the real optimizer shard: sizes still match, the checksum does not.
    optim = tag2 / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(optim, "r+b") as fh:
        fh.seek(optim.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    ok, reason = ck.validate_tag(tag2)
    assert not ok and "zero_pp_rank_0_mp_rank_00_optim_states.pt: sha256" in reason
    assert ck.validate_tag(tag2, verify_checksums=False)[0]

    # Truncation of the model states is caught even by the fast path.
    model_states = tag2 / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    os.truncate(model_states, model_states.stat().st_size - 7)
    ok, reason = ck.validate_tag(tag2, verify_checksums=False)
    assert not ok and "zero_pp_rank_0_mp_rank_00_model_states.pt: size" in reason

    # Fallback chain: skip + quarantine the bad tag, rewrite `latest`, and DeepSpeed loads the good one.
    skipped = []
    good = ck.latest_valid_tag(ckpt_dir, on_invalid=lambda t, r: skipped.append(t))
    assert good == "step-00000001" and skipped == ["step-00000002"]
    ck.quarantine(tag2)
    ck.point_latest_to(ckpt_dir, good)
    loaded = _run("load", ckpt_dir, tmp_path / "loaded.json", tmp_path)
    assert "/step-00000001/" in loaded["path"]
    assert loaded["client"]["data"] == {"next_sample": 2}
    assert loaded["weights"] == saved["step-00000001"]
    assert loaded["weights"] != saved["step-00000002"]  # negative control: the steps really differ
