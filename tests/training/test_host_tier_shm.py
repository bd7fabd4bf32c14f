"""The host tier across processes, with real processes (torchrun, 2 gloo ranks, DeepSpeed ZeRO-3 + Ulysses, CPU):
a rank SIGKILLed after a host snapshot newer than the last disk save; the relaunched job resumes from the
shared-memory copy (fewer redone steps) with the losses of an uninterrupted run, and cleans it up when it
completes. A damaged copy is never trusted: the relaunch says why and resumes from the disk tag."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_job_helpers import launch, tiny_spec

from ulyssesd.training.recovery.shm_tier import SHM_DIR_ENV, run_shm_dir

pytestmark = pytest.mark.slow

STEPS = 12
# Disk saves every 5 steps, host snapshots every 2: when rank 1 is SIGKILLed at the start of step 9 the newest
# durable tag is step-5, and the shared-memory copies are step-6 or step-8 (the copy runs in the background).
CKPT = {"memory_tier": True, "memory_shm": True, "memory_interval_steps": 2, "interval_steps": 5,
        "save_at_end": False, "async_save": False}


def _killed_then_relaunched(tmp_path: Path, damage: bool, monkeypatch: pytest.MonkeyPatch):
    env = {SHM_DIR_ENV: str(tmp_path / "shm")}
    monkeypatch.setenv(SHM_DIR_ENV, env[SHM_DIR_ENV])
    plain = launch(tiny_spec(train={"steps": STEPS}, checkpoint={"interval_steps": 100, "save_at_end": False}),
                   tmp_path / "plain")
    assert plain.returncode == 0, plain.output[-3000:]
    spec = tiny_spec(train={"steps": STEPS}, checkpoint=CKPT, faults=[{"kind": "sigkill", "at_step": 9, "rank": 1}])
    run_dir = tmp_path / "run"
    first = launch(spec, run_dir, env=env)
    assert first.returncode != 0 and max(first.steps(1)) == 8, first.output[-3000:]
    shm = run_shm_dir(run_dir)
    assert shm.parent == tmp_path / "shm" and sorted(p.name for p in shm.iterdir()) == ["rank0", "rank1"]
    if damage:   # one byte of rank 1's copy of the newest tag both ranks hold, after its manifest was written
        held = [{d.name for d in (shm / r).iterdir() if not d.name.startswith(".")} for r in ("rank0", "rank1")]
        copy = shm / "rank1" / max(held[0] & held[1])
        victim = max((p for p in copy.rglob("*.pt")), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    second = launch(spec, run_dir, attempt=2, env=env)
    assert second.returncode == 0, second.output[-3000:]
    base = {s: r["loss"] for s, r in plain.steps().items()}
    redone = second.steps(2)
    assert redone and all(r["loss"] == base[s] for s, r in redone.items()), [(s, r["loss"], base[s])
                                                                            for s, r in redone.items()]
    assert max(redone) == STEPS and not shm.exists()   # completed: the owner removed its copies
    return second, redone


def test_a_relaunch_after_a_sigkill_resumes_from_the_shared_memory_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    second, redone = _killed_then_relaunched(tmp_path, False, monkeypatch)
    (ev,) = second.events("memory_snapshot_restored", 2)
    assert ev["disk_tag"] == "step-00000005" and ev["tag"] in ("step-00000006", "step-00000008"), ev
    assert ev["restored_step"] > 5 and ev["source"] == "shm"
    assert min(redone) == ev["restored_step"] + 1   # fewer redone steps than from the disk tag (6 or 8 instead of 5)
    (started,) = second.events("started", 2)
    assert started["resumed_from"] == ev["tag"] and started["start_step"] == ev["restored_step"]


def test_a_damaged_shared_memory_copy_is_not_trusted_and_the_disk_tag_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    second, redone = _killed_then_relaunched(tmp_path, True, monkeypatch)
    assert second.events("memory_snapshot_restored", 2) == []
    (ev,) = second.events("memory_snapshot_unused", 2)
    assert ev["disk_tag"] == "step-00000005" and ev["reason"].startswith("rank 1: "), ev
    assert min(redone) == 6   # from step-5 on disk
