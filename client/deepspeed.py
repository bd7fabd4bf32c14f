"""`attach(engine)`: supervise a hand-written DeepSpeed loop with one line.

    engine, *_ = deepspeed.initialize(...)
    sup = attach(engine, save_dir="ckpt")      # telemetry, control.json, SIGTERM -> save, SIGUSR1 -> stacks
    for batch in data:
        loss = engine(batch); engine.backward(loss); engine.step()

`engine.backward` and `engine.step` are wrapped on this engine instance only. At each gradient-accumulation
boundary, before the optimizer step, control.json is polled (rank 0 reads it; one broadcast_object_list per
step shares it when distributed); after the step, rank 0 reports the step (mean micro-batch loss of
rank 0, grad norm, LR, loss scale, skipped, step time, memory). When SIGTERM arrived on any rank, all ranks
agree (one all_reduce of a flag per step), save `save_dir/step-XXXXXXXX` with a manifest (unless the daemon
marked the weights suspect), report `exiting` and raise SystemExit(0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ulyssesd.client.control import Control
from ulyssesd.client.manifest import write_manifest
from ulyssesd.client.reporter import Reporter
from ulyssesd.client.signals import GracefulStop, install_signal_handlers


def _mem_gib(device: Any) -> dict[str, float]:
    import torch

    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return {}
    gib = float(1 << 30)
    out = {"mem_allocated_gib": torch.cuda.memory_allocated(device) / gib,
           "mem_max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
           "mem_reserved_gib": torch.cuda.memory_reserved(device) / gib}
    torch.cuda.reset_peak_memory_stats(device)
    return out


class Attached:
    """What `attach` returns: the reporter, control and stop flag it installed on the engine."""

    def __init__(self, engine: Any, reporter: Reporter, control: Control, stop: GracefulStop | None,
                 save_dir: Path | None, tokens_per_step: int | None, exit_on_sigterm: bool):
        self.engine = engine
        self.reporter = reporter
        self.control = control
        self.stop = stop
        self.save_dir = save_dir
        self.tokens_per_step = tokens_per_step
        self.exit_on_sigterm = exit_on_sigterm
        self._loss_sum: Any = None
        self._loss_n = 0
        self._t_last = time.perf_counter()
        self._skipped_before = int(getattr(engine, "skipped_steps", 0) or 0)
        self._orig_backward = engine.backward
        self._orig_step = engine.step
        engine.backward = self._backward
        engine.step = self._step

    # ------------------------------------------------------------------------------- wrappers
    def _backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        d = loss.detach()
        self._loss_sum = d.float() if self._loss_sum is None else self._loss_sum + d.float()  # no sync
        self._loss_n += 1
        return self._orig_backward(loss, *args, **kwargs)

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        eng = self.engine
        boundary = bool(eng.is_gradient_accumulation_boundary())
        if boundary:
            self.control.poll(step=int(eng.global_steps) + 1)
        out = self._orig_step(*args, **kwargs)
        if boundary:
            self._report()
            if self._stop_agreed():
                self._stop_now()
        return out

    # -------------------------------------------------------------------------------- helpers
    def _report(self) -> None:
        eng = self.engine
        now = time.perf_counter()
        step_time = now - self._t_last
        self._t_last = now
        loss = float(self._loss_sum.item() / self._loss_n) if self._loss_n else float("nan")
        self._loss_sum, self._loss_n = None, 0
        skipped_total = int(getattr(eng, "skipped_steps", 0) or 0)
        skipped = skipped_total > self._skipped_before
        self._skipped_before = skipped_total
        fields: dict[str, Any] = {"skipped": skipped, "step_time_s": step_time}
        gn = eng.get_global_grad_norm() if hasattr(eng, "get_global_grad_norm") else None
        if gn is not None:
            fields["grad_norm"] = float(gn)
        try:
            fields["lr"] = float(eng.get_lr()[0])
        except (AttributeError, IndexError, TypeError):
            pass
        if eng.fp16_enabled() and hasattr(eng.optimizer, "cur_scale"):
            fields["loss_scale"] = float(eng.optimizer.cur_scale)
        if self.tokens_per_step:
            fields["tokens"] = int(self.tokens_per_step)
            fields["tokens_per_s"] = self.tokens_per_step / step_time if step_time > 0 else None
        fields.update(_mem_gib(getattr(eng, "device", None)))
        self.reporter.step(int(eng.global_steps), loss, **fields)

    def _stop_agreed(self) -> bool:
        mine = self.stop is not None and self.stop.requested
        world = self.control.poller.world_size
        if world <= 1:
            return mine
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if mine else 0.0], device=self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def save(self) -> str | None:
        """Save `save_dir/step-XXXXXXXX` on all ranks and write its manifest on rank 0. Returns the tag."""
        if self.save_dir is None:
            return None
        eng = self.engine
        step = int(eng.global_steps)
        tag = f"step-{step:08d}"
        self.reporter.event("checkpoint_saving", step, tag=tag)
        t0 = time.time()
        eng.save_checkpoint(str(self.save_dir), tag=tag)
        world = self.control.poller.world_size
        if world > 1:
            import torch.distributed as dist

            dist.barrier()  # every rank's shards are on disk before the manifest says the tag is complete
        if self.reporter.enabled:
            manifest = write_manifest(self.save_dir / tag, step)
            nbytes = sum(int(m["size"]) for m in manifest["files"].values())
            self.reporter.event("checkpoint_saved", step, tag=tag, seconds=round(time.time() - t0, 3),
                                bytes=nbytes)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        return tag

    def _stop_now(self) -> None:
        step = int(self.engine.global_steps)
        saved = False
        if not self.control.suspect:
            saved = self.save() is not None
        self.reporter.event("exiting", step, reason="sigterm", saved=saved)
        self.reporter.flush()
        if self.exit_on_sigterm:
            raise SystemExit(0)

    def detach(self) -> None:
        """Restore the engine's own backward/step and flush telemetry."""
        self.engine.backward = self._orig_backward
        self.engine.step = self._orig_step
        self.reporter.flush()


def attach(engine: Any, *, save_dir: str | Path | None = None, reporter: Reporter | None = None,
           control: Control | None = None, signals: bool = True, tokens_per_step: int | None = None,
           exit_on_sigterm: bool = True) -> Attached:
    """Supervise `engine` (a DeepSpeedEngine): see the module docstring. Call on every rank, after
    deepspeed.initialize (and after loading a checkpoint, so `started` reports the resumed step)."""
    reporter = reporter or Reporter()
    control = control or Control(engine, reporter=reporter)
    if control.target is None:
        control.target = engine
    stop = install_signal_handlers() if signals else None
    sup = Attached(engine, reporter, control, stop, Path(save_dir) if save_dir is not None else None,
                   tokens_per_step, exit_on_sigterm)
    reporter.event("started", int(engine.global_steps), world_size=control.poller.world_size,
                   start_step=int(engine.global_steps), integration="deepspeed.attach")
    return sup
