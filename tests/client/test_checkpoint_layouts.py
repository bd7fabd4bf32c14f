"""A command job's checkpoints recognised from the files each framework really writes (daemon/job/
checkpoint_files.py): the step, the completion marker, a save still being written (never complete), two
equal looks, rollback bounds and set-aside, and the loud message for a layout nothing recognises."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from ulyssesd.daemon.job.checkpoint_files import (
    RollbackBounds,
    WatchConfig,
    look,
    resume_point,
    set_aside_after,
    step_of_name,
)
from ulyssesd.daemon.job.checkpoint_watch import Watch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))


def _by_name(root: Path, pattern: str | None = None) -> dict:
    found, _ = look(root, pattern)
    return {f.name: f for f in found}


def _truncate(path: Path, keep: float = 0.6) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("name, step", [
    ("checkpoint-500", 500), ("global_step40", 40), ("iter_0000040", 40), ("epoch=0-step=40.ckpt", 40),
    ("epoch=3-step=1200-val_loss=0.12.ckpt", 1200), ("step_000040.pt", 40), ("step-00000010", 10),
    ("ckpt_e3_s400.pt", 400), ("latest", None), ("last.ckpt", None),
])
def test_the_step_comes_from_the_name(name, step):
    assert step_of_name(name) == step


def test_plain_step_dirs_and_files_written_with_torch_save(tmp_path):
    m = _model()
    d = tmp_path / "step_000040"
    d.mkdir()
    torch.save(m.state_dict(), d / "model.pt")
    torch.save({"step": 40}, d / "optim.pt")
    torch.save(m.state_dict(), tmp_path / "step_000050.pt")
    torch.save(m.state_dict(), tmp_path / "step_000060.pt")
    _truncate(tmp_path / "step_000060.pt")   # a save killed midway: no zip end record
    (tmp_path / "train.log").write_text("not a checkpoint\n")
    got = _by_name(tmp_path)
    assert set(got) == {"step_000040", "step_000050.pt", "step_000060.pt"}
    assert got["step_000040"].step == 40 and got["step_000040"].marker_ok and got["step_000040"].layout == "dir"
    assert got["step_000050.pt"].marker_ok and got["step_000050.pt"].layout == "file"
    assert not got["step_000060.pt"].marker_ok and "end record" in got["step_000060.pt"].why_not
    chosen, _ = resume_point(WatchConfig(root=tmp_path))
    assert chosen is not None and chosen.name == "step_000050.pt"
    _truncate(d / "model.pt")   # a dir whose torch file is cut is not complete either
    assert not _by_name(tmp_path)["step_000040"].marker_ok


def test_lightning_ckpt_files(tmp_path):
    # Lightning's ModelCheckpoint writes one torch.save'd dict per file named from its template.
    ckpt = {"epoch": 0, "global_step": 40, "state_dict": _model().state_dict(), "pytorch-lightning_version": "2.4"}
    torch.save(ckpt, tmp_path / "epoch=0-step=40.ckpt")
    torch.save({**ckpt, "global_step": 80}, tmp_path / "epoch=1-step=80.ckpt")
    shutil.copy(tmp_path / "epoch=1-step=80.ckpt", tmp_path / "last.ckpt")   # no step in its name: not one
    torch.save({**ckpt, "global_step": 120}, tmp_path / "epoch=2-step=120.ckpt")
    _truncate(tmp_path / "epoch=2-step=120.ckpt")
    got = _by_name(tmp_path)
    assert set(got) == {"epoch=0-step=40.ckpt", "epoch=1-step=80.ckpt", "epoch=2-step=120.ckpt"}
    assert got["epoch=1-step=80.ckpt"].layout == "lightning" and got["epoch=1-step=80.ckpt"].step == 80
    chosen, _ = resume_point(WatchConfig(root=tmp_path))
    assert chosen is not None and chosen.name == "epoch=1-step=80.ckpt"
    # Lightning's default place is deeper: the pattern says where
    deep = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    deep.mkdir(parents=True)
    torch.save(ckpt, deep / "epoch=0-step=40.ckpt")
    chosen, _ = resume_point(WatchConfig(root=tmp_path, pattern="lightning_logs/*/checkpoints/*.ckpt"))
    assert chosen is not None and chosen.name == "lightning_logs/version_0/checkpoints/epoch=0-step=40.ckpt"


def test_torch_dcp_dirs_are_complete_with_their_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    for step in (40, 50):
        dcp.save({"model": _model().state_dict()}, checkpoint_id=str(tmp_path / f"step_{step}"))
    assert (tmp_path / "step_50" / ".metadata").is_file()
    (tmp_path / "step_50" / ".metadata").unlink()   # DCP writes .metadata last: a save in progress
    got = _by_name(tmp_path)
    assert got["step_40"].layout == "dcp" and got["step_40"].marker_ok
    assert not got["step_50"].marker_ok and ".metadata" in got["step_50"].why_not
    chosen, _ = resume_point(WatchConfig(root=tmp_path))
    assert chosen is not None and chosen.name == "step_40"


def test_megatron_iterations_are_complete_up_to_the_tracker_file(tmp_path):
    for it in (40, 50):
        d = tmp_path / f"iter_{it:07d}" / "mp_rank_00"
        d.mkdir(parents=True)
        torch.save({"iteration": it, "model": _model().state_dict()}, d / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")   # Megatron's tracker, written after a save
    got = _by_name(tmp_path)
    assert got["iter_0000040"].layout == "megatron" and got["iter_0000040"].marker_ok
    assert not got["iter_0000050"].marker_ok
    chosen, _ = resume_point(WatchConfig(root=tmp_path))
    assert chosen is not None and chosen.step == 40
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("50")
    assert resume_point(WatchConfig(root=tmp_path))[0].step == 50


@pytest.mark.slow   # ~15 s: transformers' import and a real Trainer
def test_hf_trainer_checkpoints_written_by_a_real_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    class Tiny(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.arange(8) % 16
            return {"input_ids": ids, "labels": ids}

    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, save_steps=2, logging_steps=1,
                                          per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                          disable_tqdm=True, save_only_model=False)
    transformers.Trainer(model=model, args=args, train_dataset=Tiny()).train()
    got = _by_name(tmp_path)
    assert {"checkpoint-2", "checkpoint-4"} <= set(got), sorted(got)
    assert got["checkpoint-4"].layout == "hf" and got["checkpoint-4"].step == 4 and got["checkpoint-4"].marker_ok
    (tmp_path / "checkpoint-4" / "trainer_state.json").unlink()   # a save not finished
    chosen, _ = resume_point(WatchConfig(root=tmp_path))
    assert chosen is not None and chosen.name == "checkpoint-2"
    # a cut safetensors file is caught by its header
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    if weights.exists():
        _truncate(weights, 0.9)
        assert not _by_name(tmp_path)["checkpoint-2"].marker_ok


_DS_SAVE = """
import os, sys, torch, deepspeed, deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # no JIT build on the CPU
deepspeed.init_distributed(dist_backend="gloo")
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
for tag in ("global_step40", "global_step50"):
    engine.save_checkpoint(sys.argv[1], tag=tag)
