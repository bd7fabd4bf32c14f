"""Typed, validated configuration of the training job (the job's half of a run spec).

A run spec is one TOML file. The sections defined here describe the job itself; the daemon adds
`[run]`, `[launcher]`, `[detectors]`, `[remediation]` and `[daemon]` (see `ulyssesd.daemon.spec`).
The effective job config of each config version is this model dumped to JSON
(`{run_dir}/configs/v{N}.json`), so everything here must round-trip through `model_dump(mode="json")`.

Every field has a one-line doc; cross-field rules (`JobSpec._cross_checks`) name both key paths in their message.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from ulyssesd.remediation.logread.options import TelemetrySourceOptions

from .recovery.options import RecoveryOptions

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

# Sections that belong to the daemon's part of a run spec; the job ignores them.
DAEMON_SECTIONS = ("run", "launcher", "detectors", "remediation", "daemon", "slurm", "restart", "gpu_health")


class SpecError(ValueError):
    """A run spec is invalid. `problems` holds one message per problem, each naming its key path."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid run spec {source}: {len(problems)} problem(s)\n{lines}")


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise: reject them with their path.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------- model
PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the demo: byte-level vocabulary, seconds per run on 2 cores.
    "tiny": dict(hidden_size=64, num_layers=4, num_attention_heads=4, vocab_size=256, max_seq_len=1024,
                 mlp="gelu", ffn_hidden_size=256, tie_embeddings=True),
    "gpt-1b": dict(hidden_size=2048, num_layers=24, num_attention_heads=16, vocab_size=50304,
                   max_seq_len=32768, mlp="gelu", ffn_hidden_size=8192, tie_embeddings=False),
    # The reference probe's 6.86B GPT (bench/reference_gpt.py's shape at gpt-7b size): h 4096, L 32, 32 heads, GELU 4h, no bias.
    "gpt-7b": dict(hidden_size=4096, num_layers=32, num_attention_heads=32, vocab_size=50304,
                   max_seq_len=1 << 20, mlp="gelu", ffn_hidden_size=16384, tie_embeddings=False),
    # The seed's 176B: h 12288, L 96, 96 heads, 32K context, vocab 50257, tied head (P = 174.6B, docs/DEEPSPEED_NOTES.md).
    "gpt-176b": dict(hidden_size=12288, num_layers=96, num_attention_heads=96, vocab_size=50257,
                     max_seq_len=32768, mlp="gelu", ffn_hidden_size=49152, tie_embeddings=True),
}


