"""The training job: ZeRO-3 + Ulysses GPT, checkpoints, telemetry, live control, signals, faults.

One `Trainer` per rank. Everything that several ranks must agree on (control updates, the resume tag,
whether to stop) is decided on rank 0 or gathered in one collective, then acted on by all ranks at the
same point of the loop, so no rank ever waits in a collective the others skipped.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint.digests import DIGEST_MODE_ENV, digest_mode
from .control import ControlPoller, engine_clip, set_engine_clip
from .data.batches import DataCursor, SampleSource, slice_for_sp
from .data.loader import PrefetchLoader
from .ds_config import build_ds_config
from .faults import FaultInjector
from .model.gpt import GPT
from .planner.inputs import GPU_MEMORY_CAP_ENV
from .recovery.exit_guard import ExitSaveGuard
from .recovery.in_process import InProcessRecovery, StepDropped
from .recovery.save_gate import DeferredSaves
from .scalars import ScalarWriter, check_monitor_dependencies, drop_unwritable_monitors, mfu, step_scalars
from .spec import JobSpec, SpecError
from .startup import STARTUP, init_process_group
from .telemetry import NvrxHeartbeat, TelemetryWriter, gather_step_stats, loss_by_source, memory_gib
from .train_checkpoints import EXIT_SAVE_FAILED, CheckpointLoadError, CheckpointSaveError, TrainerCheckpoints

log = logging.getLogger("ulyssesd.training")

# Test/debug hook: directory where rank 0 writes the full fp32 gradients of step 1 (grads-step1.pt).
DUMP_GRADS_ENV = "ULYSSESD_DEBUG_DUMP_GRADS"
# Performance debug hook: profile this step (torch.profiler); each rank writes {run_dir}/profile-rank{R}.txt.
PROFILE_STEP_ENV = "ULYSSESD_PROFILE_STEP"


def lr_at(step: int, spec: JobSpec) -> float:
    """Scheduled LR of 1-based `step`: linear warm-up, then cosine decay to min_lr at train.steps."""
    tr = spec.train
    if tr.warmup_steps and step <= tr.warmup_steps:
        return tr.lr * step / tr.warmup_steps
    span = max(1, tr.steps - tr.warmup_steps)
    progress = min(1.0, (step - tr.warmup_steps) / span)
    return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1.0 + math.cos(math.pi * progress))


def cap_gpu_memory(local: int) -> float | None:
    """With ULYSSESD_GPU_MEMORY_CAP_GIB=G set, the caching allocator refuses to hold more than G GiB on this
    device (`torch.cuda.set_per_process_memory_fraction`); an allocation past it raises the usual CUDA OOM.
    Returns the fraction set, None when the variable is unset."""
    raw = os.environ.get(GPU_MEMORY_CAP_ENV)
    if not raw:
        return None
    try:
        cap = float(raw)
    except ValueError:
        raise RuntimeError(f"{GPU_MEMORY_CAP_ENV}={raw!r} is not a number of GiB") from None
    total = torch.cuda.get_device_properties(local).total_memory / 2**30
    if not 0 < cap <= total:
        raise RuntimeError(f"{GPU_MEMORY_CAP_ENV}={raw} must be in (0, {total:.1f}] GiB (this GPU's memory)")
    torch.cuda.set_per_process_memory_fraction(cap / total, local)
    log.warning("GPU memory capped at %.1f of %.1f GiB (%s)", cap, total, GPU_MEMORY_CAP_ENV)
    return cap / total


def pick_device(spec: JobSpec) -> torch.device:
    want = spec.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device='cuda' but torch sees no CUDA device")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        cap_gpu_memory(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # No decay on norms, biases and embeddings (standard GPT practice).
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.startswith("embed.") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class Trainer(InProcessRecovery, DeferredSaves, TrainerCheckpoints):
    def __init__(self, spec: JobSpec, run_dir: Path, attempt: int, config_version: int | None):
        self.spec, self.run_dir, self.attempt, self.config_version = spec, run_dir, attempt, config_version
        self.stop_signal = False
        self.last_loss: float | None = None
        self.step = 0
        self.exit_guard = ExitSaveGuard()   # no exit save after a non-finite step (recovery/exit_guard.py)

    # ---------------------------------------------------------------------------- setup
    def _init_distributed(self) -> None:
        init_process_group(self.device.type == "cuda")  # a standby's was made before its gate: a no-op then
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        sp = self.spec.parallel.sequence_parallel_size
        if self.world % sp:
            raise SpecError("launcher", [f"world size {self.world} is not divisible by "
                                         f"parallel.sequence_parallel_size={sp}"])
        if self.spec.parallel.world_size is not None and self.spec.parallel.world_size != self.world:
            raise SpecError("launcher", [f"parallel.world_size={self.spec.parallel.world_size} but the launcher "
                                         f"started {self.world} ranks"])
        self.sp, self.dp = sp, self.world // sp
        # parallel_state_sp puts consecutive ranks in one SP group.
        self.sp_rank, self.dp_rank = self.rank % sp, self.rank // sp
        self.mpu, self.sp_group = None, None
        if sp > 1:
            from deepspeed.runtime.sequence_parallel import parallel_state_sp

            parallel_state_sp.initialize_sequence_parallel(sp)
            self.mpu = parallel_state_sp
            self.sp_group = parallel_state_sp.get_sequence_parallel_group()
        STARTUP.mark("process_group")

    def _build(self) -> None:
        import deepspeed

        from .model.attention import resolve_backend

        spec = self.spec
        self.ds_config, warnings = build_ds_config(spec, self.world, self.run_dir, self.attempt)
        check_monitor_dependencies(self.ds_config)  # same answer on every rank: all exit 2 together
        if self.rank == 0:
            warnings += drop_unwritable_monitors(self.ds_config)  # only rank 0 builds monitors
            for w in warnings:
                log.warning("ds_config: %s", w)
        try:
            backend = resolve_backend(spec.attention.backend, self.device)
        except ValueError as exc:
            raise SpecError("attention.backend", [str(exc)]) from None
        if spec.checkpoint.async_save:  # the async writer's digest switch: refused here, not at the first save
            try:
                digest_mode()
            except ValueError as exc:
                raise SpecError(DIGEST_MODE_ENV, [str(exc)]) from None
        if spec.precision.dtype == "fp16" and self.device.type == "cpu":
            from deepspeed.accelerator import get_accelerator

            if not get_accelerator().is_fp16_supported():
                raise SpecError("precision.dtype", ["precision.dtype='fp16' is not supported by this CPU "
                                                    "(DeepSpeed's CPU accelerator needs mkldnn fp16); use bf16 or fp32"])
        # Same seed on every rank: identical initial weights whatever the partitioning.
        random.seed(spec.train.seed)
        np.random.seed(spec.train.seed % (1 << 32))
        torch.manual_seed(spec.train.seed)
        with deepspeed.zero.Init(config_dict_or_path=self.ds_config, mpu=self.mpu):
            model = GPT(spec.resolved_model(), backend, self.sp_group, self.sp,
                        fp32_layers=spec.precision.fp32_layers,
                        fp32_mode=spec.precision.fp32_mode,
                        checkpoint_every=spec.train.activation_checkpoint_every,
                        checkpoint_layers=spec.train.activation_checkpoint_layers,
                        loss_chunk_tokens=spec.train.loss_chunk_tokens)
        STARTUP.mark("model_built")  # under zero.Init: built and partitioned
        if spec.train.zero3_leaf_blocks:
            # Must precede deepspeed.initialize, which installs the ZeRO-3 module hooks.
            from deepspeed.utils import set_z3_leaf_modules

            from .model.gpt import Block

            set_z3_leaf_modules(model, [Block])
        self.engine, _, _, _ = deepspeed.initialize(model=model,
                                                    model_parameters=_param_groups(model, spec.train.weight_decay),
                                                    config=self.ds_config, mpu=self.mpu)
        STARTUP.mark("deepspeed_initialized")
        self.scalars = ScalarWriter.for_engine(self.engine, self.rank)
        if spec.train.compile and self.device.type == "cuda":
            self.engine.compile()
        m = spec.resolved_model()
        self.source = SampleSource(spec.data, spec.train.seq_len, m.vocab_size, spec.train.seed)
        self.cursor = DataCursor(0, list(spec.data.skip_ranges))
        self.loader: PrefetchLoader | None = None  # started at the first step, after a resume moved the cursor
        # Multi-source data (the synthetic families, a blend): the loss is also reported per source, so the
        # daemon judges each step against its own source's level (docs/CONTRACTS.md `loss_by_source`).
        self.source_names = self.source.source_names
        model.track_sample_loss = self.source_names is not None

    # --------------------------------------------------------------------------- telemetry
    def _event(self, name: str, **fields: Any) -> None:
        self.tele.event(name, self.step, **fields)

    def _fault_event(self, kind: str, step: int | None, **fields: Any) -> None:
        self.tele.event("fault_injected", step, fault=kind, **fields)

    # ------------------------------------------------------------------------------- control
    def _set_lr(self, step: int) -> float:
        faults = getattr(self, "faults", None)  # made in _run (it needs the device); absent in a piecewise Trainer
        fault = faults.lr_factor(step) if faults is not None else 1.0
        lr = lr_at(step, self.spec) * self.control.state.lr_scale * fault
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _poll_control(self) -> None:
        update = self.control.poll()
        if update is None:
            return
        st = self.control.state
        if "gradient_clipping" in update:
            # parse_control drops null fields, so a present key always carries a number.
            assert st.gradient_clipping is not None
            set_engine_clip(self.engine, st.gradient_clipping)
        if update.get("dump_stacks"):
            faulthandler.dump_traceback(all_threads=True)
        self._event("control_applied", control_version=st.version, lr_scale=st.lr_scale,
                    gradient_clipping=engine_clip(self.engine), suspect=st.suspect)

    def _on_sigterm(self, signum, frame) -> None:
        # Only set a flag: the step in flight finishes, then all ranks agree through the step gather.
        self.stop_signal = True

    # ----------------------------------------------------------------------------------- run
    def run(self) -> int:
        self.device = pick_device(self.spec)
        self._init_distributed()
        tele_path = self.spec.telemetry.path or self.run_dir / "telemetry.jsonl"
        self.tele = TelemetryWriter(tele_path, self.attempt, self.config_version, enabled=self.rank == 0)
        try:
            return self._run()
        except CheckpointSaveError as exc:
            # Not a crash: the previous tags are intact and the daemon knows the errno (prune, or stop).
            try:
                self._event("exiting", reason="checkpoint_save_failed", error=str(exc)[:500])
            except OSError:
                pass
            return EXIT_SAVE_FAILED
        except (SpecError, CheckpointLoadError) as exc:
            # Refusals (exit 2 / 3), said before exiting: a rank may still die by SIGABRT in the process
            # group's teardown, and the launcher then reports a signal instead of the exit code.
            self._event("exiting", reason="config_rejected" if isinstance(exc, SpecError) else "no_checkpoint",
                        error=f"{type(exc).__name__}: {exc}"[:500],
                        problems=list(exc.problems)[:40] if isinstance(exc, SpecError) else [str(exc)[:500]])
            raise
        except BaseException as exc:
            self._event("exiting", reason="error", error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            self.tele.close()
            if getattr(self, "nvrx", None) is not None:
                self.nvrx.close()

    def _run(self) -> int:
        spec = self.spec
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.faults = FaultInjector(spec.faults, self.rank, int(os.environ.get("LOCAL_RANK", "0")),
                                    self.attempt, spec.train.seed, self.device, self._fault_event)
        self.faults.at_start()
        chosen = self._start_choosing_tag()  # rank 0 hashes the resume tag in a thread while the model is built
        self._build()
        tag = self._prefer_shm_copy(self._agree_on_tag(chosen))   # a host snapshot newer than the disk's
        STARTUP.mark("tag_agreed")  # rank 0 chose and verified it; every rank knows it
        self.control = ControlPoller(self.run_dir / "control.json", self.rank, self.world)
        resumed_from, load_s = self._resume(tag)
        if resumed_from:
            STARTUP.mark("checkpoint_loaded")
            self._event("checkpoint_loaded", tag=resumed_from, seconds=round(load_s, 3))
        # `startup`: when each start-up phase ended, in seconds since this rank's process started (startup.py)
        self._event("started", world_size=self.world, sp=self.sp, dp=self.dp, config_version=self.config_version,
                    resumed_from=resumed_from, start_step=self.step, samples_seen=self.cursor.next_sample,
                    device=str(self.device), dtype=spec.precision.dtype, startup=STARTUP.fields(),
                    restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0))  # an inner launcher's
        self.nvrx = NvrxHeartbeat()  # under NVRx's ft_launcher: its rank monitor's heartbeat (else nothing)
        tr = spec.train
        tokens_per_step = tr.micro_batch_size * tr.gradient_accumulation_steps * self.dp * tr.seq_len
        saved_at = self.step if resumed_from else -1
        while self.step < tr.steps:
            self._poll_control()
            step = self.step + 1
            try:
                stop = self._train_step(step, tokens_per_step)
            except StepDropped as drop:   # every rank: restore the host tier, or raise (the usual path)
                self._restart_in_process(drop)
                continue
            except Exception as exc:   # after the step's collectives began: rebuild the group, or raise
                self._recover_mid_step(step, exc)
                continue
            self.step = step
            self.nvrx.beat()
            self.poll_saves()  # an async save whose manifest is durable is reported now, not at the next save
            disk_due = step % spec.checkpoint.interval_steps == 0 or (step == tr.steps and spec.checkpoint.save_at_end)
            if self._memory_snapshot_due(step, disk_due):
                self._memory_snapshot(disk_due)   # the host tier first; the disk copy is written behind it
            refused = self._exit_save_refused() if stop else None
            if refused is None and self._save_now(step, disk_due, final=step == tr.steps or stop):  # may defer
                self._save()
                saved_at = step
            if stop:
                if refused is not None:
                    log.warning("SIGTERM: exiting WITHOUT saving: %s", refused)
                elif saved_at != step:
                    self._save()
                self.finish_saves()  # an async save is durable (or its failure agreed on) before exiting
                self._clean_shm()
                self._event("exiting", reason="sigterm", saved=refused is None,
                            **({"not_saved": refused} if refused else {}))
                return 0
        if saved_at != self.step and spec.checkpoint.save_at_end:
            self._save()
        self.finish_saves()
        self._clean_shm()
        self._event("exiting", reason="completed")
        return 0

    def _train_step(self, step: int, tokens_per_step: int) -> bool:
        if os.environ.get(PROFILE_STEP_ENV) == str(step):
            return self._profiled_step(step, tokens_per_step)
        return self._train_step_inner(step, tokens_per_step)

    def _profiled_step(self, step: int, tokens_per_step: int) -> bool:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            stop = self._train_step_inner(step, tokens_per_step)
        ka = prof.key_averages()
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        text = (ka.table(sort_by=sort, row_limit=45, max_name_column_width=70)
                + "\n\n" + ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
        (self.run_dir / f"profile-rank{self.rank}.txt").write_text(text)
        return stop

    def _train_step_inner(self, step: int, tokens_per_step: int) -> bool:
        tr, eng = self.spec.train, self.engine
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        failed: BaseException | None = None   # a failure before the step's first collective (in-process restart)
        try:
            self.faults.before_step(step)
        except Exception as exc:
            failed = self._start_failure(exc)
        t0 = time.perf_counter()
        batches = None
        if failed is None:
            try:
                batches = self._next_batches()
            except Exception as exc:
                failed = self._start_failure(exc)
        if self._in_process_on():
            self._agree_step_start(step, failed, None if batches is None else batches.samples)
        assert batches is not None
        samples, self._data_wait_s = batches.samples, batches.wait_s
        lr = self._set_lr(step)
        factor = self.faults.loss_factor(step)
        losses = []
        names = self.source_names
        # Per source: [sum of token losses, labelled tokens] over this rank's micro-batches.
        # On the device: no sync per micro-step (read once, after the step's own synchronize).
        by_source = torch.zeros(2, len(names), dtype=torch.float32, device=self.device) if names is not None else None
        self._logit_max: Any = None   # this rank's largest |logit| over the step's micro-batches (on the device)
        for micro, host_tokens in enumerate(batches.micro):
            tokens = host_tokens.to(self.device, non_blocking=True)
            inputs, labels, positions = slice_for_sp(tokens, self.sp_rank, self.sp)
            loss = eng(inputs, positions, labels)
            if micro == 0:
                self.faults.mid_step(step)
            if factor != 1.0:
                loss = loss * factor
            eng.backward(loss)
            losses.append(loss.detach().float())
            lm = getattr(eng.module, "logit_max", None)
            if lm is not None:
                self._logit_max = lm if self._logit_max is None else torch.maximum(self._logit_max, lm)
            sample_loss = getattr(eng.module, "last_sample_loss", None)
            if by_source is not None and batches.sources is not None and sample_loss is not None:
                ids = torch.tensor(batches.sources[micro], dtype=torch.long).to(self.device, non_blocking=True)
                by_source[0].index_add_(0, ids, sample_loss[0].float() * factor)
                by_source[1].index_add_(0, ids, sample_loss[1].float())
            # DeepSpeed counts micro-steps inside step(): it must be called after every backward and only
            # applies the optimizer at the accumulation boundary (the final call below).
            if micro < len(batches.micro) - 1:
                eng.step()
        if step == 1 and os.environ.get(DUMP_GRADS_ENV):
            self._dump_grads(Path(os.environ[DUMP_GRADS_ENV]))
        eng.step()
        local_loss = float(torch.stack(losses).mean())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time = time.perf_counter() - t0
        alloc, max_alloc, reserved = memory_gib(self.device, self.faults.extra_mem_gib)
        extra = by_source.flatten().tolist() if by_source is not None else None
        stats = gather_step_stats(local_loss, step_time, max_alloc, self.stop_signal, self.device, extra)
        self._check_loss(step, stats.loss, samples)   # a NaN drops the step when the host tier can serve it
        self.last_loss = stats.loss
        self._guard_exit_save(step, stats.loss)
        if step % tr.log_every == 0 or stats.stop_requested or step == tr.steps:
            self._record_step(step, stats, lr, step_time, tokens_per_step, samples, alloc, max_alloc, reserved)
        return stats.stop_requested

    def _guard_exit_save(self, step: int, loss: float) -> None:
        """A step that kept its update (not dropped by the host tier) with a non-finite loss or grad norm: no exit
        save from now on. Every rank sees the same gathered loss and global grad norm, so all agree."""
        if self.exit_guard.first_bad_step is not None:
            return
        gn = self.engine.get_global_grad_norm() if math.isfinite(loss) else None   # cached by the step: no collective
        fp16 = self.spec.precision.dtype == "fp16"
        self.exit_guard.observe(step, loss, None if gn is None else float(gn),
                                skipped=fp16 and not self.engine.was_step_applied())

    def _exit_save_refused(self) -> str | None:
        """Collective (every rank stops at the same step): why the exit save must not be written, else None. The
        daemon writes `suspect` before its SIGTERM; the job may have polled just before that write, so read again."""
        self._poll_control()
        if self.control.state.suspect:
            return "control suspect=true (the daemon is rolling back)"
        return self.exit_guard.refusal()

    def _start_failure(self, exc: Exception) -> Exception:
        if not self._in_process_on():
            raise exc
        return exc

    def _next_batches(self) -> Any:
        tr = self.spec.train
        if self.loader is None:
            self.loader = PrefetchLoader(self.source, self.cursor, self.dp_rank, self.dp, tr.micro_batch_size,
                                         tr.gradient_accumulation_steps, depth=self.spec.data.prefetch,
                                         pin_memory=self.device.type == "cuda")
        return self.loader.next(self.cursor)

    def _record_step(self, step, stats, lr, step_time, tokens, samples, alloc, max_alloc, reserved) -> None:
        eng = self.engine
        grad_norm = eng.get_global_grad_norm()
        fp16 = self.spec.precision.dtype == "fp16"
        rec: dict[str, Any] = dict(
            grad_norm=None if grad_norm is None else float(grad_norm), lr=lr,
            loss_scale=float(eng.optimizer.loss_scale) if fp16 else None,
            skipped=(not eng.was_step_applied()) if fp16 else False,
            step_time_s=round(step_time, 6), tokens=tokens,
            tokens_per_s=round(tokens / max(stats.step_time_max_s, 1e-9), 3),
            mem_allocated_gib=round(alloc, 4), mem_reserved_gib=round(reserved, 4),
            clip=engine_clip(eng), samples=list(samples), data_wait_s=round(self._data_wait_s, 6))
        if self.source_names is not None and stats.extra is not None:
            rec["loss_by_source"] = loss_by_source(self.source_names, stats.extra)
        if self._logit_max is not None:   # rank 0's (docs/CONTRACTS.md `logit_max`): read after the step's sync
            rec["logit_max"] = round(float(self._logit_max), 4)
        step_mfu = mfu(self.spec, self.world, tokens, stats.step_time_max_s)
        if step_mfu is not None:
            rec["mfu"] = round(step_mfu, 6)
        if self.spec.telemetry.gather_per_rank:
            rec.update(step_time_max_s=round(stats.step_time_max_s, 6), slowest_rank=stats.slowest_rank,
                       mem_max_allocated_gib=round(stats.mem_max_allocated_gib, 4), mem_max_rank=stats.mem_max_rank)
        else:
            rec.update(mem_max_allocated_gib=round(max_alloc, 4))
        self.tele.step(step, stats.loss, **rec)
        if self.scalars.active:
            import psutil

            host_rss_gib = psutil.Process().memory_info().rss / float(1 << 30)
            self.scalars.write(step, step_scalars(stats.loss, rec, host_rss_gib))
        if self.rank == 0:
            log.info("step %d loss %.6f lr %.3e grad_norm %s %.3fs", step, stats.loss, lr, rec["grad_norm"],
                     stats.step_time_max_s)

    def _dump_grads(self, out_dir: Path) -> None:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)  # collective under ZeRO-3: every rank calls it
            grads[name] = None if g is None else g.detach().float().cpu().clone()
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(grads, out_dir / "grads-step1.pt")
