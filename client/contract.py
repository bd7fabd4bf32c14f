"""The job ⇄ daemon contract as code (docs/CONTRACTS.md), importable without torch or deepspeed.

- telemetry records: `SCHEMA_VERSION`, `EVENTS`, `encode_record` (non-finite floats become "nan"/"inf"/"-inf"),
  `validate_record` (what a producer must write);
- control.json: `ControlState`, `parse_control` (what a job accepts);
- SIGUSR1 stack dumps: `stack_dump_path`, `stack_dump_files`;
- run-directory defaults from the environment the daemon sets (`ULYSSESD_RUN_DIR`, `ULYSSESD_ATTEMPT`,
  `ULYSSESD_CONFIG_VERSION`).

The JSON Schema files in `ulyssesd/client/schemas/` describe the same documents for other languages;
tests/client/test_schemas.py keeps the parsers and the schemas in agreement.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
EVENTS = ("started", "checkpoint_saving", "checkpoint_saved", "checkpoint_loaded", "checkpoint_invalid",
          "checkpoint_save_failed", "control_applied", "fault_injected", "exiting")
# checkpoint_save_failed: exit 4 (the errno is in the event); config_rejected / no_checkpoint: exit 2 / 3.
EXIT_REASONS = ("completed", "sigterm", "error", "checkpoint_save_failed", "config_rejected", "no_checkpoint")
TELEMETRY_NAME = "telemetry.jsonl"
CONTROL_NAME = "control.json"
STACK_DUMP_DIR = "stacks"
_STACK_DUMP_RE = re.compile(r"^attempt-(\d+)-rank-(\d+)\.txt$")


# ------------------------------------------------------------------------------ environment
def env_run_dir() -> Path:
    """The run directory the daemon gave the job (`ULYSSESD_RUN_DIR`), else the working directory."""
    return Path(os.environ.get("ULYSSESD_RUN_DIR") or ".")


def env_int(name: str, default: int | None = None) -> int | None:
    """An integer environment variable; a malformed value raises ValueError naming it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def env_rank() -> int:
    """Global rank from the launcher's environment (torchrun/deepspeed/srun); 0 when run alone."""
    for name in ("RANK", "SLURM_PROCID"):
        value = env_int(name)
        if value is not None:
            return value
    return 0


def env_world_size() -> int:
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = env_int(name)
        if value is not None:
            return value
    return 1


# -------------------------------------------------------------------------------- telemetry
def jsonable(value: Any) -> Any:
    """Contract encoding of one value: non-finite floats as strings, 0-d tensors/arrays via `.item()`."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # torch/numpy scalars, without importing either
        numel = getattr(value, "numel", None)
        if numel is None or numel() == 1:
            return jsonable(value.item())
        return jsonable(value.tolist())
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    return value


def encode_record(record: dict[str, Any]) -> str:
    """One telemetry line (without the newline): strict JSON, compact."""
    return json.dumps(jsonable(record), allow_nan=False, separators=(",", ":"))


_NUM = (int, float)
_STEP_FIELDS: dict[str, tuple[type, ...]] = {
    "grad_norm": _NUM, "lr": _NUM, "loss_scale": _NUM, "skipped": (bool,), "step_time_s": _NUM,
    "step_time_max_s": _NUM, "slowest_rank": (int,), "tokens": (int,), "tokens_per_s": _NUM,
    "mem_allocated_gib": _NUM, "mem_max_allocated_gib": _NUM, "mem_max_rank": (int,), "mem_reserved_gib": _NUM,
    "config_version": (int,), "samples": (list,), "total_steps": (int,), "logit_max": _NUM,
}
_NONFINITE = ("nan", "inf", "-inf")


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, _NUM) or value in _NONFINITE


def validate_record(rec: Any) -> list[str]:
    """Problems of one decoded telemetry record against what a producer must write; [] when it conforms.

    Stricter than what the daemon accepts (`ulyssesd.remediation.records.parse_record`, which needs only
    `kind`, `step` and `loss`): a producer writes `v` and the event fields the daemon's decisions read."""
    if not isinstance(rec, dict):
        return [f"record is {type(rec).__name__}, not an object"]
    problems = []
    if rec.get("v") != SCHEMA_VERSION:
        problems.append(f"v={rec.get('v')!r}: expected {SCHEMA_VERSION}")
    kind = rec.get("kind")
    if kind not in ("step", "event"):
        problems.append(f"kind={kind!r}: expected 'step' or 'event'")
    if "time" in rec and not _is_number(rec["time"]):
        problems.append(f"time={rec['time']!r}: expected a number")
    if "attempt" in rec and rec["attempt"] is not None and not (
            isinstance(rec["attempt"], int) and not isinstance(rec["attempt"], bool)):
        problems.append(f"attempt={rec['attempt']!r}: expected an integer")
    step = rec.get("step")
    if kind == "step":
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            problems.append(f"step={step!r}: expected a non-negative integer")
        if "loss" not in rec or not _is_number(rec["loss"]):
            problems.append(f"loss={rec.get('loss')!r}: expected a number or 'nan'/'inf'/'-inf'")
        for key, types in _STEP_FIELDS.items():
            value = rec.get(key)
            if value is None:
                continue
            if types == _NUM:
                if not _is_number(value):
                    problems.append(f"{key}={value!r}: expected a number")
            elif not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
                problems.append(f"{key}={value!r}: expected {types[0].__name__}")
        total = rec.get("total_steps")
        if isinstance(total, int) and not isinstance(total, bool) and total < 1:
            problems.append(f"total_steps={total!r}: expected a positive integer")
        by_source = rec.get("loss_by_source")
        if by_source is not None and not (isinstance(by_source, dict) and all(
                isinstance(k, str) and k and _is_number(v) for k, v in by_source.items())):
            problems.append(f"loss_by_source={by_source!r}: expected an object {{source name: loss}}")
        ratios = rec.get("update_ratio")
        if ratios is not None and not (isinstance(ratios, dict) and all(
                isinstance(k, str) and k and _is_number(v) for k, v in ratios.items())):
            problems.append(f"update_ratio={ratios!r}: expected an object {{layer group: ||delta W|| / ||W||}}")
        samples = rec.get("samples")
        if samples is not None and not (len(samples) == 2 and all(isinstance(x, int) for x in samples)
                                        and samples[0] <= samples[1]):
            problems.append(f"samples={samples!r}: expected [start, end) integers")
    elif kind == "event":
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            problems.append(f"step={step!r}: expected an integer or null")
        event = rec.get("event")
        if not isinstance(event, str) or not event:
            problems.append(f"event={event!r}: expected a non-empty string")
        elif event in ("checkpoint_saving", "checkpoint_saved", "checkpoint_loaded", "checkpoint_invalid") \
                and not isinstance(rec.get("tag"), str):
            problems.append(f"event {event} needs a string tag, got {rec.get('tag')!r}")
        elif event == "exiting" and rec.get("reason") not in EXIT_REASONS:
            problems.append(f"exiting reason={rec.get('reason')!r}: expected one of {EXIT_REASONS}")
        elif event == "control_applied" and not isinstance(rec.get("control_version"), int):
            problems.append(f"control_applied needs an integer control_version, got {rec.get('control_version')!r}")
        elif event == "fault_injected" and not isinstance(rec.get("fault"), str):
            problems.append(f"fault_injected needs a string fault kind, got {rec.get('fault')!r}")
    return problems


