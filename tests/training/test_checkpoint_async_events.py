"""Issue 21: an async save's `checkpoint_saved` is sent as soon as its manifest is durable (not at the next
save), exactly once per tag; the job's own retention runs in the writer thread, off the training thread.

The unit tests drive the Trainer's real save path (`TrainerCheckpoints._save` -> `_save_async`, the real
AsyncCheckpointWriter, commit, telemetry writer, a world-1 gloo process group); only DeepSpeed's
`save_checkpoint` is a stand-in that hands the writer one shard. The slow test runs the real 2-rank job.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import train_job_helpers as h

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import retention, saving
from ulyssesd.training.checkpoint.snapshot import aligned_bytes
from ulyssesd.training.data.batches import DataCursor, SampleSource
from ulyssesd.training.faults import FaultInjector
from ulyssesd.training.telemetry import TelemetryWriter, validate_record
from ulyssesd.training.train_checkpoints import ASYNC_WRITE_DELAY_ENV, CheckpointSaveError, TrainerCheckpoints


class _SaveCheckpointStandIn:
    """DeepSpeed's `save_checkpoint` as far as the writer sees it: one `checkpoint_engine.save` per shard."""

    class _CheckpointEngine:
        def save(self, state_dict, path):   # a synchronous save's write (the async path replaces it)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state_dict, path)

    def __init__(self):
        self.checkpoint_engine = self._CheckpointEngine()

    def _copy_recovery_script(self, save_path):
        pass

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False
        self.checkpoint_engine.save({"w": torch.arange(1024, dtype=torch.float32), "client": client_state},
                                    os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))


