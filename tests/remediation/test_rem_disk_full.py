"""The disk_full crash ladder: prune and restart, repeatable (a disk may fill again days later), but
`max_crash_restarts` full disks in a row without a verified window between them stop the run."""

from __future__ import annotations

from rem_helpers import engine_job

from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.records import StepRecord
from ulyssesd.training.spec import JobSpec

JOB = engine_job(JobSpec.model_validate({"model": {"preset": "tiny"}, "train": {"device": "cpu"}}))
POLICY = RemediationConfig(max_crash_restarts=2, max_restarts_per_hour=100, no_progress_restarts=100,
                           verify_steps=50)


def test_full_disks_in_a_row_stop_after_max_crash_restarts():
    eng = RemediationEngine(job=JOB, policy=POLICY)
    out = []
    for k in range(3):
        out += eng.on_crash("disk_full", ["No space left on device"], now=10.0 * k)
        eng.on_restart(10.0 * k + 1, attempt=k + 2)
    assert [(d.action_kind, d.apply) for d in out] == [("prune_and_restart", "restart_latest")] * 2 + [
        ("stop_alert", "stop")]
    assert all(d.symptom == "disk_full" for d in out)


def test_a_disk_that_fills_again_after_a_verified_window_is_pruned_again():
    eng = RemediationEngine(job=JOB, policy=POLICY)
    step, now = 0, 0.0
    for k in range(4):  # more full disks than max_crash_restarts, each after a healthy verified window
        (d,) = eng.on_crash("disk_full", ["No space left on device"], now=now)
        assert (d.action_kind, d.apply) == ("prune_and_restart", "restart_latest"), (k, d.reason)
        eng.on_restart(now + 1, attempt=k + 2)
        for _ in range(60):
            step, now = step + 1, now + 1.0
            eng.observe(StepRecord(step=step, loss=2.0, time=now, attempt=k + 2), now)
        eng.checkpoint_saved(f"step-{step:08d}", step)


def test_a_low_confidence_disk_full_is_dropped_when_the_filesystem_has_room(tmp_path):
    """The OS decides over a save-context guess: plenty free -> refuted with the numbers; the log's own ENOSPC
    (high), the job's ENOSPC event, or checkpoints as large as the free space (a sparse file here) -> kept."""
    from ulyssesd.daemon.host import disk

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_000005.pt").write_bytes(b"x" * 4096)
    line = disk.space_refutes("disk_full", "low", None, ckpt)
    assert line is not None and line.startswith("not a full disk:") and "GB free" in line
    assert disk.space_refutes("disk_full", "low", None, tmp_path / "not" / "made") is not None  # nearest parent
    assert disk.space_refutes("disk_full", "high", None, ckpt) is None
    assert disk.space_refutes("disk_full", "low", {"errno": "ENOSPC"}, ckpt) is None
    assert disk.space_refutes("python_exception", "low", None, ckpt) is None
    with open(ckpt / "huge.pt", "wb") as fh:  # apparent size far beyond any free space
        fh.truncate(1 << 42)  # 4 TiB apparent, no blocks
    assert disk.space_refutes("disk_full", "low", None, ckpt) is None
