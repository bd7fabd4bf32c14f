"""In-process restart of a step that failed after its collectives began, on one rank only, with the real 2-rank
job (torchrun, gloo, DeepSpeed ZeRO-3 + Ulysses, CPU): rank 1 raises between the forward and the backward while
rank 0 goes on into the backward's collectives; the process group is torn down (releasing rank 0), rebuilt in
the same processes, the engine built again and the host tier loaded, and the losses equal an uninterrupted run
step for step. Without a snapshot to restore, the fault takes the usual path and says why."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_job_helpers import launch, tiny_spec

pytestmark = pytest.mark.slow

TIER = {"memory_tier": True, "in_process_restart": True, "memory_shm": False}
NO_DISK = {"interval_steps": 100, "save_at_end": False}


def test_a_mid_step_exception_on_one_rank_rebuilds_the_group_and_matches_an_uninterrupted_run(tmp_path: Path):
    steps = 8
    plain = launch(tiny_spec(train={"steps": steps}, checkpoint=NO_DISK), tmp_path / "plain")
    assert plain.returncode == 0, plain.output[-3000:]
    hit = launch(tiny_spec(train={"steps": steps}, checkpoint={**TIER, **NO_DISK, "memory_interval_steps": 3},
                           faults=[{"kind": "raise_mid_step", "at_step": 5, "rank": 1}]), tmp_path / "hit")
    assert hit.returncode == 0, hit.output[-3000:]
    (ev,) = hit.events("in_process_restart")
    assert ev["path"] == "in_process" and ev["reason"] == "exception_mid_step", ev
    assert "rank 1: InjectedFault" in ev["error"] and ev["failed_ranks"] == [1]
    assert ev["group_rebuilt"] is True and (ev["tag"], ev["restored_step"], ev["disk_reads"]) == ("step-00000003", 3, 0)
    # One attempt, the same processes: `started` once, the run completed.
    assert len(hit.events("started")) == 1 and hit.events("exiting")[-1]["reason"] == "completed"
    base = {s: r["loss"] for s, r in plain.steps().items()}
    recorded = [r for r in hit.records() if r["kind"] == "step"]
    assert [r["step"] for r in recorded] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    assert all(r["loss"] == base[r["step"]] for r in recorded), [(r["step"], r["loss"], base[r["step"]])
                                                                 for r in recorded]


def test_a_mid_step_exception_with_nothing_to_restore_takes_the_usual_path_and_says_why(tmp_path: Path):
    run = launch(tiny_spec(train={"steps": 6}, checkpoint={**TIER, **NO_DISK, "memory_interval_steps": 4},
                           faults=[{"kind": "raise_mid_step", "at_step": 2, "rank": 0}]), tmp_path / "early")
    assert run.returncode != 0   # the usual path: the ranks exit, the daemon relaunches
    (ev,) = run.events("in_process_restart")
    assert ev["path"] == "fallback" and ev["reason"] == "exception_mid_step"
    assert "no snapshot in host memory" in ev["fallback_reason"] and "rank 0: InjectedFault" in ev["error"]
    assert run.events("exiting")[-1]["reason"] == "error"


def test_a_rank_killed_mid_run_ends_the_survivors_rebuild_and_the_relaunch_resumes_from_shared_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from ulyssesd.training.recovery.shm_tier import SHM_DIR_ENV, run_shm_dir

    env = {SHM_DIR_ENV: str(tmp_path / "shm")}
    monkeypatch.setenv(SHM_DIR_ENV, env[SHM_DIR_ENV])
    spec = tiny_spec(train={"steps": 9}, checkpoint={**TIER, **NO_DISK, "memory_shm": True, "memory_interval_steps": 3},
                     faults=[{"kind": "sigkill", "at_step": 7, "rank": 1}])
    first = launch(spec, tmp_path / "run", env=env)
    assert first.returncode != 0
    # Rank 0 saw its collective fail and tried to rebuild the group; rank 1 never came: the fallback is recorded
    # (torchrun's SIGTERM, or the bound, whichever came first) and the attempt ended.
    (ev,) = first.events("in_process_restart", 1)
    assert ev["path"] == "fallback" and ev["reason"] == "exception_mid_step", ev
    assert "process group not rebuilt" in ev["fallback_reason"]
    assert first.events("exiting", 1)[-1]["reason"] == "error"
    second = launch(spec, tmp_path / "run", attempt=2, env=env)
    assert second.returncode == 0, second.output[-3000:]
    (restored,) = second.events("memory_snapshot_restored", 2)
    # step-6's copy runs in the background: rank 1 may die before it completes; then both share step-3.
    assert restored["tag"] in ("step-00000003", "step-00000006") and restored["disk_tag"] is None, restored
    assert sorted(second.steps(2)) == list(range(restored["restored_step"] + 1, 10))
    assert not run_shm_dir(tmp_path / "run").exists()
