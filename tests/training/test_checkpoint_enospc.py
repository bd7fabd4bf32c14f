"""A checkpoint save that fails (full disk, read-only filesystem): the job reports the errno as a
`checkpoint_save_failed` event, exits 4 on every rank, leaves no tag that looks valid, and the previous
tags stay loadable (a relaunch resumes from them)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from train_job_helpers import launch, tiny_spec

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.faults import FaultInjector
from ulyssesd.training.spec import FaultSpec


# ------------------------------------------------------------------------------------- units
def test_save_failure_names_the_errno_of_an_oserror(tmp_path):
    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.pt"))
    f = ck.save_failure(exc, tmp_path / "x.pt", "step-00000004", 1)
    assert f["errno"] == "ENOSPC" and f["errno_code"] == errno.ENOSPC
    assert f["path"] == str(tmp_path / "x.pt") and f["tag"] == "step-00000004" and f["rank"] == 1
    assert isinstance(f["bytes_free"], int) and f["bytes_free"] > 0


def test_a_torch_writer_error_without_errno_asks_the_filesystem(tmp_path):
    # torch.save's C++ writer loses the errno; on a filesystem with room and write access there is no
    # errno to blame (not mistaken for ENOSPC), and non-I/O RuntimeErrors are not write errors at all.
    exc = RuntimeError("basic_ios::clear: iostream error")
    assert ck.is_write_error(exc)
    assert not ck.is_write_error(RuntimeError("shape mismatch"))
    assert ck.filesystem_errno(tmp_path) is None
    assert ck.save_failure(exc, tmp_path / "a" / "b.pt", "t", 0)["errno"] == "unknown"
    assert ck.errno_name(errno.EROFS) == "EROFS" and ck.errno_name(None) == "unknown"


def _injector(kind: str, at_step: int = 4) -> tuple[FaultInjector, list]:
    events: list = []
    import torch

    inj = FaultInjector([FaultSpec(kind=kind, at_step=at_step)], rank=1, local_rank=1, attempt=1, seed=0,
                        device=torch.device("cpu"), emit=lambda *a, **k: events.append((a, k)))
    return inj, events


def test_disk_full_fault_leaves_a_partial_file_and_raises_enospc_on_every_write_of_that_save(tmp_path):
    inj, events = _injector("disk_full")
    a = tmp_path / "a.pt"

    def write(p: Path) -> None:
        p.write_bytes(b"x" * 1000)

    inj.checkpoint_write(2, str(a), lambda: write(a))  # before at_step: written whole
    assert a.stat().st_size == 1000
    for name in ("b.pt", "c.pt"):  # every file of the save at step 4, on this rank (not only fault.rank)
        p = tmp_path / name
        with pytest.raises(OSError) as err:
            inj.checkpoint_write(4, str(p), lambda p=p: write(p))
        assert err.value.errno == errno.ENOSPC and p.stat().st_size == 500
    assert len(events) == 1  # announced once
    d = tmp_path / "d.pt"
    inj.checkpoint_write(6, str(d), lambda: write(d))  # the next save works again (space was freed)
    assert d.stat().st_size == 1000


def test_read_only_fault_writes_nothing(tmp_path):
    inj, _ = _injector("read_only_fs", at_step=2)
    p = tmp_path / "a.pt"
    with pytest.raises(OSError) as err:
        inj.checkpoint_write(2, str(p), lambda: p.write_bytes(b"x"))
    assert err.value.errno == errno.EROFS and not p.exists()


# ---------------------------------------------------------------------- the real 2-rank job
@pytest.mark.slow
def test_disk_full_mid_save_reports_enospc_keeps_previous_tag_and_resume_works(tmp_path):
    spec = tiny_spec(faults=[{"kind": "disk_full", "at_step": 4}])
    first = launch(spec, tmp_path)
    assert first.returncode != 0, first.output[-3000:]
    assert "exitcode  : 4" in first.output, first.output[-3000:]  # each rank's own code, via torchrun
    (ev,) = first.events("checkpoint_save_failed")
    assert ev["errno"] == "ENOSPC" and ev["tag"] == "step-00000004" and ev["step"] == 4
    assert sorted(ev["failed_ranks"]) == [0, 1] and ev["bytes_free"] > 0 and ev["path"].endswith(".pt")
    assert [e["reason"] for e in first.events("exiting")] == ["checkpoint_save_failed"]
    assert not first.events("checkpoint_saved", attempt=1)[1:]  # only step 2's save succeeded
    ckpt_dir = tmp_path / "checkpoints"
    # The half-written tag exists (partial files) but does not look valid; `latest` still names step 2.
    assert (ckpt_dir / "step-00000004").is_dir() and any((ckpt_dir / "step-00000004").iterdir())
    assert not ck.validate_tag(ckpt_dir / "step-00000004")[0]
    assert ck.validate_tag(ckpt_dir / "step-00000002", verify_checksums=True) == (True, "ok")
    assert ck.read_latest(ckpt_dir) == "step-00000002"
    assert ck.latest_valid_tag(ckpt_dir) == "step-00000002"

    second = launch(spec, tmp_path, attempt=2)  # faults fire on attempt 1 only: the "disk" has room again
    assert second.returncode == 0, second.output[-3000:]
    (loaded,) = second.events("checkpoint_loaded", attempt=2)
    assert loaded["tag"] == "step-00000002"
    assert [e["tag"] for e in second.events("checkpoint_saved", attempt=2)] == [
        "step-00000004", "step-00000006"]
    assert ck.list_quarantined(ckpt_dir) and ck.list_quarantined(ckpt_dir)[0].startswith("step-00000004.corrupt-")


@pytest.mark.slow
def test_read_only_checkpoint_dir_reports_erofs(tmp_path):
    # Tests run as root here (uid 0 ignores mode bits), so `chmod -w` cannot make the directory read-only:
    # the read_only_fs fault raises EROFS from the real save path instead.
    first = launch(tiny_spec(faults=[{"kind": "read_only_fs", "at_step": 2}], train={"steps": 4}), tmp_path)
    (ev,) = first.events("checkpoint_save_failed")
    assert ev["errno"] == "EROFS" and ev["tag"] == "step-00000002"
    assert "exitcode  : 4" in first.output
    assert ck.latest_valid_tag(tmp_path / "checkpoints") is None and ck.read_latest(tmp_path / "checkpoints") is None


def test_the_events_of_a_failed_save_and_of_a_refusal_pass_the_telemetry_contract():
    from ulyssesd.training.telemetry import validate_record

    base = {"v": 1, "kind": "event", "time": 1.0, "attempt": 1, "step": 4}
    failed = {**base, "event": "checkpoint_save_failed", "errno": "ENOSPC", "errno_code": 28,
              "tag": "step-00000004", "path": "/x/a.pt", "bytes_free": 0, "error": "OSError", "rank": 0,
              "failed_ranks": [0, 1]}
    assert validate_record(failed) == []
    for reason in ("checkpoint_save_failed", "config_rejected", "no_checkpoint"):
        assert validate_record({**base, "event": "exiting", "reason": reason}) == [], reason
    assert validate_record({**base, "event": "exiting", "reason": "bogus"})  # still checked
