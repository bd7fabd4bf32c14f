"""The diagnosis' vocabulary: the fixed label set, the tail size callers pass, the knobs, and the result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LABELS: tuple[str, ...] = (
    "cuda_oom", "host_oom_killed", "nccl_timeout", "nccl_error", "loss_scale_overflow", "loss_scale_min",
    "nan_loss", "illegal_memory_access", "gpu_hardware", "disk_full", "checkpoint_corrupt", "dataloader_crash",
    "launcher_error", "segfault", "killed", "config_rejected", "python_exception", "healthy",
)

# Bytes of the log end that callers should pass (and that `diagnose` keeps at most).
TAIL_BYTES = 512 * 1024


@dataclass(frozen=True)
class DiagnosisConfig:
    """Knobs of the log diagnosis (defaults suit DeepSpeed fp16 defaults: initial scale 2^16, window 1000)."""

    max_bytes: int = TAIL_BYTES  # only this many characters of the end of the text are scanned
    max_lines: int = 20_000  # ...and at most this many lines of it
    max_line_chars: int = 4_000  # longer lines (minified JSON, progress bars) are cut before matching
    max_evidence: int = 5  # evidence lines reported for the primary label
    overflow_warmup_steps: int = 100  # OVERFLOW lines at or before this step are loss-scale calibration
    overflow_storm_min: int = 8  # a storm needs at least this many post-warm-up OVERFLOW lines...
    overflow_storm_span_steps: int = 200  # ...within this many steps of each other
    overflow_storm_min_nostep: int = 24  # without step numbers in the log: this many OVERFLOW lines in the tail
    root_exception_window: int = 40  # an exception is the first failure only this many unindented lines before a comm error
    max_tracebacks: int = 64  # only the last this many tracebacks of the tail are read
    max_traceback_lines: int = 400  # a traceback's exception line is looked for this many lines after its header
    overflow_low_scale: float = 64.0  # OVERFLOW at an attempted scale <= this is far below fp16's 2^16 start...
    overflow_low_scale_min: int = 3  # ...and this many such lines are a storm, at any step
    overflow_skipped_fraction: float = 0.5  # DeepSpeed's "step=N, skipped=M": M/N >= this after warm-up is a storm
    progress_min_lines: int = 2  # healthy is `high` only with at least this many progress lines
    binary_fraction: float = 0.1  # text with more than this share of control/replacement characters is binary
    dedup_window: int = 400  # another rank's copy of a message counts as a repeat only this many lines after it
    root_frames: int = 4  # where an exception was raised: its innermost this many traceback frames


@dataclass(frozen=True)
class Diagnosis:
    """One primary label, the verbatim (ANSI-stripped) lines that decided it, and why."""

    label: str  # one of LABELS
    evidence: list[str] = field(default_factory=list)  # the deciding lines, in log order
    confidence: str = "high"  # high | medium | low
    reason: str = ""  # one sentence naming the evidence
    secondary: list[str] = field(default_factory=list)  # other labels seen in the log, in precedence order

    def to_dict(self) -> dict:
        return asdict(self)
