"""In-process restart: a failed step is dropped and every rank restores the host-memory tier, in the same
process, with no disk read (docs/TRAINING.md "Host-memory tier and in-process restart").

`InProcessRecovery` is a base class of `training.train.Trainer`, like `TrainerCheckpoints`. What it covers:
- a step that raises on any rank before the step's first collective (the fault hook, the data loader):
  every rank reaches the step-start agreement (`_agree_step_start`, one all-reduce of a flag) and learns it;
- a step whose gathered loss is not finite (every rank sees the same all-reduced loss).
- a step that raises after its collectives began, on some ranks (in backward, between the forward's all-to-all
  and the reduce-scatter), the others blocked in a collective the failing rank never joins: the process group is
  torn down (which releases them), rebuilt in the same processes within `in_process_rebuild_timeout_s`
  (`group_restart.py`), the engine is built again on it and loads the host tier (`_recover_mid_step`). When the
  group cannot be rebuilt in time (a rank died), the fault takes the usual path: the ranks exit and the daemon
  relaunches, from the shared-memory copy of the tier when it is the newest (`shm_tier.py`).
An out-of-memory error is not restarted in-process: the same step would fail again; the daemon's memory ladder
changes the config.
Each restart is bounded (`checkpoint.in_process_max_restarts` per attempt); when the tier cannot serve
(no snapshot, its manifest failed, a rank disagrees) the fault takes the usual path too. Every decision is one
`in_process_restart` telemetry event with `path` = "in_process" or "fallback" (docs/CONTRACTS.md).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import step_of_tag, tag_for_step
from .group_restart import (
    GroupRebuilder,
    abort_process_groups,
    cut_connections,
    failure_summary,
    is_collective_error,
)
from .host_tier import HostTier
from .shm_tier import ShmCopy
from .shm_tier import choose as shm_choose
from .shm_tier import summary as shm_summary

log = logging.getLogger("ulyssesd.training")


class StepDropped(Exception):
    """Raised on every rank: step `step` is dropped (`reason`: "exception" or "nan_loss")."""

    def __init__(self, step: int, reason: str, error: str, failed_ranks: list[int], samples: tuple[int, int] | None,
                 own: BaseException | None = None, loss: float | None = None):
        super().__init__(f"step {step} dropped ({reason}): {error}")
        self.step, self.reason, self.error, self.failed_ranks = step, reason, error, failed_ranks
        self.samples, self.own, self.loss = samples, own, loss


class InProcessRecovery:
    """Host tier snapshots and in-process restarts for one rank's Trainer (see the module docstring)."""

    # Set by Trainer / TrainerCheckpoints.
    spec: Any
    rank: int
    world: int
    dist: Any
    engine: Any
    device: torch.device
    step: int
    last_loss: float | None
    cursor: Any
    loader: Any
    faults: Any
    tele: Any
    scalars: Any
    sp_group: Any
    mpu: Any
    preload: Any
    _tier: HostTier | None = None
    _save_due_step: int | None = None
    _in_process_restarts = 0
    _shm: ShmCopy | None = None
    _group: Any = None   # group_restart.GroupRebuilder, made at the first mid-step failure
    _mid_step_fields: dict[str, Any] = {}  # noqa: RUF012 - the group rebuild's figures, reported once

    # Provided by Trainer / TrainerCheckpoints (annotations only: this class comes first in the MRO).
    _event: Callable[..., None]
    _client_state: Callable[[], dict[str, Any]]
    _resume: Callable[[str | None], tuple[str | None, float]]
    _init_distributed: Callable[[], None]
    _build: Callable[[], None]
    ckpt_dir: Path
    run_dir: Path

    # ------------------------------------------------------------------------------- snapshots
    def _in_process_on(self) -> bool:
        return bool(self.spec.checkpoint.in_process_restart)

    def _memory_snapshot_due(self, step: int, disk_save_due: bool) -> bool:
        cs = self.spec.checkpoint
        if not cs.memory_tier:
            return False
        return disk_save_due or bool(cs.memory_interval_steps and step % cs.memory_interval_steps == 0)

    def _memory_snapshot(self, with_disk_save: bool) -> None:
        """Collective: the newest snapshot of every rank into its host tier (replacing the previous one)."""
        tier = self._tier = self._tier or HostTier(self.rank)
        shm = self._shm_copy()
        shm_wait_s = shm.join() if shm is not None else 0.0   # it reads the buffers the capture reuses
        tag = tag_for_step(self.step)
        prev_digest_s, prev_bytes = tier.digest_s, tier.nbytes
        meta = {"loss": self.last_loss, "samples_seen": self.cursor.next_sample, "world": self.world,
                "config_version": getattr(self, "config_version", None)}
        held = tier.capture(self.engine, self.ckpt_dir, tag, self.step, self._client_state(), meta)
        shared_s = self._share_model_states(tier)
        previous_shm = dict(shm.last) if shm is not None else None
        if shm is not None:
            shm.publish_async(tier, self.ckpt_dir)
        self._event("memory_snapshot", tag=tag, seconds=round(held + shared_s + shm_wait_s, 4),
                    with_disk_save=with_disk_save, previous_digest_seconds=round(prev_digest_s, 4),
                    previous_bytes=prev_bytes, shm_wait_seconds=round(shm_wait_s, 4), previous_shm=previous_shm)

    # ------------------------------------------------------------------- across processes (shm)
    def _shm_copy(self) -> ShmCopy | None:
        cs = self.spec.checkpoint
        if not (cs.memory_tier and cs.memory_shm):
            return None
        if self._shm is None:
            self._shm = ShmCopy(self.run_dir, self.rank, self.world, int(cs.memory_shm_max_gib * (1 << 30)))
        return self._shm

    def _prefer_shm_copy(self, disk_tag: str | None) -> str | None:
        """Collective, at the start of an attempt: the tag to resume from, the shared-memory copy's when it is
        newer than `disk_tag` and passes every check (shm_tier.py); its host tier then serves the load."""
        shm = self._shm_copy()
        if shm is None:
            return disk_tag
        t0 = time.perf_counter()
        mine = shm.copies()
        box: list[Any] = [None] * self.world
        self.dist.all_gather_object(box, [shm_summary(m) for m in mine])
        disk_step = (step_of_tag(disk_tag) or 0) if disk_tag else 0
        tag, why = shm_choose(box, self.world, disk_step, str(self.spec.checkpoint.load))
        loaded: HostTier | str | None = None
        if tag is not None:
            loaded = shm.load(next(m for m in mine if m["tag"] == tag))
        whys: list[Any] = [None] * self.world
        self.dist.all_gather_object(whys, loaded if isinstance(loaded, str) else None)
        if tag is not None and any(w is not None for w in whys):
            why = next(f"rank {r}: {w}" for r, w in enumerate(whys) if w is not None)
            tag = None
        if tag is None:
            if any(box):   # a copy was there and is not used: say why
                self._event("memory_snapshot_unused", disk_tag=disk_tag, reason=why)
            return disk_tag
        assert isinstance(loaded, HostTier)
        if self.preload is not None and hasattr(self.preload, "release"):
            self.preload.release()   # a promoted standby's bytes of the older disk tag: not needed now
        self._tier, self.preload = loaded, _TierPreload(loaded)
        self._event("memory_snapshot_restored", tag=tag, restored_step=loaded.step, disk_tag=disk_tag, source="shm",
                    seconds=round(time.perf_counter() - t0, 4), bytes=loaded.nbytes)
        log.warning("resuming from the shared-memory copy %s (newest durable tag: %s)", tag, disk_tag)
        return tag

    def _clean_shm(self) -> None:
        """An orderly exit: this rank's shared-memory copy goes (the owner cleans up)."""
        if self._shm is not None:
            self._shm.clean()

    def _share_model_states(self, tier: HostTier) -> float:
        """A model-states file this rank's load reads but another rank wrote (ZeRO-1/2: rank 0's
        mp_rank_00_model_states.pt; ZeRO-3 writes one per rank) comes from the lowest rank that holds it."""
        t0 = time.perf_counter()
        if self.world == 1:
            return 0.0
        root = self.ckpt_dir / str(tier.tag)
        held: list[Any] = [None] * self.world
        self.dist.all_gather_object(held, sorted(str(root / r) for r in tier.files if "model_states" in r))
        every = sorted({p for names in held for p in names})
        mine = set(held[self.rank])
        wants: list[Any] = [None] * self.world
        self.dist.all_gather_object(wants, [p for p in tier.model_state_files(self.engine, self.ckpt_dir,
                                                                             str(tier.tag), every) if p not in mine])
        shared: dict[str, Any] = {}
        for path in sorted({p for w in wants for p in w}):
            holder = min(i for i, names in enumerate(held) if path in names)
            rel = Path(path).relative_to(root).as_posix()
            box = [tier.files[rel] if self.rank == holder else None]
            self.dist.broadcast_object_list(box, src=holder)
            if path in wants[self.rank]:
                shared[rel] = box[0]
        if shared:
            tier.add_shared(shared)
        return time.perf_counter() - t0

    # --------------------------------------------------------------------------- the step's edges
    def _agree_step_start(self, step: int, error: BaseException | None, samples: tuple[int, int] | None) -> None:
        """Collective (with in_process_restart on): did every rank get through the step's local start (fault
        hook, batches)? If any did not, every rank raises StepDropped (the failing ones with their exception)."""
        flag = torch.tensor([1.0 if error is not None else 0.0], device=self.device)
        self.dist.all_reduce(flag)
        if float(flag.item()) == 0.0:
            return
        errors: list[Any] = [None] * self.world
        self.dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}"[:300])
        failed = [r for r, e in enumerate(errors) if e is not None]
        raise StepDropped(step, "exception", f"rank {failed[0]}: {errors[failed[0]]}", failed, samples, own=error)

    def _check_loss(self, step: int, loss: float, samples: tuple[int, int] | None) -> None:
        """After the step's gather (every rank has the same loss): a non-finite loss drops the step when the
        host tier can serve it; otherwise the step is recorded as usual and the daemon acts on it."""
        if math.isfinite(loss) or not self._in_process_on():
            return
        why = self._cannot_restore()
        if why is not None:
            self._report("fallback", step, "nan_loss", f"loss {loss}", fallback_reason=why, loss=str(loss))
            return
        raise StepDropped(step, "nan_loss", f"loss {loss}", [], samples, loss=loss)

    # ------------------------------------------------------------------------- mid-step failures
    def _recover_mid_step(self, step: int, exc: Exception) -> None:
        """Every rank whose step `step` raised after its collectives began (its own error, or a collective the
        failing rank left): rebuild the process group and the engine, then restore the host tier; re-raise
        `exc` when in-process restart is off or cannot be done (the usual path)."""
        if not self._in_process_on() or isinstance(exc, torch.OutOfMemoryError):
            raise exc
        t0 = time.perf_counter()
        collective = is_collective_error(exc)
        own = f"{type(exc).__name__}: {exc}"[:300]
        log.error("step %d failed on rank %d %s: %s", step, self.rank,
                  "in a collective" if collective else "mid-step", own)
        if self._in_process_restarts >= self.spec.checkpoint.in_process_max_restarts:
            raise exc   # no restart left: as if off (the agreement would need the group that just failed)
        if self._group is None:
            self._group = GroupRebuilder(self.rank, self.world, self.dist.get_backend(),
                                         self.spec.checkpoint.in_process_rebuild_timeout_s)
        log.error("step %d: the failure, before the process group is torn down", step, exc_info=exc)
        exc.__traceback__ = None   # its frames hold the engine, the batch and the autograd graph
        cut = cut_connections(self._group.keep_ports)   # releases the peers still waiting in a collective
        self._drop_engine()
        abort_s = abort_process_groups()
        try:
            rebuild_s = self._group.rebuild(lambda: bool(getattr(self, "stop_signal", False)))
        except Exception as rebuild_exc:  # noqa: BLE001 - any failure here means: not in this process
            why = (f"process group not rebuilt within checkpoint.in_process_rebuild_timeout_s="
                   f"{self._group.rebuild_timeout_s:g}: {type(rebuild_exc).__name__}: {rebuild_exc}"[:400])
            self._report("fallback", step, "exception_mid_step", own, fallback_reason=why)
            raise exc from rebuild_exc
        errors: list[Any] = [None] * self.world
        self.dist.all_gather_object(errors, (own, collective))
        failed, cause = failure_summary(errors)
        cannot = self._cannot_restore()
        if cannot is not None:   # before the engine is built again for nothing
            self._report("fallback", step, "exception_mid_step", cause, fallback_reason=cannot)
            raise exc
        t1 = time.perf_counter()
        self._rebuild_engine()   # its hooks, buffers and groups belonged to the torn-down group
        self._mid_step_fields = {"group_rebuilt": True, "abort_seconds": round(abort_s, 4),
                                 "rebuild_seconds": round(rebuild_s, 4), "connections_cut": cut,
                                 "engine_seconds": round(time.perf_counter() - t1, 4),
                                 "fault_to_group_seconds": round(t1 - t0, 4)}
        self._restart_in_process(StepDropped(step, "exception_mid_step", cause, failed, None, own=exc))

    def _drop_engine(self) -> None:
        """Forget the engine and what holds it: its process groups' last references (gloo's connections close
        only then), and a GPU holds one engine's memory, not two."""
        import gc

        if self.loader is not None:   # its thread built batches from the abandoned cursor
            self.loader.close()
            self.loader = None
        if self.engine is not None:
            try:   # its autograd hooks hold it from C++, out of the collector's sight, until removed
                self.engine.destroy()
                _release_tensors(self.engine)
            except Exception as exc:  # noqa: BLE001 - a half-failed step may leave it half-built; drop it anyway
                log.warning("releasing the old engine failed: %s", exc)
        self.engine = self.scalars = self.sp_group = self.mpu = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _rebuild_engine(self) -> None:
        """The DeepSpeed engine again, on the new process group (same config and seed); the host tier then
        loads into it."""
        self._init_distributed()   # the group exists: only the sequence-parallel groups are made again
        self._build()

    # ------------------------------------------------------------------------------------ restart
    def _cannot_restore(self) -> str | None:
        """Collective: None when every rank's host tier holds the same restorable snapshot and this attempt
        has restarts left, else why not (the same answer on every rank)."""
        tier = self._tier
        limit = self.spec.checkpoint.in_process_max_restarts
        mine = tier.restorable() if tier is not None else "no snapshot in host memory"
        box: list[Any] = [None] * self.world
        self.dist.all_gather_object(box, (tier.tag if tier is not None else None, mine))
        tags = {t for t, _ in box}
        for r, (_t, why) in enumerate(box):
            if why is not None:
                return f"rank {r}: {why}"
        if len(tags) != 1:
            return f"the ranks hold different snapshots: {sorted(map(str, tags))}"
        if self._in_process_restarts >= limit:
            return f"checkpoint.in_process_max_restarts={limit} reached in this attempt"
        return None

    def _restart_in_process(self, drop: StepDropped) -> None:
        """Every rank: restore the host tier (no disk read) and go on from its step; raise when that cannot be
        done (the usual path: this rank exits, the daemon restarts the job)."""
        why = None if drop.reason == "nan_loss" else self._cannot_restore()  # nan: agreed in _check_loss
        mid_step, self._mid_step_fields = self._mid_step_fields, {}
        if why is not None:
            self._report("fallback", drop.step, drop.reason, drop.error, fallback_reason=why)
            if drop.own is not None:
                raise drop.own
            raise RuntimeError(f"step {drop.step} failed on rank(s) {drop.failed_ranks}: {drop.error}") from None
        t0 = time.perf_counter()
        tier = self._tier
        assert tier is not None
        self._in_process_restarts += 1
        self._save_due_step = None   # a save deferred on the abandoned steps is due again when they are redone
        if self.loader is not None:   # its thread built batches from the abandoned cursor
            self.loader.close()
            self.loader = None
        bad = tier.verify()
        verify_s = time.perf_counter() - t0
        box: list[Any] = [None] * self.world
        self.dist.all_gather_object(box, bad)
        if any(b is not None for b in box):
            reason = next(f"rank {r}: {b}" for r, b in enumerate(box) if b is not None)
            self._report("fallback", drop.step, drop.reason, drop.error, fallback_reason=reason)
            raise RuntimeError(f"in-process restart at step {drop.step}: host tier failed verification: {reason}")
        self.preload, previous = _TierPreload(tier), self.preload
        try:
            _tag, load_s = self._resume(tier.tag)
        except Exception as exc:   # the engine is half-loaded: only a fresh process can go on
            cause = exc.__cause__ or exc
            log.error("loading %s from memory failed", tier.tag, exc_info=cause)
            self._report("fallback", drop.step, drop.reason, drop.error,
                         fallback_reason=f"load from memory: {type(cause).__name__}: {cause}")
            raise RuntimeError(f"in-process restart at step {drop.step}: loading {tier.tag} from memory "
                               f"failed: {exc}") from exc
        finally:
            self.preload = previous
        if drop.reason == "nan_loss" and drop.samples is not None:
            self.cursor.add_skip(*drop.samples)   # the seed's fix: roll back and skip the step's batches
        self.faults.replayed_through = max(getattr(self.faults, "replayed_through", 0), drop.step)
        self._report("in_process", drop.step, drop.reason, drop.error, tag=tier.tag, restored_step=tier.step,
                     seconds=round(time.perf_counter() - t0, 4), verify_seconds=round(verify_s, 4),
                     load_seconds=round(load_s, 4), from_memory=tier.hits, disk_reads=0,
                     skipped_samples=list(drop.samples) if drop.reason == "nan_loss" and drop.samples else None,
                     loss=None if drop.loss is None else str(drop.loss), restarts=self._in_process_restarts,
                     failed_ranks=drop.failed_ranks, **mid_step)
        log.warning("step %d dropped (%s); restored %s from host memory in-process", drop.step, drop.reason, tier.tag)

    def _report(self, path: str, step: int, reason: str, error: str, **fields: Any) -> None:
        if path == "fallback":
            log.error("in-process restart not possible at step %d (%s): %s", step, reason,
                      fields.get("fallback_reason"))
        self.tele.event("in_process_restart", step, path=path, reason=reason, error=error[:500],
                        failed_step=step, **{k: v for k, v in fields.items() if v is not None})


def _release_tensors(engine: Any) -> None:
    """Empty the old engine's parameters, their ZeRO partitions and its optimizer's tensors: its objects are not
    all collected (its parameters keep references the collector cannot clear), and on a GPU they would keep one
    engine's device memory per restart. The host tier's snapshot is a copy: nothing it holds is touched."""
    def empty(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    for p in engine.module.parameters():
        empty(getattr(p, "ds_tensor", None))
        empty(p)
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        inner.state.clear()
    for value in (vars(opt).values() if opt is not None else ()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            empty(t)


class _TierPreload:
    """The host tier in the shape of a standby's preload, so `_resume` loads through it."""

    from_memory = True   # a failed load says nothing about the disk tag of that name (not quarantined)

    def __init__(self, tier: HostTier):
        self.tier = tier

    def serve(self, engine: Any, ckpt_dir: Path, tag: str, event: Any) -> Any:
        return self.tier.serve(engine, ckpt_dir, tag, event)
