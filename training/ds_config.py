"""Build the DeepSpeed config dict from a JobSpec (pure: no I/O except reading the user's base file).

Base = the user's ds_config.json (`deepspeed.config_path`) deep-merged with `deepspeed.config` (inline wins).
Then:
- Keys we own are written from the spec: batch sizes (a conflicting user value is an error naming both),
  optimizer (AdamW with `torch_adam`, so no C++ JIT build), precision sections, gradient clipping.
- Keys we do not support are dropped, each with one warning that says why.
- ZeRO keys placed at the top level (as in the seed's snippet) are moved into `zero_optimization`.
- Monitor sections (csv_monitor / tensorboard / wandb) pass through; relative output paths go under run_dir.
  `[scalars] tensorboard/csv` add the tensorboard / csv_monitor blocks (a block the user enabled wins).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .scalars import monitor_blocks
from .spec import JobSpec, SpecError

# key -> why we drop it
UNSUPPORTED_KEYS: dict[str, str] = {
    "sparse_attention": "Ulysses runs dense attention through DistributedAttention; DeepSpeed's block-sparse "
                        "kernels (Triton) are not wired into this model - the section is ignored",
    "sequence_parallel": "sequence parallelism is set by parallel.sequence_parallel_size in the run spec "
                         "(the config key alone creates no SP group)",
    "seq_parallel": "sequence parallelism is set by parallel.sequence_parallel_size in the run spec",
    "sequence_parallel_size": "use parallel.sequence_parallel_size in the run spec: the DeepSpeed key only "
                              "changes ZeRO sharding and creates no SP group (docs/DEEPSPEED_NOTES.md)",
    "enable_cuda_graph": "CUDA graphs do not work with ZeRO-3 parameter gathering",
    "scheduler": "the job computes warm-up + cosine LR itself from train.lr/min_lr/warmup_steps so live "
                 "lr_scale and resume stay exact",
    "activation_checkpointing": "use train.activation_checkpoint_every (torch non-reentrant checkpointing)",
    "pipeline": "pipeline parallelism is not supported (ZeRO-3 + Ulysses only)",
    "tensor_parallel": "tensor parallelism is not supported (ZeRO-3 + Ulysses only)",
    "amp": "use precision.dtype (bf16/fp16/fp32); apex AMP is not supported",
}

#: The only ZeRO stage ulyssesd runs (and the planner models): a config asking for another is an error.
ZERO_STAGE = 3

# Zero keys users put at the top level by mistake (the seed's §5.2 snippet) -> name inside zero_optimization.
MISPLACED_ZERO_KEYS: dict[str, str] = {
    "reduce_bucket_size": "reduce_bucket_size",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "stage3_max_reuse_distance": "stage3_max_reuse_distance",
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_param",
    "sub_group_size": "sub_group_size",
}

_INT_ZERO_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "allgather_bucket_size",
                  "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                  "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "sub_group_size")


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`: nested objects merge key by key, anything else in `over` wins.
    The one merge of the user's DeepSpeed config (the planner uses it too)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_user_config(spec: JobSpec) -> tuple[dict[str, Any], str]:
    """The user's base merged with the inline config, and a label naming where values came from."""
    base: dict[str, Any] = {}
    source = "deepspeed.config"
    if spec.deepspeed.config_path:
        path = Path(spec.deepspeed.config_path)
        try:
            base = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecError(str(path), ["deepspeed.config_path: file not found"]) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(str(path), [f"deepspeed.config_path: not valid JSON: {exc}"]) from None
        if not isinstance(base, dict):
            raise SpecError(str(path), ["deepspeed.config_path: top level must be a JSON object"])
        source = f"{path.name} / deepspeed.config"
    return deep_merge(base, spec.deepspeed.config), source


