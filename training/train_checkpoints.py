"""The Trainer's checkpoint half: choose and agree on the resume tag, load it, save with agreed failures.

`TrainerCheckpoints` is a base class of `training.train.Trainer`: the methods run on the Trainer (they
use its engine, data cursor, telemetry and process group, declared below), and keep train.py about the
step loop. The on-disk layout and manifests are `training.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .checkpoint import reshard
from .checkpoint.budget import predicted_tag_bytes, room_for_save
from .control import set_engine_clip
from .data.batches import DataCursor, SampleSource
from .faults import FaultInjector
from .recovery.rng_state import rng_state, set_rng_state
from .spec import JobSpec
from .startup import STARTUP, in_background, mapped_loads

log = logging.getLogger("ulyssesd.training")


class CheckpointLoadError(RuntimeError):
    """No usable checkpoint to resume from (exit code 3)."""

#: Exit code of a job whose checkpoint save failed (its errno is in the `checkpoint_save_failed` event).
EXIT_SAVE_FAILED = 4

#: How long rank 0's background commit waits for every rank's shards of an async save to be durable.
ASYNC_COMMIT_TIMEOUT_S = 1800.0
#: Test-only: seconds each background shard write sleeps first (a slow disk, so a test can kill mid-write).
ASYNC_WRITE_DELAY_ENV = "ULYSSESD_TEST_ASYNC_WRITE_DELAY_S"
#: A save that waited at least this long for the previous one's write says so in the log (back-pressure).
BACKPRESSURE_LOG_S = 0.05
#: Head-room of the snapshot pool over the state measured after the first step (tensors the walk missed).
POOL_MARGIN_BYTES = 64 << 20


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed on some rank (exit code 4); `failure` = the event's fields."""

    def __init__(self, failure: dict[str, Any]):
        self.failure = failure
        super().__init__(f"checkpoint save of {failure['tag']} failed: {failure['errno']} ({failure['error']})")