class _Job(TrainerCheckpoints):
    def __init__(self, run_dir, keep_last=5, async_save=True):
        self.spec = h.tiny_spec(checkpoint={"async_save": async_save, "keep_last": keep_last})
        self.run_dir, self.attempt, self.config_version = run_dir, 1, 1
        self.rank, self.world, self.dist = 0, 1, dist
        self.step, self.last_loss = 0, 1.0
        self.engine = _SaveCheckpointStandIn()
        self.cursor = DataCursor()
        self.source = SampleSource(self.spec.data, self.spec.train.seq_len, 256, 7)
        self.faults = FaultInjector([], 0, 0, 1, 7, torch.device("cpu"), lambda *a, **k: None)
        self.tele = TelemetryWriter(run_dir / "telemetry.jsonl", 1, 1)

    def _event(self, name, **fields):
        self.tele.event(name, self.step, **fields)

    def train_step(self):   # what the step loop does around a step: a step record, then the poll
        self.step += 1
        self.tele.step(self.step, 1.0)
        self.poll_saves()

    def records(self):
        path = self.run_dir / "telemetry.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def saved(self):
        return [r for r in self.records() if r.get("event") == "checkpoint_saved"]


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("ULYSSESD_RUN_DIR", raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg-store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _gate_writes(monkeypatch):
    """A disk that writes only when the test opens the gate (every shard write waits for it)."""
    gate = threading.Event()
    hook = TrainerCheckpoints._async_write_hook

    def gated(self, delay_s):
        inner = hook(self, delay_s)

        def write(path):
            assert gate.wait(30), "the test never opened the write gate"
            inner(path)
        return write
    monkeypatch.setattr(TrainerCheckpoints, "_async_write_hook", gated)
    return gate


def test_the_event_comes_at_the_first_step_after_the_commit_once_and_never_before(tmp_path, one_rank, monkeypatch):
    gate = _gate_writes(monkeypatch)
    job = _Job(tmp_path / "run")
    job.step = 2
    job._save()
    tag_dir = job.ckpt_dir / "step-00000002"
    # The write is held: steps go on, no manifest, and no event however often the loop polls.
    for _ in range(3):
        job.train_step()
    assert not (tag_dir / ck.MANIFEST_NAME).exists() and job.saved() == []
    gate.set()
    h.wait_for(lambda: job._writer.committed, 30, "the commit of step-2")
    assert ck.validate_tag(tag_dir) == (True, "ok")   # durable before anyone is told
    job.train_step()   # step 6: the first step after the commit reports it, at the saved step
    saved = job.saved()
    assert [(e["tag"], e["step"], e["reported_at_step"], e["async_save"]) for e in saved] == [
        ("step-00000002", 2, 6, True)]
    assert saved[0]["bytes"] == ck.manifest_bytes(ck.read_manifest(tag_dir)) > 0
    # Later polls, the next save's wait and the exit's wait never send it again.
    job.train_step()
    job.step = 8
    job._save()       # finish_saves of step-2 first, then step-8 goes in flight
    job.finish_saves()   # exit: step-8 was never polled, so the wait reports it, once
    job.finish_saves()
    kinds = [(r["kind"], r.get("event"), r.get("tag"), r["step"]) for r in job.records()]
    assert [k for k in kinds if k[1] in ("checkpoint_saving", "checkpoint_saved")] == [
        ("event", "checkpoint_saving", "step-00000002", 2), ("event", "checkpoint_saved", "step-00000002", 2),
        ("event", "checkpoint_saving", "step-00000008", 8), ("event", "checkpoint_saved", "step-00000008", 8)]
    # The step-2 event sits right after step 6's record: ordered, one line each.
    at = kinds.index(("event", "checkpoint_saved", "step-00000002", 2))
    assert kinds[at - 1] == ("step", None, None, 6) and kinds[at + 1] == ("step", None, None, 7)
    assert all(validate_record(r) == [] for r in job.records())
    job.tele.close()


def test_a_failed_commit_is_never_reported_as_saved(tmp_path, one_rank, monkeypatch):
    job = _Job(tmp_path / "run")
    job.step = 2

    def refuse(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ck, "commit_when_durable", refuse)
    job._save()
    h.wait_for(lambda: not job._writer.in_flight, 30, "the failed commit")
    job.train_step()
    assert job.saved() == [] and not job._writer.committed
    with pytest.raises(CheckpointSaveError, match="ENOSPC"):
        job.finish_saves()
    assert job.saved() == [] and [r["errno"] for r in job.records()
                                  if r.get("event") == "checkpoint_save_failed"] == ["ENOSPC"]
    job.tele.close()


def test_retention_of_an_async_job_runs_in_the_writer_thread_and_keeps_the_newest(tmp_path, one_rank, monkeypatch):
    removed_by: dict[str, str] = {}
    real_remove = retention.remove_dir

    def remove_dir(path):
        removed_by[path.name] = threading.current_thread().name
        time.sleep(1.0)   # a big tag takes a while to delete: the training thread must not wait for it
        real_remove(path)
    monkeypatch.setattr(retention, "remove_dir", remove_dir)
    job = _Job(tmp_path / "run", keep_last=2)
    for step in (2, 4):
        job.step = step
        job._save()
    job.finish_saves()
    assert removed_by == {}   # two valid tags, keep_last 2
    job.step = 6
    t0 = time.monotonic()
    job._save()   # step-6's commit makes step-2 the third valid tag: its writer thread removes it
    training_s = time.monotonic() - t0
    h.wait_for(lambda: job._writer.committed, 30, "the commit of step-6")
    t0 = time.monotonic()
    job.train_step()
    training_s += time.monotonic() - t0
    assert [e["tag"] for e in job.saved()][-1] == "step-00000006"
    h.wait_for(lambda: removed_by, 30, "retention in the writer thread")
    job.finish_saves()   # the next save (or exit) waits for the writer, retention included
    assert removed_by == {"step-00000002": "ckpt-writer-step-00000006"}
    assert training_s < 1.0, f"the save and its report took {training_s:.2f} s: the deletion ran on that thread"
    assert ck.list_tags(job.ckpt_dir) == ["step-00000004", "step-00000006"]
    assert ck.latest_valid_tag(job.ckpt_dir) == "step-00000006"
    job.tele.close()


def test_a_synchronous_job_still_reports_and_prunes_in_its_save(tmp_path, one_rank, monkeypatch):
    removed_by = []
    real_remove = retention.remove_dir
    monkeypatch.setattr(retention, "remove_dir",
                        lambda path: (removed_by.append(threading.current_thread().name), real_remove(path)))
    job = _Job(tmp_path / "run", keep_last=1, async_save=False)
    for step in (2, 4):
        job.step = step
        job._save()
        assert [e["tag"] for e in job.saved()][-1] == f"step-0000000{step}"   # reported by the save itself
    assert "async_save" not in job.saved()[-1] and removed_by == ["MainThread"]
    assert ck.list_tags(job.ckpt_dir) == ["step-00000004"]
    job.tele.close()


def test_under_the_daemon_the_async_job_deletes_nothing(tmp_path, one_rank, monkeypatch):
    monkeypatch.setenv("ULYSSESD_RUN_DIR", str(tmp_path / "run"))
    job = _Job(tmp_path / "run", keep_last=1)
    for step in (2, 4, 6):
        job.step = step
        job._save()
    job.finish_saves()
    assert ck.list_tags(job.ckpt_dir) == ["step-00000002", "step-00000004", "step-00000006"]
    job.tele.close()


@pytest.mark.slow
def test_real_job_reports_each_async_tag_within_two_steps_of_its_manifest(tmp_path):
    # 2 gloo ranks, ZeRO-3 + Ulysses; each shard write waits 0.2 s (a slow disk), so a write spans several
    # steps (~0.1 s each here) but ends well inside the 12-step interval.
    spec = h.tiny_spec(train={"steps": 36}, checkpoint={"async_save": True, "interval_steps": 12, "keep_last": 2})
    run = h.launch(spec, tmp_path, env={ASYNC_WRITE_DELAY_ENV: "0.2"})
    assert run.returncode == 0, run.output[-4000:]
    recs = run.records()
    saved = run.events("checkpoint_saved")
    assert [(e["tag"], e["step"]) for e in saved] == [("step-00000012", 12), ("step-00000024", 24),
                                                       ("step-00000036", 36)]
    assert all(e["write_seconds"] >= 0.2 for e in saved)   # the slow disk was in the path
    # Heard during the interval, not at the next save's wait (which was when it came before issue 21) ...
    assert 12 < saved[0]["reported_at_step"] < 24 and 24 < saved[1]["reported_at_step"] < 36, saved
    # ... and at most two step records after the commit (the manifest's mtime).
    committed = (tmp_path / "checkpoints" / "step-00000024" / ck.MANIFEST_NAME).stat().st_mtime
    at = recs.index(saved[1])
    steps_between = [r["step"] for r in recs[:at] if r["kind"] == "step" and r["time"] >= committed]
    assert len(steps_between) <= 2, (saved[1], steps_between)
    # The last tag is reported once, by the exit's wait; retention (keep_last 2, in the writer thread of
    # step-36's save) removed step-12.
    assert saved[2]["reported_at_step"] == 36
    assert ck.list_tags(tmp_path / "checkpoints") == ["step-00000024", "step-00000036"]
    assert all(validate_record(r) == [] for r in recs)


def test_a_failing_after_commit_is_logged_and_never_a_failed_save(tmp_path, caplog):
    writer = ck.AsyncCheckpointWriter(0, pin_memory=False, direct_io=False)
    tag_dir = tmp_path / "step-00000002"
    writer.begin(tag_dir)
    writer.collect({"w": torch.ones(8)}, str(tag_dir / "a.pt"))

    def busy():
        raise OSError(16, "Device or resource busy")
    writer.start(commit=lambda: ck.commit_when_durable(tag_dir, 1, 2, 1.0, 8, 1, timeout_s=5), after_commit=busy)
    assert writer.wait(30) and writer.committed and writer.take_failure() is None
    assert ck.validate_tag(tag_dir) == (True, "ok")
    assert "after the commit of step-00000002" in caplog.text and "busy" in caplog.text
    writer.begin(tmp_path / "step-00000004")   # the next save starts: nothing to raise


def test_a_save_due_while_the_previous_still_writes_waits_and_reports_the_wait_as_blocked(tmp_path, one_rank,
                                                                                          monkeypatch, caplog):
    monkeypatch.setenv(ASYNC_WRITE_DELAY_ENV, "0.8")   # a slow disk: each shard write takes 0.8 s
    job = _Job(tmp_path / "run")
    job.step = 2
    job._save()
    job.step = 4
    with caplog.at_level("WARNING", logger="ulyssesd.training"):
        job._save()   # due at once: the step-2 write still runs, so training waits for it (one save in flight)
    job.finish_saves()
    saving = {r["tag"]: r for r in job.records() if r.get("event") == "checkpoint_saving"}
    saved = {r["tag"]: r for r in job.saved()}
    waited = saving["step-00000004"]["waited_for_previous_seconds"]
    assert waited >= 0.5 and saving["step-00000002"]["waited_for_previous_seconds"] < 0.05
    assert saved["step-00000004"]["waited_for_previous_seconds"] == waited
    assert saved["step-00000004"]["blocked_seconds"] >= waited   # the wait is training's blocked time too
    assert saved["step-00000002"]["blocked_seconds"] < 0.5
    assert "step-00000004 was due while step-00000002 was still being written: training waited" in caplog.text
    assert ck.validate_tag(job.ckpt_dir / "step-00000004") == (True, "ok")
    # Off the GPU there is no snapshot pool, and the event says so.
    assert saved["step-00000004"]["snapshot_pool"] == "off" and saved["step-00000004"]["snapshot_fallback_bytes"] == 0
    # A save due after the previous one is durable does not wait and logs nothing.
    caplog.clear()
    h.wait_for(lambda: job._writer is not None and not job._writer.in_flight, 30, "nothing in flight")
    job.step = 6
    with caplog.at_level("WARNING", logger="ulyssesd.training"):
        job._save()
    job.finish_saves()
    six = [r for r in job.records() if r.get("event") == "checkpoint_saving" and r["tag"] == "step-00000006"][0]
    assert six["waited_for_previous_seconds"] < 0.05 and "was due while" not in caplog.text
    job.tele.close()


def test_the_first_poll_of_an_attempt_builds_the_snapshot_pool_once_and_reports_when_ready(tmp_path, one_rank,
                                                                                            monkeypatch):
    """The wiring on a GPU job, with the driver and the sizing faked (this box has no GPU): sized once at the
    first poll, the [checkpoint] knobs and LOCAL_WORLD_SIZE passed, `snapshot_pool_ready` sent once."""
    calls = []

    class Registrar:
        def __init__(self, device):
            calls.append(("device", device))

        def register(self, ptr, nbytes):
            calls.append(("register", nbytes))

        def unregister(self, ptr):
            calls.append(("unregister", ptr))

    monkeypatch.setattr(ck, "CudaHostRegistrar", Registrar)
    monkeypatch.setattr(ck, "engine_snapshot_bytes", lambda engine: 3 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    asked = []
    monkeypatch.setattr(saving, "pool_refusal", lambda nbytes, ranks, *memory: asked.append((nbytes, ranks)))
    job = _Job(tmp_path / "run")
    job.spec = h.tiny_spec(checkpoint={"async_save": True, "snapshot_pool_chunk_mib": 16, "snapshot_pool_pause_ms": 0})
    job.device = torch.device("cuda", 1)
    job.train_step()
    writer = job._writer
    assert writer is not None and writer.snapshot_pool is not None
    pool = writer.snapshot_pool
    assert pool.nbytes == aligned_bytes((3 << 20) + (3 << 20) // 100 + (64 << 20)) and pool.chunk_bytes == 16 << 20
    assert asked == [((3 << 20) + (3 << 20) // 100 + (64 << 20), 2)]   # the host-memory check counts both local ranks' pools
    assert pool.wait_ready(10)
    job.train_step()
    job.train_step()
    ready = [r for r in job.records() if r.get("event") == "snapshot_pool_ready"]
    assert len(ready) == 1 and ready[0]["ready"] is True and ready[0]["bytes"] == pool.nbytes
    assert calls[0] == ("device", 1) and [c for c in calls if c[0] == "register"] == [
        ("register", 16 << 20)] * 4 + [("register", pool.nbytes - 4 * (16 << 20))]
    assert writer.snapshot_pool is pool   # once per attempt
    writer.close()
    assert len([c for c in calls if c[0] == "unregister"]) == 5


def test_on_resume_the_pool_is_sized_from_the_tags_manifest_before_the_load(tmp_path, one_rank, monkeypatch):
    """Resumed, the pool's build starts before the tag loads (it overlaps the load), sized from this run's
    tag: its largest optimizer-states file + largest model-states file. A tag written by another number of
    ranks is not this run's partitioning: then the first poll sizes it from the engine."""
    monkeypatch.setattr(ck, "CudaHostRegistrar", lambda device: _NullRegistrar())
    monkeypatch.setattr(ck, "engine_snapshot_bytes", lambda engine: 5 << 20)
    job = _Job(tmp_path / "run")
    job.device = torch.device("cuda", 0)
    for tag, ranks in (("step-00000004", 1), ("step-00000008", 2)):
        tag_dir = job.ckpt_dir / tag
        tag_dir.mkdir(parents=True)
        for r in range(ranks):
            (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"o" * (3000 + r))
            (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").write_bytes(b"m" * 200)
        ck.write_manifest(tag_dir, ck.step_of_tag(tag), 1.0, 8, 1)
    job._prepare_snapshot_pool("step-00000008")   # two ranks wrote it, this run has one: not sized from it
    assert job._writer is None and not job._pool_prepared
    job._prepare_snapshot_pool("step-00000004")
    pool = job._writer.snapshot_pool
    assert pool.nbytes == aligned_bytes(3200 + 3200 // 100 + (64 << 20)) and job._pool_prepared
    job.train_step()   # the first poll does not size it again
    assert job._writer.snapshot_pool is pool
    job._writer.close()


class _NullRegistrar:
    def register(self, ptr, nbytes):
        pass

    def unregister(self, ptr):
        pass


def test_a_cpu_job_builds_no_snapshot_pool(tmp_path, one_rank):
    job = _Job(tmp_path / "run")
    job.device = torch.device("cpu")
    job.train_step()
    assert job._writer is None or job._writer.snapshot_pool is None
    assert not [r for r in job.records() if r.get("event") == "snapshot_pool_ready"]
