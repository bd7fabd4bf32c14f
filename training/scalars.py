"""Training scalars for TensorBoard, W&B and CSV users, written through DeepSpeed's monitor (`[scalars]`).

With every step record (each `train.log_every` steps) rank 0 writes `Train/Steps/<name>` with the training
step as x: loss, grad_norm, lr, loss_scale (fp16 only), tokens_per_s, mfu (when `scalars.peak_tflops_per_gpu`
is set), step_time_s, mem_allocated_gib / mem_max_allocated_gib / mem_reserved_gib (the job's device memory,
as in telemetry) and host_rss_gib. The sink is `engine.monitor.write_events`, i.e. every monitor the DeepSpeed
config enables (tensorboard, wandb, csv_monitor, comet): `[scalars] tensorboard/csv` add those blocks for
you, a `wandb` block in your ds_config gets the same scalars. No monitor enabled: nothing is written.

Writing is best effort and bounded, for these scalars and for DeepSpeed's own monitor writes alike: a
failed write is logged once (with the error), and after `MAX_CONSECUTIVE_FAILURES` failed writes in a row
the monitor is dropped for the rest of the attempt (logged). It never raises into the step loop.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

from .spec import JobSpec, ResolvedModel, SpecError

log = logging.getLogger("ulyssesd.training.scalars")

#: Prefix of every tag; DeepSpeed's own events use Train/Samples/ (x = samples), ours have x = step.
TAG_PREFIX = "Train/Steps/"
#: Failed writes in a row after which the writer gives up (a full disk or a dead W&B stays dead).
MAX_CONSECUTIVE_FAILURES = 3


def model_flops_per_step(m: ResolvedModel, seq_len: int, tokens_per_step: int) -> float:
    """Model FLOPs of one optimizer step: (6·N_non-embedding + 6·V·h)·T + 6·L·h·S²·(T/S).

    Causal attention counted (half the S² product of forward+backward), recompute not counted, the MFU
    definition docs/DEEPSPEED_NOTES.md uses for every benchmark figure."""
    h, layers, v, f = m.hidden_size, m.num_layers, m.vocab_size, m.ffn_hidden_size
    mlp_mats = 3 if m.mlp == "swiglu" else 2
    n_non_emb = layers * (4 * h * h + mlp_mats * h * f)
    sequences = tokens_per_step / seq_len
    return (6 * n_non_emb + 6 * v * h) * tokens_per_step + 6 * layers * h * seq_len * seq_len * sequences


def mfu(spec: JobSpec, world_size: int, tokens_per_step: int, step_time_s: float) -> float | None:
    """Model FLOPs utilisation of one step (0..1), or None when `scalars.peak_tflops_per_gpu` is unset."""
    peak = spec.scalars.peak_tflops_per_gpu
    if peak is None or step_time_s <= 0:
        return None
    flops = model_flops_per_step(spec.resolved_model(), spec.train.seq_len, tokens_per_step)
    return flops / step_time_s / world_size / (peak * 1e12)


def monitor_blocks(spec: JobSpec, attempt: int | None = None) -> dict[str, dict[str, Any]]:
    """The DeepSpeed monitor blocks `[scalars]` asks for; a relative `output_path` (scalars.dir) is placed
    under the run directory by build_ds_config, like a user's own monitor block.

    CSV files go to one directory per attempt (`csv/attempt-N`): DeepSpeed's csv_monitor appends, and a
    new process writes the `step,<name>` header again, so a relaunched attempt sharing the files would
    leave a header row in the middle of each. TensorBoard starts a new event file per process in the same
    directory, which TensorBoard reads as one run."""
    sc = spec.scalars
    jobs = {"tensorboard": "tensorboard", "csv_monitor": "csv" if attempt is None else f"csv/attempt-{attempt}"}
    wanted = {"tensorboard": sc.tensorboard, "csv_monitor": sc.csv}
    return {block: {"enabled": True, "output_path": sc.dir.rstrip("/") + "/", "job_name": job}
            for block, job in jobs.items() if wanted[block]}


def check_monitor_dependencies(ds_config: dict[str, Any]) -> None:
    """Refuse (exit 2, on every rank alike) before the engine is built when an enabled monitor's package is
    missing: DeepSpeed would raise ImportError from deepspeed.initialize on rank 0 only (where it builds its
    monitors), a crash instead of a config error naming the extra to install."""
    needs = {"tensorboard": ("tensorboard", "pip install 'ulyssesd[tensorboard]'"),
             "wandb": ("wandb", "pip install wandb")}
    problems = []
    for block, (module, how) in needs.items():
        sec = ds_config.get(block)
        if isinstance(sec, dict) and sec.get("enabled") and importlib.util.find_spec(module) is None:
            problems.append(f"the DeepSpeed {block} monitor is enabled (scalars or the ds_config {block} block) "
                            f"but the {module} package is not installed: {how}")
    if problems:
        raise SpecError("scalars", problems)


def step_scalars(loss: float, rec: dict[str, Any], host_rss_gib: float | None) -> dict[str, float]:
    """Scalar name -> value from a telemetry step record's fields; absent (None) fields are left out."""
    names = ("grad_norm", "lr", "loss_scale", "tokens_per_s", "mfu", "step_time_s", "mem_allocated_gib",
             "mem_max_allocated_gib", "mem_reserved_gib")
    out = {"loss": float(loss)}
    out.update({n: float(rec[n]) for n in names if rec.get(n) is not None})
    if host_rss_gib is not None:
        out["host_rss_gib"] = float(host_rss_gib)
    return out


