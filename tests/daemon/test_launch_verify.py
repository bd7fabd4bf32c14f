"""The daemon's launch-time check of the resume tag hashes with the job's `[checkpoint] verify_threads`
(daemon/core/launch.py): it is on the restart's critical path, like the job's own check."""

from __future__ import annotations

import threading
import time

import pytest
from test_daemon_unit_fakeos import FakeOS, _sup

from ulyssesd.daemon.core.launch import checkpoint_for
from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import files as ck_files


def _tag(ckdir, step: int, nfiles: int = 6) -> None:
    d = ckdir / ck.tag_for_step(step)
    d.mkdir(parents=True)
    for i in range(nfiles):
        (d / f"part-{i}.bin").write_bytes(bytes([i]) * 4096)
    ck.write_manifest(d, step, 1.0, step, 1)


@pytest.fixture
def hashing_threads(monkeypatch):
    """The names of the threads that hashed (each file's check held 50 ms, so a pool's workers overlap)."""
    names: set[str] = set()
    real = ck_files._check_job

    def check(job):
        names.add(threading.current_thread().name)
        time.sleep(0.05)
        return real(job)

    monkeypatch.setattr(ck_files, "_check_job", check)
    return names


@pytest.mark.parametrize(("threads", "want"), [(1, None), (3, 3)])
def test_the_launch_check_hashes_with_the_configured_verify_threads(tmp_path, hashing_threads, threads, want):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    _tag(sup.ckpt_dir, 5)
    sup.config.setdefault("checkpoint", {})["verify_threads"] = threads
    tag, notes = checkpoint_for(sup, rollback_to_step=None)
    assert (tag, notes) == ("step-00000005", [])
    pool = {n for n in hashing_threads if n.startswith("ckpt-verify")}
    if want is None:
        assert pool == set() and hashing_threads == {threading.current_thread().name}  # one thread: inline
    else:
        assert len(pool) == want  # 3 workers; this box's default would be min(2 cores, 8) = 2


def test_a_corrupt_file_is_still_found_with_many_threads(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    _tag(sup.ckpt_dir, 5)
    _tag(sup.ckpt_dir, 10)
    (sup.ckpt_dir / "step-00000010" / "part-4.bin").write_bytes(b"\xff" * 4096)  # same size, other bytes
    sup.config.setdefault("checkpoint", {})["verify_threads"] = 4
    tag, notes = checkpoint_for(sup, rollback_to_step=None)
    assert tag == "step-00000005"
    assert "part-4.bin" in notes[0] and "sha256" in notes[0] and "quarantined" in notes[0]


def test_a_v3_tag_with_chunk_digests_only_is_verified_per_chunk_at_launch(tmp_path, monkeypatch):
    """A tag the writer left in digest mode "chunks" (no whole-file sha256): a flipped byte in a middle chunk
    makes the launch check quarantine it and fall back; the intact older tag passes."""
    monkeypatch.setattr(ck_files, "DIGEST_CHUNK_BYTES", 4096)
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for step in (5, 10):
        d = sup.ckpt_dir / ck.tag_for_step(step)
        d.mkdir(parents=True)
        (d / "part-0.bin").write_bytes(bytes(range(256)) * 90)   # 23040 bytes: 6 chunks of 4096
        dig = ck_files.digest_file(d / "part-0.bin", 4096)
        ck.write_manifest(d, step, 1.0, step, 1, known={"part-0.bin": {k: dig[k] for k in (
            "size", "chunk_bytes", "chunk_sha256")}})
        assert "sha256" not in ck.read_manifest(d)["files"]["part-0.bin"]
    with open(sup.ckpt_dir / "step-00000010" / "part-0.bin", "r+b") as fh:
        fh.seek(3 * 4096 + 5)
        fh.write(b"\x00")
    sup.config.setdefault("checkpoint", {})["verify_threads"] = 3
    tag, notes = checkpoint_for(sup, rollback_to_step=None)
    assert tag == "step-00000005"
    assert "part-0.bin" in notes[0] and "chunk 3" in notes[0] and "quarantined" in notes[0]
