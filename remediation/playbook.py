"""The remediation ladders (docs/REMEDIATION.md, "The ladders as specified") as data: ordered, bounded actions per symptom.

Each `Action` has a precondition + bound check (`build`) that either returns a `Proposal` (config patch over
dotted JobSpec keys, how to apply it, hot control values) or a string saying why it does not apply (already at
its bound, not applicable); the engine then moves on to the next rung. The engine owns the state (position,
verification, budgets); this module only knows the ladders and their bounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.job import ZERO3_DEFAULTS

Apply = Literal["hot", "restart_latest", "rollback_skip", "stop", "none"]
APPLIES = ("hot", "restart_latest", "rollback_skip", "stop", "none")
RESTARTING = ("restart_latest", "rollback_skip")
# Symptoms that implicate the weights: a tag saved during one is suspect, and its ladders roll back.
WEIGHT_SYMPTOMS = frozenset({"loss_spike", "loss_oscillation", "nan_loss", "overflow_storm"})

ZERO = "deepspeed.config.zero_optimization."
K_CLIP = "train.gradient_clipping"
K_LR = "train.lr"
K_MIN_LR = "train.min_lr"
K_FP32 = "precision.fp32_layers"
K_LAYERS = "model.num_layers"
K_MB = "train.micro_batch_size"
K_GA = "train.gradient_accumulation_steps"
K_ACKPT = "train.activation_checkpoint_every"
K_DTYPE = "precision.dtype"
K_SKIP = "data.skip_ranges"
K_PERSIST = ZERO + "stage3_param_persistence_threshold"
K_LIVE = ZERO + "stage3_max_live_parameters"
K_PREFETCH = ZERO + "stage3_prefetch_bucket_size"
K_REDUCE = ZERO + "reduce_bucket_size"
K_OFFLOAD = ZERO + "offload_optimizer.device"
K_ALLOC = "launcher.env.PYTORCH_CUDA_ALLOC_CONF"

# Values in effect when the spec does not set them (the ZeRO keys: DeepSpeed's own defaults, one owner).
DEFAULTS: dict[str, Any] = {
    K_CLIP: 1.0, K_LR: 3e-4, K_FP32: 0, K_LAYERS: 4, K_MB: 1, K_GA: 1, K_ACKPT: 0, K_DTYPE: "bf16",
    K_SKIP: [], K_OFFLOAD: "none", K_ALLOC: None, **{ZERO + key: value for key, value in ZERO3_DEFAULTS.items()},
}


@dataclass
class RollbackPlan:
    """Where a rollback goes and which data it skips (computed by the engine from its known-good tags)."""

    to_step: int
    tag: str | None
    skip_ranges: list[tuple[int, int]]
    skip_steps: tuple[int, int]
    estimated: bool
    note: str = ""   # why the target is older than the onset suggests (a resumed checkpoint found suspect)
    onset: int | None = None   # the onset step the target precedes (tags saved at or after it are tainted)


@dataclass
class Context:
    values: dict[str, Any]        # effective values now (dotted keys)
    initial: dict[str, Any]       # values when the run started (bounds are relative to these)
    launched: dict[str, Any]      # values the running attempt was launched with (lr_scale is relative to these)
    policy: RemediationConfig
    rollback: RollbackPlan | None = None
    evidence: dict[str, Any] = field(default_factory=dict)   # the triggering finding's evidence
    skip_unreached: str = ""   # why a rollback's data skip cannot reach the job ("": it does)

    def get(self, key: str) -> Any:
        v = self.values.get(key)
        return DEFAULTS.get(key) if v is None else v


@dataclass
class Proposal:
    patch: dict[str, Any] = field(default_factory=dict)
    hot_control: dict[str, Any] = field(default_factory=dict)
    what: str = ""
    apply: Apply | None = None    # overrides the action's default
    rollback: RollbackPlan | None = None


Build = Callable[[Context], "Proposal | str"]


@dataclass(frozen=True)
class Action:
    kind: str
    apply: Apply
    build: Build
    repeat: str | int = 1   # how often this rung may be used in a row: an int or a RemediationConfig field name
    procedure: tuple[str, ...] = ()

    def max_uses(self, policy: RemediationConfig) -> int:
        return self.repeat if isinstance(self.repeat, int) else int(getattr(policy, self.repeat))


# ------------------------------------------------------------------------------------------ memory
def _persistence(c: Context) -> Proposal | str:
    cur, floor = float(c.get(K_PERSIST)), c.policy.persistence_threshold_min
    if cur >= floor:
        return f"stage3_param_persistence_threshold is already {cur:g} (>= {floor:g})"
    return Proposal({K_PERSIST: int(floor)}, what=f"stage3_param_persistence_threshold {cur:g} -> {floor:g}")


def _expandable(c: Context) -> Proposal | str:
    cur = c.get(K_ALLOC) or ""
    if "expandable_segments:True" in cur:
        return "PYTORCH_CUDA_ALLOC_CONF already has expandable_segments:True"
    new = f"{cur},expandable_segments:True" if cur else "expandable_segments:True"
    return Proposal({K_ALLOC: new}, what=f"PYTORCH_CUDA_ALLOC_CONF={new}")


def _halve_live(c: Context) -> Proposal | str:
    live, pre = float(c.get(K_LIVE)), float(c.get(K_PREFETCH))
    new_live = max(c.policy.max_live_parameters_floor, live / 2)
    new_pre = max(c.policy.prefetch_bucket_floor, pre / 2)
    patch: dict[str, Any] = {}
    if new_live < live:
        patch[K_LIVE] = int(new_live)
    if new_pre < pre:
        patch[K_PREFETCH] = int(new_pre)
    if not patch:
        return "stage3_max_live_parameters and stage3_prefetch_bucket_size are at their floors"
    return Proposal(patch, what=f"stage3_max_live_parameters {live:g} -> {new_live:g}, "
                                f"stage3_prefetch_bucket_size {pre:g} -> {new_pre:g}")


def _halve_micro_batch(c: Context) -> Proposal | str:
    mb, ga = int(c.get(K_MB)), int(c.get(K_GA))
    if mb <= 1:
        return "micro-batch is already 1"
    # Keep the global batch: mb × ga stays constant (odd micro-batches go to 1).
    new_mb = mb // 2 if mb % 2 == 0 else 1
    new_ga = ga * mb // new_mb
    return Proposal({K_MB: new_mb, K_GA: new_ga},
                    what=f"micro-batch {mb} -> {new_mb}, gradient accumulation {ga} -> {new_ga} (global batch unchanged)")


def _ckpt_every_layer(c: Context) -> Proposal | str:
    cur = int(c.get(K_ACKPT))
    if cur == 1:
        return "activation checkpointing is already on every layer"
    return Proposal({K_ACKPT: 1}, what=f"activation checkpointing every {cur or 'no'} layer(s) -> every layer")


def _offload_optimizer(c: Context) -> Proposal | str:
    cur = c.get(K_OFFLOAD)
    if cur == "cpu":
        return "optimizer is already offloaded to CPU"
    return Proposal({K_OFFLOAD: "cpu"}, what="offload the optimizer state to CPU")


def _offload_off(c: Context) -> Proposal | str:
    cur = c.get(K_OFFLOAD)
    if cur in (None, "none"):
        return "optimizer is not offloaded to host memory"
    return Proposal({K_OFFLOAD: "none"}, what=f"stop offloading the optimizer to {cur} (host memory)")


# -------------------------------------------------------------------------------------------- loss
def _clip(c: Context) -> Proposal | str:
    cur, floor = float(c.get(K_CLIP)), c.policy.clip_floor
    if cur == 0 or cur > 1.0:
        new = 1.0
    else:
        new = max(floor, round(cur * 0.5, 6))
    if cur != 0 and new >= cur:
        return f"gradient clipping {cur:g} is at its floor {floor:g}"
    return Proposal({K_CLIP: new}, {"gradient_clipping": new}, what=f"gradient clipping {cur:g} -> {new:g}")


def _fp32_layers(c: Context) -> Proposal | str:
    cur, total = int(c.get(K_FP32)), int(c.get(K_LAYERS))
    target = min(c.policy.fp32_layers, total)
    if cur >= target:
        return f"precision.fp32_layers is already {cur} (target {target}, model has {total} layers)"
    return Proposal({K_FP32: target}, what=f"fp32 compute for the first {target} of {total} layers (was {cur})")


def _lr_down(c: Context) -> Proposal | str:
    cur = float(c.get(K_LR))
    initial = float(c.initial.get(K_LR) or cur)
    floor = c.policy.lr_floor_frac * initial
    new = max(floor, cur * (1 - c.policy.lr_step_frac))
    if new >= cur * (1 - 1e-9):
        return f"learning rate {cur:g} is at its floor {floor:g} ({c.policy.lr_floor_frac:g} x initial {initial:g})"
    launched = float(c.launched.get(K_LR) or initial)
    patch: dict[str, Any] = {K_LR: new}
    what = f"learning rate {cur:g} -> {new:g}"
    min_lr = c.values.get(K_MIN_LR)
    if min_lr is not None and float(min_lr) > 0:
        # The schedule keeps its shape: min_lr comes down by the same factor (lr = min_lr, a constant
        # schedule, would otherwise give a config with min_lr above lr that the job refuses).
        new_min = float(min_lr) * new / cur
        patch[K_MIN_LR] = new_min
        what += f", min_lr {float(min_lr):g} -> {new_min:g}"
    return Proposal(patch, {"lr_scale": new / launched}, what=what)


def _rollback_skip(c: Context) -> Proposal | str:
    plan = c.rollback
    if plan is None:
        return "no rollback target"
    old = [(int(a), int(b)) for a, b in (c.get(K_SKIP) or [])]
    new = merge_ranges(old + list(plan.skip_ranges))
    where = plan.tag or f"step {plan.to_step} (no known-good checkpoint: from scratch)"
    note = f" ({plan.note})" if plan.note else ""
    if c.skip_unreached:   # the rollback applies; its data skip would be a claim the job never gets
        return Proposal(rollback=plan, what=f"roll back to {where}{note}, without a data skip ({c.skip_unreached})")
    return Proposal({K_SKIP: new}, rollback=plan,
                    what=f"roll back to {where}{note} and skip the batches of steps {plan.skip_steps[0]}-"
                         f"{plan.skip_steps[1] - 1} (samples {plan.skip_ranges})")


def _bf16(c: Context) -> Proposal | str:
    if c.get(K_DTYPE) != "fp16":
        return f"precision is {c.get(K_DTYPE)}, not fp16"
    if not c.policy.bf16_supported:
        return "the hardware has no bf16 (remediation.bf16_supported=false)"
    return Proposal({K_DTYPE: "bf16"}, what="precision fp16 -> bf16")


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping half-open ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# ---------------------------------------------------------------------------------------- slow/misc
# All ranks equally slow (spread below this) points at communication, not at one bad rank.
COMM_BOUND_MAX_SPREAD = 1.25

def _evidence(c: Context) -> Proposal | str:
    return Proposal(what="collect evidence: per-rank step times, GPU util/clocks/Xid, CPU hogs")


def _reduce_bucket(c: Context) -> Proposal | str:
    if c.evidence.get("detector") == "cusum":   # the drift detector: evidence and an alert only
        return "a few-percent step-time drift is not worth a restart"
    spread = c.evidence.get("rank_spread")
    if spread is not None and spread >= COMM_BOUND_MAX_SPREAD:
        return f"one rank is {spread:.2f}x slower than rank 0: not comm-bound"
    cur, ceiling = float(c.get(K_REDUCE)), c.policy.reduce_bucket_ceiling
    if cur >= ceiling:
        return f"reduce_bucket_size {cur:g} is already at/above its ceiling {ceiling:g}"
    new = min(ceiling, cur * 2)
    return Proposal({K_REDUCE: int(new)}, what=f"reduce_bucket_size {cur:g} -> {new:g} (comm-bound)")


def _alert(c: Context) -> Proposal | str:
    return Proposal(what="record and alert the operator (no automatic fix left)")


def _restart(c: Context) -> Proposal | str:
    return Proposal(what="restart from the latest valid checkpoint")


def _stop(c: Context) -> Proposal | str:
    return Proposal(what="stop the run and alert (keep everything)")


STOP = Action("stop_alert", "stop", _stop)
ROLLBACK = Action("rollback_skip", "rollback_skip", _rollback_skip, repeat="max_rollbacks")

LADDERS: dict[str, tuple[Action, ...]] = {
    # Specified: memory spike or CUDA OOM.
    "memory": (
        Action("raise_persistence_threshold", "restart_latest", _persistence),
        Action("expandable_segments", "restart_latest", _expandable),
        Action("halve_live_parameters", "restart_latest", _halve_live),
        Action("halve_micro_batch", "restart_latest", _halve_micro_batch),
        Action("checkpoint_every_layer", "restart_latest", _ckpt_every_layer),
        Action("offload_optimizer", "restart_latest", _offload_optimizer),
        STOP,
    ),
    # Host OOM killer: shrink what lives in host RAM.
    "host_memory": (
        Action("halve_micro_batch", "restart_latest", _halve_micro_batch),
        Action("optimizer_offload_off", "restart_latest", _offload_off),
        # Nothing left to shrink: the pressure may have been transient (another tenant, a page-cache
        # spike), so restart within the crash budget before giving up.
        Action("restart", "restart_latest", _restart, repeat="max_crash_restarts"),
        STOP,
    ),
    # Specified: loss oscillation / spike (and fp16 overflow storms).
    "loss": (
        Action("lower_clip", "hot", _clip),
        Action("fp32_layers", "restart_latest", _fp32_layers),
        Action("lower_lr", "hot", _lr_down),
        ROLLBACK,
        STOP,
    ),
    # Specified: NaN/Inf loss, loss scale at minimum: roll back + skip, then the loss ladder, then bf16.
    "nan": (
        Action("rollback_skip", "rollback_skip", _rollback_skip),  # once, then the loss ladder

        Action("lower_clip", "rollback_skip", _clip),
        Action("fp32_layers", "rollback_skip", _fp32_layers),
        Action("lower_lr", "rollback_skip", _lr_down),
        ROLLBACK,
        Action("fp16_to_bf16", "rollback_skip", _bf16),
        STOP,
    ),
    # Specified: slow steps: evidence first, comm-bound → bigger reduce buckets, then alert.
    "slow": (
        Action("collect_evidence", "none", _evidence),
        Action("raise_reduce_bucket", "restart_latest", _reduce_bucket),
        Action("alert", "none", _alert),
    ),
    # A persistently slow rank: evidence, then record + alert (restart without it needs a spare node).
    "straggler": (
        Action("collect_evidence", "none", _evidence),
        Action("alert", "none", _alert),
    ),
    # Specified: hang: stacks → SIGTERM → SIGKILL → restart from latest valid.
    "hang": (
        Action("hang_restart", "restart_latest", _restart, repeat="max_crash_restarts",
               procedure=("dump_stacks", "sigterm", "sigkill", "restart_latest")),
        STOP,
    ),
    "nccl": (Action("restart", "restart_latest", _restart, repeat="max_crash_restarts"), STOP),
    "gpu_hardware": (STOP,),
    # The daemon prunes (daemon/host/disk.py) before the restart. Repeatable: on a multi-day run the disk may
    # fill again days later; `max_crash_restarts` full disks in a row (no verified window between) stop.
    "disk": (Action("prune_and_restart", "restart_latest",
                    lambda c: Proposal(what="prune old checkpoints (keep known-good and newest) and restart"),
                    repeat="max_crash_restarts"),
             STOP),
    "checkpoint": (Action("fall_back_checkpoint", "restart_latest",
                          lambda c: Proposal(what="quarantine the corrupt tag and restart from the previous valid one"),
                          repeat="max_crash_restarts"), STOP),
    "restart": (Action("restart", "restart_latest", _restart, repeat="max_crash_restarts"), STOP),
    # The job refused its configuration: the same config fails the same way; stop with the problem lines.
    "config": (STOP,),
}

# Ladders that end by alerting rather than stopping: once exhausted they go quiet.
NON_FATAL = ("slow", "straggler")

SYMPTOM_LADDER: dict[str, str] = {
    "memory_spike": "memory", "loss_spike": "loss", "loss_oscillation": "loss", "overflow_storm": "loss",
    "nan_loss": "nan", "slow_step": "slow", "throughput_drop": "slow", "straggler": "straggler", "hang": "hang",
}

# Crash diagnosis label (the fixed set of docs/DIAGNOSIS.md) → (ladder, store symptom).
CRASH_LADDER: dict[str, tuple[str, str]] = {
    "cuda_oom": ("memory", "cuda_oom"),
    "host_oom_killed": ("host_memory", "crash"),
    "nccl_timeout": ("nccl", "crash"),
    "nccl_error": ("nccl", "crash"),
    "gpu_hardware": ("gpu_hardware", "crash"),
    "illegal_memory_access": ("restart", "crash"),
    "disk_full": ("disk", "disk_full"),
    "checkpoint_corrupt": ("checkpoint", "checkpoint_corrupt"),
    "nan_loss": ("nan", "nan_loss"),
    "loss_scale_min": ("nan", "nan_loss"),
    "loss_scale_overflow": ("loss", "crash"),
    "segfault": ("restart", "crash"),
    "launcher_error": ("restart", "launch_failure"),
    "dataloader_crash": ("restart", "crash"),
    # Terminated from outside (the daemon stops at once when the scheduler is the sender, daemon/core/exits.py).
    "killed": ("restart", "crash"),
    "config_rejected": ("config", "crash"),
    "python_exception": ("restart", "crash"),
    "healthy": ("restart", "crash"),
}


def ladder_for_crash(label: str) -> tuple[str, str]:
    """Unknown labels restart within the budget."""
    return CRASH_LADDER.get(label, ("restart", "crash"))