"""


@pytest.mark.slow   # ~16 s: a real DeepSpeed engine in a subprocess
def test_deepspeed_tags_are_complete_up_to_latest(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _DS_SAVE, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "latest").read_text().strip() == "global_step50"
    got = _by_name(tmp_path)
    assert got["global_step50"].layout == "deepspeed" and got["global_step50"].marker_ok, got
    (tmp_path / "latest").write_text("global_step40")   # global_step50 being written: latest not moved yet
    got = _by_name(tmp_path)
    assert got["global_step40"].marker_ok and not got["global_step50"].marker_ok
    assert resume_point(WatchConfig(root=tmp_path))[0].name == "global_step40"


def test_the_watch_reports_a_checkpoint_once_its_size_held_still_for_two_looks(tmp_path):
    w = Watch(WatchConfig(root=tmp_path, settle_s=0.01), started=time.time())
    d = tmp_path / "step_10"
    d.mkdir()
    torch.save(_model().state_dict(), d / "model.pt")
    saving, done = w.look(1.0)                               # first sight: being written, not complete
    assert [f.name for f in saving] == ["step_10"] and done == []
    torch.save({"more": torch.zeros(1000)}, d / "optim.pt")   # still being written: it changed
    assert w.look(2.0) == ([], [])                           # announced once
    assert [f.name for f in w.look(3.0)[1]] == ["step_10"]   # unchanged across two looks
    assert w.look(4.0) == ([], [])                           # reported once


def test_the_watch_feeds_a_save_untouched_for_settle_s_at_first_sight(tmp_path):
    """A save written between two looks and left alone since is complete at once (its files' age shows the
    size held still), not a look later: a NaN read meanwhile has it as its rollback target."""
    w = Watch(WatchConfig(root=tmp_path, settle_s=2.0), started=time.time())
    torch.save(_model().state_dict(), tmp_path / "step_000020.pt")
    old = time.time() - 3
    os.utime(tmp_path / "step_000020.pt", (old, old))
    torch.save(_model().state_dict(), tmp_path / "step_000040.pt")   # just written
    (tmp_path / "step_000060.pt").write_bytes(b"PK\x03\x04 half a zip")   # being written: no end record
    now = time.time()
    saving, done = w.look(now)
    assert [f.name for f in done] == ["step_000020.pt"]
    assert [f.name for f in saving] == ["step_000040.pt", "step_000060.pt"]
    saving, done = w.look(now + 2.0)
    assert saving == [] and [f.name for f in done] == ["step_000040.pt"]   # two equal looks


def test_rollback_sets_aside_later_saves_and_the_bound_outlives_them(tmp_path):
    cfg = WatchConfig(root=tmp_path / "ck")
    for step in (30, 40, 50, 60):
        d = cfg.root / f"step_{step:06d}"
        d.mkdir(parents=True)
        torch.save(_model().state_dict(), d / "model.pt")
    old = time.time() - 100
    for p in cfg.root.rglob("*.pt"):
        os.utime(p, (old, old))   # all saved before the rollback
    moved = set_aside_after(cfg, 40, now=1_700_000_000)
    assert moved == [("step_000050", "step_000050.rolledback-1700000000"),
                     ("step_000060", "step_000060.rolledback-1700000000")]
    assert (cfg.root / "step_000050.rolledback-1700000000" / "model.pt").is_file()   # kept as evidence
    bounds = RollbackBounds(tmp_path)
    bounds.add(40, time.time())
    # the abandoned trajectory's save reappears under its own name (a rename undone, a late copy): passed over
    shutil.copytree(cfg.root / "step_000060.rolledback-1700000000", cfg.root / "step_000060", copy_function=shutil.copy2)
    chosen, notes = resume_point(cfg, RollbackBounds(tmp_path))   # a new daemon: read from the run dir
    assert chosen is not None and chosen.name == "step_000040", notes
    assert notes and "abandoned trajectory" in notes[0]
    # the new trajectory's save after the rollback is a resume point
    d = cfg.root / "step_000050"
    d.mkdir()
    torch.save(_model().state_dict(), d / "model.pt")
    assert resume_point(cfg, RollbackBounds(tmp_path))[0].name == "step_000050"
    assert json.loads((tmp_path / "rollback-bounds.json").read_text())[0]["to_step"] == 40


def test_a_layout_nothing_recognises_is_loud_with_the_setting_to_give(tmp_path):
    (tmp_path / "weights").mkdir()
    np_like = tmp_path / "weights" / "final.npz"
    np_like.write_bytes(b"x" * 10)
    (tmp_path / "run-a").mkdir()
    torch.save({}, tmp_path / "run-a" / "model.pt")
    w = Watch(WatchConfig(root=tmp_path, unknown_after_s=10), started=0.0)
    w.look(5.0)
    assert w.problem(5.0) is None                  # too early to say
    w.look(20.0)
    msg = w.problem(20.0)
    assert msg and "checkpoint_pattern" in msg and "weights" in msg
    empty = Watch(WatchConfig(root=tmp_path / "nothing", unknown_after_s=10), started=0.0)
    empty.look(20.0)
    assert empty.problem(20.0) is None             # no files at all: the job has not saved yet
    # the HF marker missing for good: the message names resume_requires
    hf = tmp_path / "hf"
    (hf / "checkpoint-10").mkdir(parents=True)
    torch.save({}, hf / "checkpoint-10" / "pytorch_model.bin")
    w = Watch(WatchConfig(root=hf, unknown_after_s=10), started=0.0)
    w.look(20.0)
    assert "trainer_state.json" in (w.problem(20.0) or "")


def test_a_save_already_on_disk_at_the_nan_step_is_never_resumed(tmp_path):
    from types import SimpleNamespace

    from ulyssesd.daemon.job.checkpoint_watch import poisoned_from

    cfg = WatchConfig(root=tmp_path / "ck")
    for step in (40, 50):   # 50: saved in the same breath as the step whose loss went NaN
        d = cfg.root / f"step_{step}"
        d.mkdir(parents=True)
        torch.save(_model().state_dict(), d / "model.pt")
    before = time.time() - 1
    for p in cfg.root.rglob("*.pt"):
        os.utime(p, (before, before))
    assert resume_point(cfg, RollbackBounds(tmp_path))[0].name == "step_50"
    poisoned_from(SimpleNamespace(run_dir=tmp_path), 50)   # the daemon reads the NaN line of step 50
    chosen, notes = resume_point(cfg, RollbackBounds(tmp_path))   # e.g. the job then crashed: a plain restart
    assert chosen.name == "step_40" and "step_50" in notes[0]
    time.sleep(0.02)
    torch.save(_model().state_dict(), cfg.root / "step_50" / "model.pt")   # the new trajectory saves step 50
    assert resume_point(cfg, RollbackBounds(tmp_path))[0].name == "step_50"