def build_ds_config(spec: JobSpec, world_size: int, run_dir: str | Path | None = None, attempt: int | None = None
                    ) -> tuple[dict[str, Any], list[str]]:
    """Return (DeepSpeed config, warnings). Raises SpecError listing every conflict. `attempt` names the
    per-attempt CSV directory of `[scalars] csv`."""
    cfg, source = load_user_config(spec)
    warnings: list[str] = []
    problems: list[str] = []
    sp = spec.parallel.sequence_parallel_size
    if world_size % sp:
        problems.append(f"world size {world_size} is not divisible by parallel.sequence_parallel_size={sp}")
    dp = max(1, world_size // sp)
    tr = spec.train

    for key, why in UNSUPPORTED_KEYS.items():
        if key in cfg:
            cfg.pop(key)
            warnings.append(f"ignoring DeepSpeed key {key!r} from {source}: {why}")

    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        problems.append(f"zero_optimization in {source} must be an object")
        zero = {}
    for key, inner in MISPLACED_ZERO_KEYS.items():
        if key in cfg:
            value = cfg.pop(key)
            if inner in zero and zero[inner] != value:
                warnings.append(f"top-level {key!r}={value!r} in {source} is not a DeepSpeed key and "
                                f"zero_optimization.{inner}={zero[inner]!r} is also set: keeping the latter")
            else:
                zero[inner] = value
                warnings.append(f"top-level {key!r} in {source} is not a DeepSpeed key (DeepSpeed would "
                                f"ignore it): moved to zero_optimization.{inner}")
    stage = zero.get("stage", ZERO_STAGE)
    if stage != ZERO_STAGE:
        problems.append(f"zero_optimization.stage={stage} in {source}: ulyssesd runs ZeRO stage {ZERO_STAGE} only")
    zero["stage"] = ZERO_STAGE
    for key in _INT_ZERO_KEYS:
        if isinstance(zero.get(key), float) and float(zero[key]).is_integer():
            zero[key] = int(zero[key])  # 1e8 in JSON is a float; DeepSpeed wants ints
    cfg["zero_optimization"] = zero

    # Batch sizes: ours. A different user value is an error - silently training with another global
    # batch would change the run's math.
    owned = {
        "train_micro_batch_size_per_gpu": (tr.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (tr.gradient_accumulation_steps, "train.gradient_accumulation_steps"),
        "train_batch_size": (tr.micro_batch_size * tr.gradient_accumulation_steps * dp,
                             f"train.micro_batch_size x train.gradient_accumulation_steps x dp({dp})"),
    }
    ours: object  # an int here, a float or list for the optimizer params below
    for key, (ours, where) in owned.items():
        if key in cfg and cfg[key] != ours:
            problems.append(f"{key}={cfg[key]} in {source} conflicts with {where}={ours}; "
                            f"set it in one place only")
        cfg[key] = ours

    if "gradient_clipping" in cfg and cfg["gradient_clipping"] != tr.gradient_clipping:
        warnings.append(f"gradient_clipping={cfg['gradient_clipping']} in {source} is overridden by "
                        f"train.gradient_clipping={tr.gradient_clipping} (a remediation knob the spec owns)")
    cfg["gradient_clipping"] = tr.gradient_clipping

    user_opt = cfg.pop("optimizer", None) or {}
    user_params = dict(user_opt.get("params") or {})
    if user_opt.get("type") and str(user_opt["type"]).lower() not in ("adam", "adamw"):
        problems.append(f"optimizer.type={user_opt['type']!r} in {source}: only AdamW is supported")
    for key, ours in (("lr", tr.lr), ("weight_decay", tr.weight_decay), ("betas", list(tr.betas))):
        if key in user_params and user_params[key] != ours:
            warnings.append(f"optimizer.params.{key}={user_params[key]!r} in {source} is overridden by "
                            f"train.{key}={ours!r}")
    cfg["optimizer"] = {"type": "AdamW", "params": {
        "lr": tr.lr, "betas": list(tr.betas), "eps": float(user_params.get("eps", 1e-8)),
        "weight_decay": tr.weight_decay,
        # torch's AdamW: DeepSpeed's FusedAdam would JIT-compile a C++/CUDA op on first use.
        "torch_adam": True,
    }}

    offloaded = isinstance(zero.get("offload_optimizer"), dict) and \
        zero["offload_optimizer"].get("device", "none") not in ("none", None)
    if tr.fused_adam and tr.device != "cpu" and not offloaded:
        cfg["optimizer"]["params"]["fused"] = True  # passed through to torch.optim.AdamW by DeepSpeed
    _precision(spec, cfg, source, problems)

    if run_dir is not None:
        for block, ours in monitor_blocks(spec, attempt).items():
            user = cfg.get(block)
            if isinstance(user, dict) and user.get("enabled"):
                warnings.append(f"scalars asks for the {block} monitor and {source} enables one: {source}'s "
                                f"{block} block is used (output_path {user.get('output_path') or 'monitor'!r})")
            else:
                cfg[block] = ours
        for mon in ("csv_monitor", "tensorboard", "wandb"):
            sec = cfg.get(mon)
            if isinstance(sec, dict) and sec.get("enabled") and mon != "wandb":
                out = sec.get("output_path") or "monitor"
                if not Path(out).is_absolute():
                    sec["output_path"] = str(Path(run_dir) / out) + "/"
                sec.setdefault("job_name", "ulyssesd")
    cfg.setdefault("steps_per_print", 10**9)  # our telemetry replaces DeepSpeed's periodic print
    cfg.setdefault("wall_clock_breakdown", False)

    if problems:
        raise SpecError(source, problems)
    return cfg, warnings


def _precision(spec: JobSpec, cfg: dict[str, Any], source: str, problems: list[str]) -> None:
    dtype = spec.precision.dtype
    for sec, want in (("fp16", dtype == "fp16"), ("bf16", dtype == "bf16")):
        user = cfg.get(sec)
        if isinstance(user, dict) and "enabled" in user and bool(user["enabled"]) != want \
                and user["enabled"] != "auto":
            problems.append(f"{sec}.enabled={user['enabled']} in {source} conflicts with "
                            f"precision.dtype={dtype!r}")
    cfg.pop("bfloat16", None)
    ls = spec.precision.loss_scale
    if dtype == "fp16":
        ours = {"enabled": True, "loss_scale": 0, "initial_scale_power": ls.initial_scale_power,
                "loss_scale_window": ls.loss_scale_window, "hysteresis": ls.hysteresis,
                "min_loss_scale": ls.min_loss_scale}
        user = cfg["fp16"] if isinstance(cfg.get("fp16"), dict) else {}
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            if key in user and user[key] != ours[key]:
                problems.append(f"fp16.{key}={user[key]} in {source} conflicts with "
                                f"precision.loss_scale.{key}={ours[key]}")
        if user.get("loss_scale", 0) != 0:
            problems.append(f"fp16.loss_scale={user['loss_scale']} (static) in {source}: the job uses dynamic "
                            f"loss scaling configured by precision.loss_scale")
        cfg["fp16"] = {**user, **ours}
        cfg.pop("bf16", None)
    elif dtype == "bf16":
        cfg["bf16"] = {**(cfg["bf16"] if isinstance(cfg.get("bf16"), dict) else {}), "enabled": True}
        cfg.pop("fp16", None)
    else:
        cfg.pop("fp16", None)
        cfg.pop("bf16", None)
