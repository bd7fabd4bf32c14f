"""In-process restart from the host-memory tier, and the save gate, with the real 2-rank job (torchrun, gloo, DeepSpeed ZeRO-3 +
Ulysses, CPU): an exception in a step is dropped and the run goes on in the same processes with the losses of
an uninterrupted run; a NaN rolls back to a memory-only snapshot with no disk read; a fault the tier cannot
serve takes the usual path and says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_job_helpers import launch, tiny_spec

from ulyssesd.training import checkpoint as ckpt
from ulyssesd.training.train_checkpoints import ASYNC_WRITE_DELAY_ENV

pytestmark = pytest.mark.slow

TIER = {"memory_tier": True, "in_process_restart": True}


def _tags(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return ckpt.list_tags(root) if root.is_dir() else []


def test_an_exception_in_a_step_is_restored_in_process_with_the_losses_of_an_uninterrupted_run(tmp_path: Path):
    steps = 8
    plain = launch(tiny_spec(train={"steps": steps}, checkpoint={"interval_steps": 100, "save_at_end": False}),
                   tmp_path / "plain")
    assert plain.returncode == 0, plain.output[-3000:]
    # Snapshots every 3 steps, no disk save at all; rank 1 raises at the start of step 5.
    hit = launch(tiny_spec(train={"steps": steps},
                           checkpoint={**TIER, "memory_interval_steps": 3, "interval_steps": 100, "save_at_end": False},
                           faults=[{"kind": "raise", "at_step": 5, "rank": 1}]), tmp_path / "hit")
    assert hit.returncode == 0, hit.output[-3000:]
    (ev,) = hit.events("in_process_restart")
    assert ev["path"] == "in_process" and ev["reason"] == "exception" and "InjectedFault" in ev["error"]
    assert (ev["failed_step"], ev["tag"], ev["restored_step"], ev["disk_reads"]) == (5, "step-00000003", 3, 0)
    assert ev["from_memory"] >= 2   # this rank's model-states and optimizer-states files, served from memory
    assert _tags(tmp_path / "hit") == []   # nothing on disk: the restore could only come from memory
    # One attempt, one process group: the `started` event once, the run completed.
    assert len(hit.events("started")) == 1 and hit.events("exiting")[-1]["reason"] == "completed"
    # Step 4 ran twice (before the fault and as a replay); every record equals the uninterrupted run's.
    base = {s: r["loss"] for s, r in plain.steps().items()}
    recorded = [r for r in hit.records() if r["kind"] == "step"]
    assert [r["step"] for r in recorded] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    assert all(r["loss"] == base[r["step"]] for r in recorded), [(r["step"], r["loss"], base[r["step"]])
                                                                 for r in recorded]


def test_a_nan_rolls_back_to_a_memory_only_snapshot_newer_than_the_newest_durable_tag(tmp_path: Path):
    # Disk saves every 5 steps, host snapshots every 2: at the NaN of step 7 the newest durable tag is step-5
    # and the host tier holds step-6, which never exists on disk.
    run = launch(tiny_spec(train={"steps": 9},
                           checkpoint={**TIER, "memory_interval_steps": 2, "interval_steps": 5, "save_at_end": False},
                           faults=[{"kind": "nan_loss", "at_step": 7, "rank": 0}]), tmp_path / "nan")
    assert run.returncode == 0, run.output[-3000:]
    (ev,) = run.events("in_process_restart")
    assert ev["path"] == "in_process" and ev["reason"] == "nan_loss" and ev["loss"] == "nan"
    assert (ev["tag"], ev["restored_step"], ev["disk_reads"]) == ("step-00000006", 6, 0)
    assert _tags(tmp_path / "nan") == ["step-00000005"]   # step-6 came from memory: it is not on disk
    loaded = [e["tag"] for e in run.events("checkpoint_loaded")]
    assert loaded == []   # no resume from disk in this attempt
    # The NaN step was dropped (never recorded); its samples are skipped, and training went on finite.
    steps = run.steps()
    assert sorted(steps) == list(range(1, 10))
    assert all(isinstance(r["loss"], float) for r in steps.values())
    # One sample per step (dp 1, micro-batch 1): step 7 had sample 6; redone, it skips it and reads sample 7.
    assert ev["skipped_samples"] == [6, 7] and steps[7]["samples"] == [6, 8]


def test_a_nan_before_any_snapshot_takes_the_usual_path_and_says_why(tmp_path: Path):
    run = launch(tiny_spec(train={"steps": 3},
                           checkpoint={**TIER, "memory_interval_steps": 2, "interval_steps": 100, "save_at_end": False},
                           faults=[{"kind": "nan_loss", "at_step": 1, "rank": 1}]), tmp_path / "early")
    assert run.returncode == 0, run.output[-3000:]
    (ev,) = run.events("in_process_restart")
    assert ev["path"] == "fallback" and "no snapshot in host memory" in ev["fallback_reason"]
    assert run.steps()[1]["loss"] == "nan"   # recorded as usual: the daemon's detectors act on it


def test_an_async_save_due_while_the_previous_still_writes_moves_later_within_its_budget(tmp_path: Path):
    # Each shard write sleeps 5 s first: step-2's write outlasts the next two steps by far, so the save due at
    # step 4 finds it still running and moves (at most 2 steps); then it is taken as it is.
    spec = tiny_spec(train={"steps": 8}, checkpoint={"async_save": True, "interval_steps": 2, "keep_last": 5,
                                                      "save_defer_max_steps": 2})
    run = launch(spec, tmp_path, env={ASYNC_WRITE_DELAY_ENV: "5"}, timeout=400)
    assert run.returncode == 0, run.output[-3000:]
    saving = run.events("checkpoint_saving")
    assert saving[0]["tag"] == "step-00000002" and saving[0]["staging"] == "memory"   # CPU tensors: plain memory
    deferred = run.events("checkpoint_deferred")
    assert deferred and deferred[0]["due_step"] == 4 and "still being written" in deferred[0]["why"]
    for e in saving:   # every moved save says from where and by how much, within the budget
        if "deferred_steps" in e:
            assert 1 <= e["deferred_steps"] <= 2 and e["step"] == e["due_step"] + e["deferred_steps"], e
            assert e["tag"] == f"step-{e['step']:08d}"
    moved = [e for e in saving if e.get("due_step") == 4]
    assert len(moved) == 1 and moved[0]["step"] in (5, 6)
    # Nothing lost: every save that was started is durable and reported.
    assert [e["tag"] for e in run.events("checkpoint_saved")] == [e["tag"] for e in saving]
