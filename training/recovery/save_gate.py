"""Whether an async save that is due now would block training, and what to do then (issue 33, item 1).

A save blocks when its snapshot has no ready memory to go to (the registered snapshot pool still filling: the
copy falls back to pinned buffers allocated then, ~0.55 s per GiB on the H200 host) or when the previous save's
write still runs (one save in flight: back-pressure). Then the save moves to a later step, up to
`checkpoint.save_defer_max_steps` steps after it was due; past that, or for the run's last save and the
SIGTERM save, it is taken as it is. The ranks agree (the slowest rank's answer wins), so every rank saves
at the same step. `checkpoint_saving` says which: `staging` ("pool", "pinned", "sync", "memory") and,
for a deferred save, `due_step` and `deferred_steps`; each deferral is a `checkpoint_deferred` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GateInput:
    """One rank's view when a save is due."""

    async_save: bool
    pool_state: str | None    # the snapshot pool's describe() ("ready", "filling (...)", "refused: ...", None: none)
    previous_in_flight: bool  # the previous save's background write still runs
    on_gpu: bool


def staging(g: GateInput) -> str:
    """Where this rank's snapshot would go now: "sync" (no async save), "memory" (CPU tensors: plain host
    memory, nothing to wait for), "pool" (the registered pool is ready), "pinned" (pinned buffers)."""
    if not g.async_save:
        return "sync"
    if not g.on_gpu:
        return "memory"
    return "pool" if g.pool_state == "ready" else "pinned"


def wants_deferral(g: GateInput) -> str | None:
    """Why this rank would rather not save now (None: saving now does not block beyond the copy)."""
    if not g.async_save:
        return None
    if g.previous_in_flight:
        return "the previous save is still being written"
    if g.on_gpu and g.pool_state is not None and g.pool_state.startswith("filling"):
        return f"the snapshot pool is {g.pool_state}"
    return None


def decide(reasons: list[str | None], deferred_steps: int, max_defer: int, final: bool) -> tuple[bool, str | None]:
    """(defer?, why) from every rank's wants_deferral: defer while any rank wants it, the budget of steps
    allows it and this is not a save that must happen now."""
    why = next((f"rank {r}: {w}" for r, w in enumerate(reasons) if w is not None), None)
    if why is None or final or deferred_steps >= max_defer:
        return False, why
    return True, why


def gate_fields(stage: str, due_step: int | None, deferred_steps: int, why: str | None) -> dict[str, Any]:
    """The save gate's fields of a `checkpoint_saving` event."""
    fields: dict[str, Any] = {"staging": stage}
    if due_step is not None and deferred_steps:
        fields.update(due_step=due_step, deferred_steps=deferred_steps)
    if why is not None:
        fields["not_ready"] = why
    return fields


class DeferredSaves:
    """The gate on the Trainer (a base class of `training.train.Trainer`): `_save_now` each step."""

    spec: Any
    rank: int
    world: int
    dist: Any
    device: Any
    _writer: Any
    _event: Any
    _save_due_step: int | None = None           # the step a save became due at and has not happened since
    _save_gate_fields: dict[str, Any] = {}      # noqa: RUF012 - replaced whole, never mutated

    def _save_now(self, step: int, due: bool, final: bool) -> bool:
        """Collective while a save is due or deferred (and async saves are on): True = save at this step."""
        if due and self._save_due_step is None:
            self._save_due_step = step
        if self._save_due_step is None:
            return False
        cs, writer = self.spec.checkpoint, self._writer
        pool = writer.snapshot_pool if writer is not None else None
        g = GateInput(async_save=cs.async_save, pool_state=pool.describe() if pool is not None else None,
                      previous_in_flight=bool(writer is not None and writer.in_flight),
                      on_gpu=getattr(self.device, "type", "cpu") == "cuda")
        reasons: list[Any] = [wants_deferral(g)]
        if cs.async_save and self.world > 1:
            reasons = [None] * self.world
            self.dist.all_gather_object(reasons, wants_deferral(g))
        deferred = step - self._save_due_step
        defer, why = decide(reasons, deferred, cs.save_defer_max_steps, final)
        if defer:
            if deferred == 0:
                self._event("checkpoint_deferred", due_step=step, why=why, max_steps=cs.save_defer_max_steps)
            return False
        self._save_gate_fields = gate_fields(staging(g), self._save_due_step, deferred, why)
        self._save_due_step = None
        return True
