"""In-process restart: a failed step is dropped and every rank restores the host-memory tier, in the same
process, with no disk read (docs/TRAINING.md "Host-memory tier and in-process restart").

`InProcessRecovery` is a base class of `training.train.Trainer`, like `TrainerCheckpoints`. What it covers:
- a step that raises on any rank before the step's first collective (the fault hook, the data loader):
  every rank reaches the step-start agreement (`_agree_step_start`, one all-reduce of a flag) and learns it;
- a step whose gathered loss is not finite (every rank sees the same all-reduced loss).
What it does not cover: an exception inside forward/backward on some ranks only. The others are then blocked in
a collective the failing rank never joins; gloo cannot abort it from outside, so that fault takes the usual
path (the rank exits, the launcher ends the others, the daemon restarts from disk or the standby).
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

from ..checkpoint import tag_for_step
from .host_tier import HostTier

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
    preload: Any
    _tier: HostTier | None = None
    _save_due_step: int | None = None
    _in_process_restarts = 0

    # Provided by Trainer / TrainerCheckpoints (annotations only: this class comes first in the MRO).
    _event: Callable[..., None]
    _client_state: Callable[[], dict[str, Any]]
    _resume: Callable[[str | None], tuple[str | None, float]]
    ckpt_dir: Path

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
        tag = tag_for_step(self.step)
        prev_digest_s, prev_bytes = tier.digest_s, tier.nbytes
        meta = {"loss": self.last_loss, "samples_seen": self.cursor.next_sample, "world": self.world,
                "config_version": getattr(self, "config_version", None)}
        held = tier.capture(self.engine, self.ckpt_dir, tag, self.step, self._client_state(), meta)
        shared_s = self._share_model_states(tier)
        self._event("memory_snapshot", tag=tag, seconds=round(held + shared_s, 4), with_disk_save=with_disk_save,
                    previous_digest_seconds=round(prev_digest_s, 4), previous_bytes=prev_bytes)

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
                     loss=None if drop.loss is None else str(drop.loss), restarts=self._in_process_restarts)
        log.warning("step %d dropped (%s); restored %s from host memory in-process", drop.step, drop.reason, tier.tag)

    def _report(self, path: str, step: int, reason: str, error: str, **fields: Any) -> None:
        if path == "fallback":
            log.error("in-process restart not possible at step %d (%s): %s", step, reason,
                      fields.get("fallback_reason"))
        self.tele.event("in_process_restart", step, path=path, reason=reason, error=error[:500],
                        failed_step=step, **{k: v for k, v in fields.items() if v is not None})


class _TierPreload:
    """The host tier in the shape of a standby's preload, so `_resume` loads through it."""

    from_memory = True   # a failed load says nothing about the disk tag of that name (not quarantined)

    def __init__(self, tier: HostTier):
        self.tier = tier

    def serve(self, engine: Any, ckpt_dir: Path, tag: str, event: Any) -> Any:
        return self.tier.serve(engine, ckpt_dir, tag, event)
