"""Hugging Face Transformers integration: `UlyssesCallback`, a `TrainerCallback` (imports transformers).

    from ulyssesd.client.hf import UlyssesCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[UlyssesCallback()])

- every Trainer log with a `loss` becomes a step record (loss, grad_norm, lr, step time, tokens/s when you
  pass `tokens_per_step`, CUDA memory); set `logging_steps=1` to give the detectors every step;
- at each step begin, control.json is polled (all ranks) and applied: the LR scale to the optimizer's param
  groups (after the Trainer's scheduler), `gradient_clipping` to `args.max_grad_norm`;
- SIGTERM (the daemon's stop/restart): the Trainer saves a checkpoint at the end of the step in flight
  (unless the daemon marked the weights suspect) and stops; SIGUSR1 dumps stacks;
- every checkpoint the Trainer saves gets a manifest (`checkpoint-N/manifest.json`) and a `checkpoint_saved`
  event, so the daemon resumes only from complete ones (`[job] resume_requires` is then not needed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ulyssesd.client.control import Control
from ulyssesd.client.manifest import write_manifest
from ulyssesd.client.reporter import Reporter
from ulyssesd.client.signals import GracefulStop, install_signal_handlers


class UlyssesCallback(TrainerCallback):
    """Supervision of a Trainer run by ulyssesd (see the module docstring)."""

    def __init__(self, reporter: Reporter | None = None, control: Control | None = None,
                 tokens_per_step: int | None = None, signals: bool = True):
        self.reporter = reporter or Reporter()
        self.control = control
        self.tokens_per_step = tokens_per_step
        self.signals = signals
        self.stop: GracefulStop | None = None
        self._t_last: float | None = None
        self._stopped_by_signal = False
        self._eval_began: float | None = None   # an evaluation announced (`evaluating`) and not ended yet

    # ---------------------------------------------------------------------------------- hooks
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.signals and self.stop is None:
            self.stop = install_signal_handlers()
        if self.control is None:
            self.control = Control(kwargs.get("optimizer"), reporter=self.reporter)
        max_steps = getattr(state, "max_steps", None)
        if self.reporter.total_steps is None and isinstance(max_steps, int) and max_steps > 0:
            self.reporter.set_total_steps(max_steps)  # the Trainer's length: ulyssesctl status's total
        self.reporter.event("started", int(state.global_step), start_step=int(state.global_step),
                            world_size=int(getattr(args, "world_size", 1) or 1), integration="hf.UlyssesCallback")
        self._t_last = time.perf_counter()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ctl = self.control
        if ctl is None:
            return
        if ctl.target is None and kwargs.get("optimizer") is not None:
            ctl.target = kwargs["optimizer"]
        ctl.poll(step=int(state.global_step) + 1)
        gc = ctl.state.gradient_clipping
        if gc is not None and args.max_grad_norm != gc:
            args.max_grad_norm = gc  # the Trainer reads it at each clipping

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.stop is not None and self.stop.requested and not self._stopped_by_signal:
            self._stopped_by_signal = True
            control.should_save = not (self.control is not None and self.control.suspect)
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        now = time.perf_counter()
        fields: dict[str, Any] = {}
        if self._t_last is not None and state.global_step:
            steps = max(1, int(getattr(args, "logging_steps", 1) or 1))
            fields["step_time_s"] = (now - self._t_last) / steps
        self._t_last = now
        if logs.get("grad_norm") is not None:
            fields["grad_norm"] = float(logs["grad_norm"])
        if logs.get("learning_rate") is not None:
            fields["lr"] = float(logs["learning_rate"])
        if self.tokens_per_step:
            fields["tokens"] = int(self.tokens_per_step)
            if fields.get("step_time_s"):
                fields["tokens_per_s"] = self.tokens_per_step / fields["step_time_s"]
        fields.update(_cuda_memory())
        self.reporter.step(int(state.global_step), float(logs["loss"]), **fields)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The first batch of an evaluation announces it: the daemon's hang timeout then allows for it.
        if self._eval_began is None:
            self._eval_began = time.time()
            self.reporter.event("evaluating", int(state.global_step))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        began, self._eval_began = self._eval_began, None
        fields = {"seconds": round(time.time() - began, 3)} if began is not None else {}
        self.reporter.event("evaluated", int(state.global_step), **fields)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if ckpt.is_dir():
            t0 = time.time()
            manifest = write_manifest(ckpt, int(state.global_step))
            self.reporter.event("checkpoint_saved", int(state.global_step), tag=ckpt.name,
                                seconds=round(time.time() - t0, 3),
                                bytes=sum(int(m["size"]) for m in manifest["files"].values()))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        reason = "sigterm" if self._stopped_by_signal else "completed"
        self.reporter.event("exiting", int(state.global_step), reason=reason)
        self.reporter.flush()


def _cuda_memory() -> dict[str, float]:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    gib = float(1 << 30)
    out = {"mem_allocated_gib": torch.cuda.memory_allocated() / gib,
           "mem_max_allocated_gib": torch.cuda.max_memory_allocated() / gib,
           "mem_reserved_gib": torch.cuda.memory_reserved() / gib}
    torch.cuda.reset_peak_memory_stats()
    return out