class ScalarWriter:
    """Writes step scalars to `monitor.write_events` on rank 0; a no-op elsewhere or without a monitor.

    `for_engine` also routes DeepSpeed's own monitor writes (lr, loss scale, timers, from inside
    `engine.step()`) through the same guard: unguarded, a failing CSV/TensorBoard/W&B write raises out of
    the step on rank 0 and the other ranks die in the next collective."""

    def __init__(self, write_events: Callable[[list[tuple[str, float, int]]], Any] | None, rank: int):
        self._sink = write_events if rank == 0 else None
        self._failures = 0
        self._logged = False

    @classmethod
    def for_engine(cls, engine: Any, rank: int) -> ScalarWriter:
        monitor = getattr(engine, "monitor", None)
        if monitor is None or not getattr(monitor, "enabled", False):
            return cls(None, rank)
        writer = cls(monitor.write_events, rank)
        if rank == 0:
            monitor.write_events = writer.guarded_write  # the instance attribute shadows the method
        return writer

    @property
    def active(self) -> bool:
        return self._sink is not None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self._sink is None:
            return
        # NaN/inf are written as they are: a NaN loss is exactly what the curve must show.
        self.guarded_write([(TAG_PREFIX + name, value, step) for name, value in scalars.items()])

    def guarded_write(self, events: list[tuple[str, float, int]]) -> None:
        """One monitor write that never raises: the first failure is logged, after
        MAX_CONSECUTIVE_FAILURES in a row the monitor is dropped for the rest of the attempt."""
        if self._sink is None:
            return
        try:
            self._sink(events)
        except Exception as exc:  # a monitor failure must never stop training
            self._failures += 1
            if not self._logged:
                self._logged = True
                log.warning("scalars: a write to the DeepSpeed monitor failed (%s: %s); training goes on, further "
                            "failures are not logged", type(exc).__name__, exc)
            if self._failures >= MAX_CONSECUTIVE_FAILURES:
                self._sink = None
                log.warning("scalars: %d writes in a row failed; no more monitor writes this attempt",
                            self._failures)
        else:
            self._failures = 0


def drop_unwritable_monitors(ds_config: dict[str, Any]) -> list[str]:
    """Rank 0, before deepspeed.initialize: create each enabled file monitor's directory; a block whose
    directory cannot be created is dropped (one warning each) so the engine builds and training runs."""
    warnings = []
    for block in ("tensorboard", "csv_monitor"):
        sec = ds_config.get(block)
        if not (isinstance(sec, dict) and sec.get("enabled") and sec.get("output_path")):
            continue
        path = os.path.join(sec["output_path"], sec.get("job_name") or "")
        try:
            os.makedirs(path, exist_ok=True)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in a user's own monitor block's path
            ds_config.pop(block)
            warnings.append(f"scalars: the {block} monitor is off for this attempt: cannot create {path} ({exc})")
    return warnings