class ModelSpec(_Section):
    preset: Literal["tiny", "gpt-1b", "gpt-7b", "gpt-176b"] | None = Field(
        "tiny", description="Named preset; explicit fields below override its values.")
    hidden_size: int | None = Field(None, gt=0, description="Model width h.")
    num_layers: int | None = Field(None, gt=0, description="Number of transformer blocks L.")
    num_attention_heads: int | None = Field(None, gt=0, description="Attention heads; must divide h and be divisible by SP.")
    vocab_size: int | None = Field(None, gt=0, description="Vocabulary size V (256 = raw bytes).")
    max_seq_len: int | None = Field(None, gt=0, description="Longest sequence the run may use (rotary table size).")
    mlp: Literal["gelu", "swiglu"] | None = Field(None, description="MLP kind: GELU (4h) or SwiGLU.")
    ffn_hidden_size: int | None = Field(None, gt=0, description="MLP inner width; default 4h (GELU) or 8h/3 rounded (SwiGLU).")
    tie_embeddings: StrictBool | None = Field(None, description="Share the input embedding with the output head.")
    bias: StrictBool = Field(False, description="Linear layers carry a bias.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary base frequency.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    norm_fp32_copy: StrictBool = Field(True, description="LayerNorm upcasts its input to an fp32 copy; false = the fused bf16 kernel (still accumulates in fp32, saves memory and time on GPU).")
    rotary_fused: StrictBool = Field(False, description="GPU: q/k rotary (fp32 math) as one torch.compile'd kernel instead of eager fp32 ops and casts (same math; CPU runs the eager ops).")
    qkv_copy: StrictBool = Field(True, description="Copy v out of the fused qkv output before attention; false = pass the "
                                             "strided view (SP=1 only; saves one copy per block, same math).")
    checkpoint_keep_attention: StrictBool = Field(False, description="Checkpointed blocks keep the attention kernel's output "
                                                               "and logsumexp: no attention forward in recompute, "
                                                               "+(d·h + 4·heads) bytes per token per block.")
    mlp_chunk_tokens: int = Field(0, ge=0, description="TiledMLP: each block's MLP over checkpointed chunks of N local "
                                                       "tokens (long sequences; one more MLP forward); 0 = untiled.")
    offload_checkpoints: StrictBool = Field(False, description="Checkpointed block inputs go to (pinned) host memory in forward and are prefetched back in backward; needs recompute on.")
    offload_keep_last: int = Field(0, ge=0, description="With offload_checkpoints: the last N checkpointed chunks keep their inputs on the GPU (backward needs them first), N·b·s/sp·d·h less pinned host RAM.")
    compile_blocks: StrictBool = Field(False, description="Each block's work around attention as torch.compile'd graphs.")

    def resolved(self) -> ResolvedModel:
        base = dict(PRESETS[self.preset]) if self.preset else {}
        for key in ("hidden_size", "num_layers", "num_attention_heads", "vocab_size", "max_seq_len",
                    "mlp", "ffn_hidden_size", "tie_embeddings"):
            value = getattr(self, key)
            if value is not None:
                base[key] = value
        missing = [k for k in ("hidden_size", "num_layers", "num_attention_heads", "vocab_size") if k not in base]
        if missing:
            raise ValueError(f"model: no preset given and {', '.join('model.' + m for m in missing)} missing")
        for key, default in (("max_seq_len", 4096), ("mlp", "gelu"), ("tie_embeddings", False)):
            base.setdefault(key, default)
        new_h = self.preset is not None and self.hidden_size not in (None, PRESETS[self.preset]["hidden_size"])  # own MLP
        if "ffn_hidden_size" not in base or (self.ffn_hidden_size is None and (self.mlp is not None or new_h)):
            h = base["hidden_size"]
            base["ffn_hidden_size"] = 4 * h if base["mlp"] == "gelu" else 256 * ((8 * h // 3 + 255) // 256)
        own = set(ResolvedModel.model_fields) - set(base)  # bias, rope, init and the speed/long-sequence levers
        return ResolvedModel(**self.model_dump(include=own), **base)


class ResolvedModel(BaseModel):
    """Concrete model dimensions after applying the preset."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    vocab_size: int
    max_seq_len: int
    mlp: Literal["gelu", "swiglu"]
    ffn_hidden_size: int
    tie_embeddings: bool
    bias: bool
    rope_theta: float
    init_std: float
    norm_fp32_copy: bool = True
    rotary_fused: bool = False
    qkv_copy: bool = True
    checkpoint_keep_attention: bool = False
    mlp_chunk_tokens: int = 0
    offload_checkpoints: bool = False
    offload_keep_last: int = 0
    compile_blocks: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_params(self, include_embedding: bool = True) -> int:
        h, f, v, n = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_layers
        b = 1 if self.bias else 0
        attn = 4 * h * h + b * 4 * h
        ffn_in = (2 if self.mlp == "swiglu" else 1) * f  # SwiGLU's gate and up projections
        mlp = h * ffn_in + f * h + b * (ffn_in + h)
        norm = (2 if self.bias else 1) * h  # LayerNorm weight (+ bias when the model has biases)
        blocks = n * (attn + mlp + 2 * norm) + norm  # + final norm
        if not include_embedding:
            return blocks
        emb = v * h * (1 if self.tie_embeddings else 2)
        return blocks + emb


# ------------------------------------------------------------------------------------ parallel
class ParallelSpec(_Section):
    sequence_parallel_size: int = Field(1, ge=1, description="Ulysses SP degree; ranks per SP group.")
    world_size: int | None = Field(None, ge=1, description="Total ranks; default = launcher nnodes × nproc_per_node.")


# ----------------------------------------------------------------------------------- precision
class LossScaleSpec(_Section):
    initial_scale_power: int = Field(16, ge=0, le=32, description="fp16 initial loss scale = 2**power (seed: 16).")
    loss_scale_window: int = Field(1000, ge=1, description="Steps without overflow before the scale grows.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale shrinks.")
    min_loss_scale: float = Field(1.0, gt=0, description="Floor of the dynamic scale; reaching it ends the run upstream.")


class PrecisionSpec(_Section):
    dtype: Literal["fp32", "bf16", "fp16"] = Field("bf16", description="Compute/parameter dtype.")
    fp32_layers: int = Field(0, ge=0, description="Run the first N blocks' compute in fp32 (a loss-ladder remediation).")
    fp32_mode: Literal["full", "tf32", "residual"] = Field("full", description="fp32 blocks: all, TF32 matmuls, or residual+norms only.")
    loss_scale: LossScaleSpec = Field(default_factory=LossScaleSpec, description="fp16 dynamic loss scaling.")


# ----------------------------------------------------------------------------------- attention
class AttentionSpec(_Section):
    backend: Literal["auto", "cudnn", "flash", "efficient", "math", "flash_attn"] = Field(
        "auto", description="auto = fastest measured (cuDNN SDPA on Hopper, math on CPU); flash_attn needs the extra.")


# ---------------------------------------------------------------------------------------- train
class TrainSpec(_Section):
    steps: int = Field(100, ge=1, description="Optimizer steps of the whole run.")
    seq_len: int = Field(256, ge=2, description="Tokens per sequence (global, before the SP split).")
    micro_batch_size: int = Field(1, ge=1, description="Sequences per GPU per micro-step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-5, ge=0, description="Floor of the cosine decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    gradient_clipping: float = Field(1.0, ge=0, description="Global grad-norm clip (seed ladder: 1.0 -> 0.5); 0 = off.")
    seed: int = Field(1234, description="Seed of weights, data order and dropout.")
    activation_checkpoint_every: int = Field(0, ge=0, description="Recompute every k-th block: 0 none, 1 every layer, 4 seed.")
    activation_checkpoint_layers: int | None = Field(
        None, ge=0, description="Selective recompute: checkpoint only the first N blocks (one per chunk) and keep "
                                "the others' activations; overrides activation_checkpoint_every when set.")
    loss_chunk_tokens: int = Field(
        0, ge=0, description="Tiled LM loss: head + fp32 cross-entropy over chunks of N local tokens, each recomputed "
                             "in backward, so the whole sequence's fp32 logits never exist at once; 0 = untiled.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="cuda when available unless cpu is forced.")
    compile: StrictBool = Field(False, description="torch.compile each block (GPU only).")
    zero3_leaf_blocks: StrictBool = Field(False, description="Mark each transformer block a ZeRO-3 leaf module: one "
                                                       "fetch per block and no hooks on its sub-modules (less Python per step).")
    fused_adam: StrictBool = Field(False, description="GPU, optimizer on GPU: torch AdamW(fused=True), one kernel per step "
                                                "instead of ~10 foreach passes over the fp32 partitions.")
    log_every: int = Field(1, ge=1, description="Write a telemetry step record every N steps.")


# ------------------------------------------------------------------------------------ deepspeed
class DeepSpeedSpec(_Section):
    config_path: str | None = Field(None, description="User's own ds_config.json used as the base (relative to the spec).")
    config: dict[str, Any] = Field(default_factory=dict, description="Inline DeepSpeed config merged over the base.")


# ----------------------------------------------------------------------------------------- data
class BlendEntry(_Section):
    path: str = Field(..., description="Indexed dataset prefix (PREFIX.bin + PREFIX.idx).")
    weight: float = Field(..., gt=0, description="Relative share of the samples (any positive scale).")


class DataSpec(_Section):
    kind: Literal["synthetic", "text", "tokens", "indexed"] = Field(
        "synthetic", description="synthetic | byte-level text file | token memmap | Megatron .bin/.idx dataset(s).")
    path: str | None = Field(None, description="Text or token file, or the indexed dataset prefix (indexed kind).")
    blend: list[BlendEntry] = Field(default_factory=list,
                                    description="indexed kind: weighted datasets instead of one path.")
    tokenizer: str | None = Field(None, description="tokenizer.json the data was made with: its size is checked "
                                                    "against model.vocab_size at start.")
    prefetch: int = Field(2, ge=0, description="Optimizer steps of batches a background thread builds ahead; 0 = inline.")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of a token file.")
    seed: int | None = Field(None, description="Order seed; default train.seed.")
    skip_ranges: list[tuple[int, int]] = Field(default_factory=list,
                                               description="Half-open [start, end) global sample ranges never trained on.")

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.kind == "indexed" and bool(self.path) == bool(self.blend):
            raise ValueError("data.kind='indexed' needs exactly one of data.path or data.blend")
        if self.blend and self.kind != "indexed":
            raise ValueError(f"data.blend is only for data.kind='indexed', not {self.kind!r}")
        if self.kind not in ("synthetic", "indexed") and not self.path:
            raise ValueError(f"data.path is required when data.kind={self.kind!r}")
        for start, end in self.skip_ranges:
            if not 0 <= start < end:
                raise ValueError(f"data.skip_ranges entry [{start}, {end}] must satisfy 0 <= start < end")
        return self


# ----------------------------------------------------------------------------------- checkpoint
class CheckpointSpec(RecoveryOptions, _Section):  # + memory_tier, memory_interval_steps, in_process_*, save_defer_max_steps
    dir: str | None = Field(None, description="Checkpoint root; default {run_dir}/checkpoints.")
    interval_steps: int = Field(50, ge=1, description="Save every N steps (and at the end / on SIGTERM).")
    keep_last: int = Field(3, ge=1, description="Retention keeps the last K valid tags plus known-good anchors.")
    load: str = Field("latest", description="'latest' (newest valid), 'none', or an explicit tag such as step-00000100.")
    verify_checksums: StrictBool = Field(True, description="Check manifest sha256 of every file on load.")
    verify_threads: int | None = Field(None, ge=1, le=64, description="Threads hashing at load; default min(cores, 8).")
    save_at_end: StrictBool = Field(True, description="Save when the last step completes (benchmarks: off).")
    async_save: StrictBool = Field(False, description="Snapshot shards to host memory and write them in a background "
                             "thread while training goes on (one save in flight); the manifest is committed only "
                             "when every rank's shards are durable.")
    snapshot_pool: StrictBool = Field(True, description="Async saves on a GPU: registered snapshot memory, built early.")
    snapshot_pool_chunk_mib: int = Field(256, ge=16, le=16384, strict=True, description="MiB per cudaHostRegister.")
    snapshot_pool_pause_ms: float = Field(50.0, ge=0, le=10_000, strict=True, description="Rest between registered chunks.")


# ------------------------------------------------------------------------------------ telemetry
class TelemetrySpec(TelemetrySourceOptions, _Section):  # + source, pattern, files, silent_after_s
    path: str | None = Field(None, description="Telemetry JSONL; default {run_dir}/telemetry.jsonl.")
    gather_per_rank: StrictBool = Field(True, description="All-reduce per-rank step time and memory each step.")


# -------------------------------------------------------------------------------------- scalars
#: The largest believable dense peak of one accelerator (TF/s); a larger (or infinite) value would make every
#: MFU read ~0 % rather than be refused (today's largest dense peaks are a few thousand TF/s).
MAX_PEAK_TFLOPS_PER_GPU = 100_000.0


class ScalarsSpec(_Section):
    """Training scalars through DeepSpeed's monitor (training/scalars.py); everything off by default."""

    tensorboard: StrictBool = Field(False, description="Write TensorBoard event files to {scalars.dir}/tensorboard/ "
                                                 "(needs the tensorboard extra).")
    csv: StrictBool = Field(False, description="Write DeepSpeed csv_monitor files, one CSV per scalar, to "
                                         "{scalars.dir}/csv/.")
    dir: str = Field("scalars", min_length=1, description="Output directory, relative to the run directory "
                                                          "unless absolute.")
    peak_tflops_per_gpu: float | None = Field(None, gt=0, le=MAX_PEAK_TFLOPS_PER_GPU, description="Dense peak "
                                              "TF/s of one accelerator for the run's dtype (989 for H100/H200 "
                                              "bf16); set, the job reports MFU in scalars and telemetry.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_lax_values(cls, data: Any) -> Any:
        # Lax parsing would take `peak_tflops_per_gpu = true` as 1.0 TF/s (an MFU 989x too high on an H100), and a
        # NUL in `dir` passes a str check but makes os.makedirs raise ValueError on rank 0 mid-start.
        if isinstance(data, dict):
            if isinstance(data.get("peak_tflops_per_gpu"), bool):
                raise ValueError(f"scalars.peak_tflops_per_gpu={data['peak_tflops_per_gpu']!r} is a boolean, not a peak: give "
                                 f"the accelerator's peak in TF/s (e.g. 989)")
            if isinstance(data.get("dir"), str) and "\0" in data["dir"]:
                raise ValueError(f"scalars.dir={data['dir']!r} holds a NUL byte (no path can)")
        return data


# --------------------------------------------------------------------------------------- faults
class FaultSpec(_Section):
    kind: Literal["raise", "raise_mid_step", "sigkill", "hang", "nan_loss", "loss_spike", "lr_spike", "memory_spike",
                  "slow_rank", "cuda_oom", "enospc_on_save", "corrupt_checkpoint", "exit_at_start", "disk_full", "read_only_fs"] = Field(
        ..., description="What to inject.")
    at_step: int | None = Field(None, ge=0, description="Step at which it fires (None = every step, by probability).")
    probability: float = Field(1.0, ge=0, le=1, description="Chance per eligible step.")
    rank: int = Field(0, ge=0, description="Global rank that misbehaves.")
    steps: int = Field(1, ge=1, description="Duration in steps (loss_spike, slow_rank, memory_spike, lr_spike).")
    magnitude: float = Field(10.0, gt=0, description="Loss multiplier, LR multiplier (lr_spike), GiB held, or seconds slept, by kind.")
    attempts: list[int] | None = Field(None, description="Only on these attempt numbers (None = first attempt only).")
    restarts: list[int] | None = Field(None, description="Only in these in-job restarts of an attempt (None = any).")
    corruption: Literal["truncate", "flip"] = Field(
        "truncate", description="corrupt_checkpoint: truncate a shard to half its size, or flip bytes (same size).")


# ------------------------------------------------------------------------------------------ job
class JobSpec(_Section):
    model: ModelSpec = Field(default_factory=ModelSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    attention: AttentionSpec = Field(default_factory=AttentionSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    scalars: ScalarsSpec = Field(default_factory=ScalarsSpec)
    faults: list[FaultSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        problems = self.cross_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def cross_problems(self) -> list[str]:
        problems: list[str] = []
        try:
            m = self.model.resolved()
        except ValueError as exc:
            return [str(exc)]
        sp = self.parallel.sequence_parallel_size
        if m.hidden_size % m.num_attention_heads:
            problems.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                            f"model.num_attention_heads={m.num_attention_heads}")
        if m.num_attention_heads % sp:
            problems.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                            f"parallel.sequence_parallel_size={sp}")
        # Upstream #7384: DistributedAttention silently computes garbage when seq % sp != 0.
        if self.train.seq_len % sp:
            problems.append(f"train.seq_len={self.train.seq_len} is not divisible by "
                            f"parallel.sequence_parallel_size={sp} (Ulysses would be silently wrong)")
        if self.train.seq_len > m.max_seq_len:
            problems.append(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        n_ck = self.train.activation_checkpoint_layers
        if n_ck is not None and n_ck > m.num_layers:
            problems.append(f"train.activation_checkpoint_layers={n_ck} exceeds model.num_layers={m.num_layers}")
        if m.offload_checkpoints and not (self.train.activation_checkpoint_layers
                                          if n_ck is not None else self.train.activation_checkpoint_every):
            problems.append("model.offload_checkpoints=true needs activation checkpointing (train."
                            "activation_checkpoint_every >= 1 or activation_checkpoint_layers >= 1): without "
                            "recompute there are no checkpointed block inputs to offload")
        if m.offload_keep_last and not m.offload_checkpoints:
            problems.append(f"model.offload_keep_last={m.offload_keep_last} needs model.offload_checkpoints=true (or set it to 0)")
        if self.precision.fp32_layers > m.num_layers:
            problems.append(f"precision.fp32_layers={self.precision.fp32_layers} exceeds "
                            f"model.num_layers={m.num_layers}")
        if self.parallel.world_size is not None and self.parallel.world_size % sp:
            problems.append(f"parallel.world_size={self.parallel.world_size} is not divisible by "
                            f"parallel.sequence_parallel_size={sp}")
        if self.train.min_lr > self.train.lr:
            problems.append(f"train.min_lr={self.train.min_lr} is above train.lr={self.train.lr}")
        if (m.head_dim % 2) and m.hidden_size % m.num_attention_heads == 0:
            problems.append(f"model head_dim={m.head_dim} must be even for rotary embeddings")
        return problems

    def resolved_model(self) -> ResolvedModel:
        return self.model.resolved()

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


# --------------------------------------------------------------------------------------- errors
def format_validation_error(exc: ValidationError) -> list[str]:
    """One readable line per pydantic error: `key.path=value: what is allowed`."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = "must be true or false (a TOML boolean)" if err["type"] == "bool_type" else err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            problems.append(f"{loc}: unknown key (typo? see the field list of that section)")
        elif err["type"] == "missing":
            problems.append(f"{loc}: required key missing")
        elif loc and "input" in err and not isinstance(err["input"], dict):
            problems.append(f"{loc}={err['input']!r}: {msg}")
        elif loc:
            for part in msg.split("; "):
                problems.append(part if "=" in part or "." in part.split(" ")[0] else f"{loc}: {part}")
        else:
            problems.extend(msg.split("; "))
    return problems


MAX_SPEC_BYTES = 1 << 20  # a run spec is a few KiB of TOML; anything near this is not one


class UnreadableFile(OSError):
    """A file cannot be read as a bounded regular file; the message names the path and the reason."""


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_regular_file(path: str | Path, max_bytes: int, *, tail: bool = False) -> tuple[bytes, int]:
    """(bytes, file size) of a regular file: at most `max_bytes` (the last ones if `tail`, else the first).
    Never blocks: opened O_NONBLOCK and refused unless it is a regular file (a FIFO, device or directory
    raises UnreadableFile naming what it is)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise UnreadableFile(f"{path}: file not found") from None
    except PermissionError:
        raise UnreadableFile(f"{path}: not readable (permission denied)") from None
    except OSError as exc:
        raise UnreadableFile(f"{path}: cannot open ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        what = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise UnreadableFile(f"{path}: not a regular file ({what})")
    with os.fdopen(fd, "rb") as fh:
        try:
            if tail and st.st_size > max_bytes:
                fh.seek(st.st_size - max_bytes)
            return fh.read(max_bytes), st.st_size
        except OSError as exc:
            raise UnreadableFile(f"{path}: cannot read ({exc.strerror or exc})") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; SpecError (never a traceback) for a missing, special, huge, binary or invalid one."""
    path = Path(path)
    try:
        data, size = read_regular_file(path, MAX_SPEC_BYTES + 1)
    except UnreadableFile as exc:
        reason = str(exc).removeprefix(f"{path}: ")
        raise SpecError(str(path), [reason]) from None
    if size > MAX_SPEC_BYTES:
        raise SpecError(str(path), [f"file is {size} bytes; a run spec is at most {MAX_SPEC_BYTES} bytes of TOML"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), [f"not UTF-8 text (invalid byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                                    f"a run spec is a TOML file"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(path), [f"not valid TOML: {exc}"]) from None
    except RecursionError:
        raise SpecError(str(path), ["not valid TOML: arrays or tables nest too deeply"]) from None


def job_spec_from_dict(data: dict[str, Any], source: str = "<dict>", base_dir: Path | None = None) -> JobSpec:
    job_part = {k: v for k, v in data.items() if k not in DAEMON_SECTIONS}
    try:
        spec = JobSpec.model_validate(job_part)
    except ValidationError as exc:
        raise SpecError(source, format_validation_error(exc)) from None
    paths = [("deepspeed.config_path", spec.deepspeed, "config_path"), ("data.path", spec.data, "path"),
             ("data.tokenizer", spec.data, "tokenizer"), *(("data.blend.path", e, "path") for e in spec.data.blend)]
    for key, owner, attr in paths:  # relative paths are the spec file's; a NUL byte no OS call accepts
        value = getattr(owner, attr)
        if value and "\x00" in value:
            raise SpecError(source, [f"{key}: a path may not contain a NUL byte"])
        if value and base_dir is not None and not Path(value).is_absolute():
            setattr(owner, attr, str((base_dir / value).resolve()))
    return spec


def load_job_spec(path: str | Path) -> JobSpec:
    """Load the job's sections of a run spec TOML (or an effective-config JSON written by the daemon)."""
    path = Path(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(str(path), [f"unreadable JSON config: {exc}"]) from None
    else:
        data = read_toml(path)
    return job_spec_from_dict(data, str(path), path.parent)