class TrainerCheckpoints:
    """Resume and save for one rank's Trainer (see the module docstring)."""

    # Set by Trainer (__init__, _init_distributed, _build, run).
    spec: JobSpec
    run_dir: Path
    attempt: int
    config_version: int | None
    step: int
    last_loss: float | None
    rank: int
    world: int
    dist: Any  # torch.distributed
    engine: Any  # DeepSpeedEngine
    cursor: DataCursor
    source: SampleSource
    faults: FaultInjector
    tele: Any  # TelemetryWriter
    # The async writer (checkpoint.async_save) and its save in flight: (step, tag, tag_dir, started, blocked s).
    _writer: ckpt.AsyncCheckpointWriter | None = None
    _async_inflight: tuple[int, str, Path, float, float] | None = None
    _async_reported = False  # rank 0 has sent the save in flight's `checkpoint_saved` (exactly one per tag)
    _async_waited_s = 0.0    # seconds the save in flight waited for the previous one's write (back-pressure)
    _pool_prepared = False   # the writer's snapshot pool was planned (first poll of the attempt)
    _pool_reported = False   # its `snapshot_pool_ready` event was sent
    _save_gate_fields: dict[str, Any] = {}  # noqa: RUF012 - set by DeferredSaves, read once by _save
    preload: Any = None  # a warm standby's training.standby.Preload (set by __main__), used once by _resume

    def _event(self, name: str, **fields: Any) -> None:  # Trainer's: one telemetry event at the current step
        raise NotImplementedError

    def _set_lr(self, step: int) -> float:  # Trainer's: the scheduled lr times the live lr_scale
        raise NotImplementedError

    @property
    def ckpt_dir(self) -> Path:
        d = self.spec.checkpoint.dir
        return Path(d) if d else self.run_dir / "checkpoints"

    def _choose_tag(self) -> tuple[str | None, str | None]:
        """Rank 0: (tag to load or None, fatal error or None). Quarantines invalid tags it skips."""
        cs = self.spec.checkpoint
        root = self.ckpt_dir
        if cs.load == "none" or not root.is_dir():
            return None, None

        def invalid(tag: str, reason: str) -> None:
            moved = ckpt.quarantine(root / tag)
            log.warning("checkpoint %s is invalid (%s); quarantined as %s", tag, reason, moved.name)
            self._event("checkpoint_invalid", tag=tag, reason=reason, quarantined_as=moved.name)

        if cs.load == "latest":
            had_tags = bool(ckpt.list_tags(root))
            tag = self._newest_checked_in_standby(root, invalid) if cs.verify_checksums else None
            if tag is None:  # no standby, or its newest tag failed (quarantined): the rest is checked in full
                tag = ckpt.latest_valid_tag(root, cs.verify_checksums, on_invalid=invalid, threads=cs.verify_threads)
            if tag is None and had_tags:
                return None, f"no valid checkpoint left in {root} (all tags failed validation)"
        else:
            tag = cs.load
            ok, reason = ckpt.validate_tag(root / tag, cs.verify_checksums, threads=cs.verify_threads)
            if not ok:
                if (root / tag).is_dir():
                    invalid(tag, reason)
                return None, f"checkpoint.load={tag!r} is not loadable: {reason}"
        if tag is not None:
            # Upstream #8499: ZeRO-3 may load what `latest` names rather than the tag asked for.
            ckpt.point_latest_to(root, tag)
        return tag, None

    def _newest_checked_in_standby(self, root: Path, invalid: Any) -> str | None:
        """The newest tag validated with what a warm standby already hashed (training/standby.py
        `Preload.validate_newest`); None without a standby's coverage or when it failed (quarantined)."""
        return None if self.preload is None else self.preload.validate_newest(
            root, self.run_dir, self.attempt, self.world, self.spec.checkpoint.verify_threads, invalid)

    def _start_choosing_tag(self) -> Callable[[], tuple[str | None, str | None]]:
        """Rank 0 chooses and checks the resume tag (the sha256 of the checkpoint: 11.7 s of disk reads for 17 GB
        on the H200) in a thread beside the model build; `_agree_on_tag` joins it (its exception is raised on
        rank 0, as inline). The thread does no collective and is the only telemetry writer meanwhile."""
        if self.rank != 0:
            return lambda: (None, None)

        def choose() -> tuple[str | None, str | None]:
            chosen = self._choose_tag()
            STARTUP.mark("tag_verified")
            return chosen

        return in_background(choose, "ckpt-choose-tag")

    def _agree_on_tag(self, chosen: Callable[[], tuple[str | None, str | None]] | None = None) -> str | None:
        """Collective: rank 0's choice (`chosen`, from `_start_choosing_tag`, or `_choose_tag` now) reaches every
        rank; a run that cannot resume exits 3 on every rank (after the model build when it overlapped it)."""
        box: list[Any] = [(chosen or self._choose_tag)() if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0)
        tag, error = box[0]
        if error:
            raise CheckpointLoadError(error)
        return tag

    def _resume(self, tag: str | None) -> tuple[str | None, float]:
        t0 = time.time()
        # A warm standby's bytes of its own shards (training/standby.py): used by this load, then released.
        preload, self.preload = self.preload, None
        if tag is None:
            return None, 0.0
        try:  # a tag saved by another number of ranks (nodes lost or back) is loaded in DeepSpeed's universal form
            uni = reshard.agree_on_reshard(self.dist, self.rank, self.ckpt_dir, tag, self.world)
        except reshard.ReshardError as exc:  # the tag is fine, its conversion failed: kept, not quarantined
            raise CheckpointLoadError(str(exc)) from exc
        self._prepare_snapshot_pool(tag)   # built while the tag loads: no training step waits on the driver
        try:
            # The files are mapped, not copied (startup.py mapped_loads); a standby's preload answers first.
            with mapped_loads(self.engine), reshard.universal_load(self.engine, uni is not None), (
                    preload.serve(self.engine, self.ckpt_dir, tag, self._event)
                    if preload is not None and uni is None else contextlib.nullcontext()):
                path, client = self.engine.load_checkpoint(str(uni.load_dir if uni else self.ckpt_dir), tag=tag,
                                                           load_optimizer_states=True, load_lr_scheduler_states=False)
        except Exception as exc:  # a shard the manifest vouched for still failed to load
            if self.rank == 0 and (self.ckpt_dir / tag).is_dir() and not getattr(preload, "from_memory", False) \
                    and uni is None:  # a converted copy that fails says nothing against the tag itself
                ckpt.quarantine(self.ckpt_dir / tag)
                self._event("checkpoint_invalid", tag=tag, reason=f"load failed: {exc}")
            raise CheckpointLoadError(f"loading checkpoint {tag} failed: {exc}") from exc
        if path is None or client is None:
            raise CheckpointLoadError(f"DeepSpeed found no checkpoint {tag} in {self.ckpt_dir}")
        self._adopt_client_state(tag, client)
        if uni is not None:
            self._event("checkpoint_resharded", tag=tag, from_world=uni.from_world, to_world=self.world,
                        seconds=round(uni.seconds, 3), reused=uni.reused)
        return tag, time.time() - t0

    def _adopt_client_state(self, tag: str, client: dict[str, Any]) -> None:
        """What a loaded tag's client_state restores besides DeepSpeed's own: step, data cursor, RNG, loss."""
        self.step = int(client["ulyssesd_step"])
        self.cursor.load_state_dict(client["data_cursor"])
        saved_data = client.get("data_fingerprint")
        if saved_data is not None and saved_data != self.source.fingerprint():
            # Same sample indices, other data: the run goes on, but the order is not the one it had.
            log.warning("data changed since checkpoint %s: %s -> %s", tag, saved_data, self.source.fingerprint())
            self._event("data_changed", tag=tag, saved=saved_data, now=self.source.fingerprint())
        for start, end in self.spec.data.skip_ranges:  # ranges added by a later config version
            self.cursor.add_skip(start, end)
        rng = client.get("rng", {}).get(self.rank)
        if rng is not None:
            set_rng_state(rng)
        self.last_loss = client.get("loss")
        self._reapply_config_after_load()

    def _reapply_config_after_load(self) -> None:
        # docs/DEEPSPEED_NOTES.md: the checkpoint wins for lr (set every step anyway) and the whole fp16 loss scaler;
        set_engine_clip(self.engine, self.spec.train.gradient_clipping)
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)  # the config wins for what was changed
        ls = self.spec.precision.loss_scale
        if self.spec.precision.dtype == "fp16" and scaler is not None and hasattr(scaler, "min_scale"):
            scaler.min_scale = ls.min_loss_scale
            scaler.scale_window = ls.loss_scale_window
            scaler.delayed_shift = ls.hysteresis
            scaler.cur_hysteresis = min(getattr(scaler, "cur_hysteresis", ls.hysteresis), ls.hysteresis)
        self._set_lr(self.step + 1)

    def _save(self) -> None:
        tag = ckpt.tag_for_step(self.step)
        tag_dir = self.ckpt_dir / tag
        due, self._save_gate_fields = dict(self._save_gate_fields), {}   # the save gate's (recovery/save_gate.py)
        if self.spec.checkpoint.async_save:
            # One save in flight: the previous one must be durable (or its failure agreed on) first. Training
            # stands still meanwhile, so the wait is this save's blocked time too (back-pressure, reported).
            t_due, previous = time.time(), self._async_inflight
            self.finish_saves()
            waited = self._async_waited_s = time.time() - t_due
            due["waited_for_previous_seconds"] = round(waited, 3)
            if previous is not None and waited >= BACKPRESSURE_LOG_S:
                log.warning("checkpoint %s was due while %s was still being written: training waited %.2f s for it "
                            "(one save in flight; a longer interval or a faster disk avoids this)",
                            tag, previous[1], waited)
        if not self._room_for_save(tag):
            return  # skipped for lack of space (its event says so); training goes on
        self._event("checkpoint_saving", tag=tag, **due)
        t0 = time.time()
        # A failed write (full disk, read-only filesystem, quota, I/O error) is caught on the rank that saw
        # it and agreed on by all ranks at the next collective (which replaces a plain barrier), so every
        # rank stops at the same point and rank 0 reports the errno (`checkpoint_save_failed`).
        failure: dict[str, Any] | None = None
        try:
            if self.rank == 0:
                self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                if tag_dir.exists():
                    # A tag from a timeline that was rolled back (or a partial save): keep it as evidence.
                    moved = ckpt.quarantine(tag_dir)
                    log.warning("checkpoint %s already existed; moved aside to %s", tag, moved.name)
            self.faults.before_save(self.step, tag_dir)
        except OSError as exc:
            failure = ckpt.save_failure(exc, tag_dir, tag, self.rank)
        self._agree_on_save(failure)
        client = self._client_state()
        if self.spec.checkpoint.async_save:
            self._save_async(tag, tag_dir, client, t0)
            return
        failure = self._save_files(tag, tag_dir, client)
        self._agree_on_save(failure)  # every rank's shards are on disk before the manifest vouches for them
        nbytes = 0
        if self.rank == 0:
            try:
                manifest = ckpt.write_manifest(tag_dir, self.step, self.last_loss, self.cursor.next_sample,
                                               self.config_version)
                nbytes = sum(f["size"] for f in manifest["files"].values())
                # `latest` only ever names a tag with a manifest (DeepSpeed would write it before ours).
                ckpt.point_latest_to(self.ckpt_dir, tag)
            except OSError as exc:
                failure = ckpt.save_failure(exc, tag_dir / ckpt.MANIFEST_NAME, tag, self.rank)
        self._agree_on_save(failure)
        self._after_durable(self.step, tag, tag_dir, {"seconds": round(time.time() - t0, 3), "bytes": nbytes})
        self.dist.barrier()

    def _client_state(self) -> dict[str, Any]:
        return {"ulyssesd_step": self.step, "data_cursor": self.cursor.state_dict(),
                "data_position": self.source.position(self.cursor), "data_fingerprint": self.source.fingerprint(),
                "config_version": self.config_version, "loss": self.last_loss,
                "rng": {self.rank: rng_state()}, "attempt": self.attempt}

    def _room_for_save(self, tag: str) -> bool:
        """Collective: rank 0 makes room (budget.py), every rank learns if it fits; if not: skipped, an event."""
        box: list[Any] = [room_for_save(self.ckpt_dir, self.run_dir, tag, self.spec.checkpoint.keep_last,
                                        under_daemon=not self._owns_retention(), log=log,
                                        predicted_bytes=predicted_tag_bytes(getattr(self, "engine", None))) if self.rank == 0 else None]
        if self.world > 1:
            self.dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return True
        log.warning("checkpoint %s skipped: needs ~%s bytes, %s available", tag, box[0]["need_bytes"],
                    box[0]["available_bytes"])
        if self.rank == 0:
            self._event("checkpoint_skipped", **box[0])
        return False

    def _after_durable(self, step: int, tag: str, tag_dir: Path, fields: dict[str, Any]) -> None:
        """A save of `step` has its manifest and `latest`: faults, `checkpoint_saved`, retention."""
        self.faults.after_save(step, tag_dir)
        # At the saved step, not the current one: the daemon records the tag at the event's step.
        self.tele.event("checkpoint_saved", step, tag=tag, **fields)
        if self.rank == 0 and self._owns_retention():
            self._prune()

    def _owns_retention(self) -> bool:
        # Under the daemon, retention is the daemon's (it keeps the known-good anchors a rollback needs);
        # a job run by hand keeps the last K valid tags itself.
        return not os.environ.get("ULYSSESD_RUN_DIR")

    def _prune(self) -> None:
        """The job's own retention (`ckpt.prune` decides what goes); an async save runs it in its writer thread
        after the commit (deleting 17 GB took 3.3 s on the H200 host: never on the training thread)."""
        removed = ckpt.prune(self.ckpt_dir, self.spec.checkpoint.keep_last)
        if removed:
            log.info("retention removed %s", ", ".join(removed))

    def _async_writer(self) -> ckpt.AsyncCheckpointWriter:
        writer = self._writer
        if writer is None:
            delay = float(os.environ.get(ASYNC_WRITE_DELAY_ENV) or 0.0)
            writer = self._writer = ckpt.AsyncCheckpointWriter(
                self.rank, write_hook=self._async_write_hook(delay))
        return writer

    def _async_write_hook(self, delay_s: float) -> Any:
        def hook(path: str) -> None:
            if delay_s > 0:
                time.sleep(delay_s)
            # The disk_full / read_only_fs faults of the save in flight; `touch` stands in for the write so a
            # disk_full leaves its partial file as a real full disk would.
            inflight = self._async_inflight
            if inflight is not None:
                self.faults.checkpoint_write(inflight[0], path, lambda: Path(path).touch())
        return hook

    def _save_async(self, tag: str, tag_dir: Path, client: dict[str, Any], t0: float) -> None:
        """DeepSpeed's save into host-memory snapshots, then the writes, fsyncs and (rank 0) the manifest
        commit in a background thread; training goes on. finish_saves() (the next save, or exit) waits for it."""
        writer = self._async_writer()
        writer.begin(tag_dir)  # the previous save was finished by _save: this does not wait
        real_copy = self.engine._copy_recovery_script
        failed: list[dict[str, Any]] = []

        def guarded_copy(save_path: str) -> None:
            try:
                real_copy(save_path)
            except OSError as exc:
                failed.append(ckpt.save_failure(exc, save_path, tag, self.rank))

        self.engine.checkpoint_engine.save = writer.collect
        self.engine._copy_recovery_script = guarded_copy
        try:
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
        finally:
            del self.engine.checkpoint_engine.save, self.engine._copy_recovery_script
        self._agree_on_save(failed[0] if failed else None)
        commit = retention = None
        if self.rank == 0:
            step, loss, samples, version = self.step, self.last_loss, self.cursor.next_sample, self.config_version
            commit = lambda: ckpt.commit_when_durable(tag_dir, self.world, step, loss, samples, version,  # noqa: E731
                                                      timeout_s=ASYNC_COMMIT_TIMEOUT_S)
            retention = self._prune if self._owns_retention() else None
        self._async_inflight = (self.step, tag, tag_dir, t0, time.time() - t0 + self._async_waited_s)
        self._async_reported = False
        writer.start(commit=commit, after_commit=retention)
        self.dist.barrier()

    def poll_saves(self) -> None:
        """Every step, non-blocking, no collective: rank 0 reports the async save in flight (`checkpoint_saved`)
        as soon as its writer thread has committed the manifest, so the daemon's newest valid tag is not one
        interval behind. The event is written here, on the training thread, rather than from the writer thread:
        telemetry stays one writer between steps (a fault that kills right after an event, or a telemetry write
        that fails, stays the step loop's business and never becomes a failed save)."""
        if not self._pool_prepared:
            self._prepare_snapshot_pool()
        writer, inflight = self._writer, self._async_inflight
        if self.rank == 0 and writer is not None and inflight is not None and not self._async_reported \
                and writer.committed:
            self._report_async_saved(writer, inflight)
        pool = writer.snapshot_pool if writer is not None else None
        if pool is not None and not self._pool_reported and pool.state != "filling":
            self._pool_reported = True
            if pool.ready:
                log.info("snapshot pool ready: %.2f GB registered in %.1f s (%.1f s in cudaHostRegister)",
                         pool.nbytes / 1e9, pool.build_s, pool.register_s)
            else:
                log.warning("snapshot pool %s; async saves use pinned buffers", pool.state)
            self._event("snapshot_pool_ready", rank=self.rank, ready=pool.ready, state=pool.state,
                        bytes=pool.nbytes, build_seconds=round(pool.build_s, 3),
                        register_seconds=round(pool.register_s, 3))

    def _prepare_snapshot_pool(self, tag: str | None = None) -> None:
        """Once per attempt, the async writer starts building its snapshot pool in the background: on resume
        before the tag loads, sized from its manifest (ckpt.tag_snapshot_bytes), so the build overlaps the load;
        otherwise (or when that tag was written by another number of ranks) at the first poll, after the first
        step (the optimizer's states exist then), sized by what DeepSpeed's save will hand over
        (ckpt.engine_snapshot_bytes). Plus a margin."""
        cs, device = self.spec.checkpoint, getattr(self, "device", None)
        if self._pool_prepared or not (cs.async_save and cs.snapshot_pool) or device is None \
                or torch.device(device).type != "cuda":
            self._pool_prepared = True
            return   # off, or nothing to register off-GPU (CPU tensors are copied into plain memory)
        try:
            nbytes = ckpt.tag_snapshot_bytes(ckpt.read_manifest(self.ckpt_dir / tag)["files"], self.world) \
                if tag is not None else ckpt.engine_snapshot_bytes(self.engine)
        except Exception as exc:  # noqa: BLE001 - sizing is an optimisation: saves still work without the pool
            log.warning("snapshot pool not sized%s: %s: %s", f" from {tag}" if tag else "", type(exc).__name__, exc)
            nbytes = 0
        if tag is not None and nbytes == 0:
            return   # the first poll sizes it from the engine
        self._pool_prepared = True
        if nbytes == 0:
            return
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
        ranks_on_host = int(local) if local and local.isdigit() else max(1, min(self.world, torch.cuda.device_count()))
        self._async_writer().prepare_pool(
            nbytes + nbytes // 100 + POOL_MARGIN_BYTES, ckpt.CudaHostRegistrar(torch.device(device).index or 0),
            chunk_bytes=cs.snapshot_pool_chunk_mib << 20, pause_s=cs.snapshot_pool_pause_ms / 1000.0,
            ranks_on_host=ranks_on_host)

    def _report_async_saved(self, writer: ckpt.AsyncCheckpointWriter,
                            inflight: tuple[int, str, Path, float, float]) -> None:
        """Rank 0: the one `checkpoint_saved` of an async save whose manifest is durable."""
        step, tag, tag_dir, t0, blocked_s = inflight
        # write_seconds: snapshot handed over -> this rank's shards durable (+ rank 0's commit: commit_seconds);
        # seconds: snapshot -> reported (the first step after the commit, or the wait at the next save / exit).
        self.tele.event("checkpoint_saved", step, tag=tag, seconds=round(time.time() - t0, 3),
                        bytes=ckpt.manifest_bytes(ckpt.read_manifest(tag_dir)), async_save=True,
                        blocked_seconds=round(blocked_s, 3), write_seconds=round(writer.last_shards_s, 3),
                        commit_seconds=round(writer.last_write_s - writer.last_shards_s, 3),
                        write_bytes=writer.last_bytes, host_buffer_alloc_bytes=writer.last_alloc_bytes,
                        device_staged_bytes=writer.last_staged_bytes, reported_at_step=self.step,
                        waited_for_previous_seconds=round(self._async_waited_s, 3), **writer.pool_fields())
        self._async_reported = True

    def finish_saves(self) -> None:
        """Collective: wait until the background save in flight (if any) is durable on every rank (its
        retention included), then report it (`checkpoint_saved`) unless poll_saves already did, or raise
        CheckpointSaveError (exit 4) if it failed on any rank.
        The SIGTERM path and the end of the run call this before exiting; _save calls it first."""
        writer, inflight = self._writer, self._async_inflight
        if writer is None or inflight is None:
            return
        step, tag, tag_dir = inflight[:3]
        writer.wait()
        failure = writer.take_failure()
        self._async_inflight = None
        if failure is not None:
            failure.setdefault("errno_code", None)
        self._agree_on_save(failure)
        self.faults.after_save(step, tag_dir)
        if self.rank == 0 and not self._async_reported:
            self._report_async_saved(writer, inflight)
        self._async_reported = False
        self.dist.barrier()

    def _save_files(self, tag: str, tag_dir: Path, client: dict[str, Any]) -> dict[str, Any] | None:
        """DeepSpeed's save with every file write guarded: the first failed write is recorded and the
        remaining writes of this save are skipped, so DeepSpeed still reaches its own collectives (one rank
        raising there would leave its peers blocked in a barrier). Returns this rank's failure or None."""
        engine = self.engine.checkpoint_engine
        real_save, real_copy = engine.save, self.engine._copy_recovery_script
        failed: list[dict[str, Any]] = []

        def guarded(write: Any, path: str) -> None:
            if failed:
                return
            try:
                write()
            except (OSError, RuntimeError) as exc:
                if not ckpt.is_write_error(exc):
                    raise
                failed.append(ckpt.save_failure(exc, path, tag, self.rank))

        def guarded_save(state_dict: Any, path: str) -> None:
            guarded(lambda: self.faults.checkpoint_write(self.step, str(path), lambda: real_save(state_dict, path)),
                    str(path))

        # Rank 0 also copies DeepSpeed's zero_to_fp32.py into the tag with a plain copyfile.
        engine.save = guarded_save
        self.engine._copy_recovery_script = lambda save_path: guarded(lambda: real_copy(save_path), str(save_path))
        try:
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
        finally:
            # Drop the instance attributes: the classes' methods show through again.
            del engine.save, self.engine._copy_recovery_script
        return failed[0] if failed else None

    def _agree_on_save(self, failure: dict[str, Any] | None) -> None:
        """Collective: if any rank's save failed, all ranks raise CheckpointSaveError (rank 0 first reports
        the lowest failing rank's errno as `checkpoint_save_failed`)."""
        box: list[Any] = [None] * self.world
        self.dist.all_gather_object(box, failure)
        failures = [f for f in box if f is not None]
        if not failures:
            return
        first = failures[0]
        log.error("checkpoint save failed: %s (%s) writing %s; %s bytes free", first["errno"], first["error"],
                  first["path"], first["bytes_free"])
        try:
            self._event("checkpoint_save_failed", **first, failed_ranks=[f["rank"] for f in failures])
        except OSError as exc:  # the telemetry file is on the same full disk: the log line above remains
            log.error("could not record checkpoint_save_failed in telemetry: %s", exc)
        raise CheckpointSaveError(first)