# --------------------------------------------------------------------------------- control
@dataclass
class ControlState:
    """The job's view of the daemon's live overrides."""

    version: int = -1
    """Last applied control.json version (-1: none yet)."""
    lr_scale: float = 1.0
    """Multiplier on the job's scheduled learning rate (absolute, not cumulative)."""
    gradient_clipping: float | None = None
    """Clip value to use; None = the job's own configured value."""
    suspect: bool = False
    """The daemon believes the current weights are bad: a SIGTERM must exit WITHOUT saving."""
    dump_stacks: bool = False
    """One-shot request to dump every thread's stack."""


def _integral(value: Any) -> int | None:
    """An int for JSON integers (1 or 1.0, as JSON Schema's "integer"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def parse_control(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """(fields, None) for a usable control.json document, (None, reason) otherwise. Null or absent keys are
    dropped ("no change"); unknown keys are ignored (a newer daemon may add some)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc}"
    if not isinstance(data, dict):
        return None, "top level is not an object"
    version = _integral(data.get("version"))
    if version is None:
        return None, f"'version' must be an integer, got {data.get('version')!r}"
    out: dict[str, Any] = {"version": version}
    for key, kind in (("lr_scale", (int, float)), ("gradient_clipping", (int, float)),
                      ("suspect", (bool,)), ("dump_stacks", (bool,))):
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if not isinstance(value, kind) or (kind != (bool,) and isinstance(value, bool)):
            return None, f"{key!r} has the wrong type: {value!r}"
        if key == "lr_scale" and not 0 < value <= 10:
            return None, f"lr_scale={value} outside (0, 10]"
        if key == "gradient_clipping" and value < 0:
            return None, f"gradient_clipping={value} is negative"
        out[key] = value
    return out, None


# ----------------------------------------------------------------------------- stack dumps
def stack_dump_path(run_dir: Path, attempt: int, rank: int | str) -> Path:
    """Where rank `rank` of attempt `attempt` appends its SIGUSR1 stack dumps."""
    return Path(run_dir) / STACK_DUMP_DIR / f"attempt-{attempt}-rank-{rank}.txt"


def stack_dump_files(run_dir: Path, attempt: int) -> dict[int, Path]:
    """rank -> its dump file, for one attempt (what the daemon reads after SIGUSR1)."""
    out = {}
    for f in (Path(run_dir) / STACK_DUMP_DIR).glob(f"attempt-{attempt}-rank-*.txt"):
        m = _STACK_DUMP_RE.match(f.name)
        if m:
            out[int(m.group(2))] = f
    return dict(sorted(out.items()))
