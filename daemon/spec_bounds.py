"""Every number in a run spec bounded to something physical.

The sections' own fields carry lower bounds (and some upper ones); a number with no upper bound let
`backoff_base_s = inf` park a run in "BACKOFF (relaunch in infs)" forever and accepted `steps = 1e20`,
`lr = 1e300`, `gradient_clipping = inf` and `nproc_per_node = 100000`. Here every numeric value of the spec
(any section, lists of tables included) must be finite and within the field's physical range: its own
`le`/`lt` when the field has one, else an entry of `CEILINGS`, else a rule by the kind of quantity its name
says (seconds, GiB, a count of steps, a ratio). The problem names the field, the value and the range.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import annotated_types as at
from pydantic import BaseModel

DAY_S = 86400.0
#: Upper bounds of fields whose range the name alone does not say (dotted as in the spec file).
CEILINGS: dict[str, float] = {
    "launcher.nnodes": 100_000,  # the largest machines have tens of thousands of nodes
    "launcher.nproc_per_node": 1024,  # GPUs (or CPU ranks) of one node
    "parallel.world_size": 10_000_000,
    "parallel.sequence_parallel_size": 1 << 20,
    "train.steps": 1e12,
    "train.warmup_steps": 1e12,
    "train.lr": 10.0,
    "train.min_lr": 10.0,
    "train.weight_decay": 100.0,
    "train.gradient_clipping": 1e6,
    "train.seq_len": 1 << 24,
    "train.micro_batch_size": 1 << 20,
    "train.gradient_accumulation_steps": 1 << 20,
    "train.seed": 2**63 - 1,
    "data.seed": 2**63 - 1,
    "model.hidden_size": 1 << 20,
    "model.ffn_hidden_size": 1 << 22,
    "model.num_layers": 1 << 16,
    "model.num_attention_heads": 1 << 16,
    "model.vocab_size": 1 << 24,
    "model.max_seq_len": 1 << 24,
    "model.rope_theta": 1e12,
    "model.init_std": 10.0,
    "precision.loss_scale.min_loss_scale": 2.0**64,
    "job.total_steps": 1e12,
}
#: By the quantity a name says, for fields in neither place above.
SECONDS_MAX = 30 * DAY_S  # a timeout, grace, period or backoff longer than a month is a typo
GIB_MAX = float(1 << 20)  # 1 PiB
COUNT_MAX = 1e12  # steps, windows, restarts, batches
RATIO_MAX = 1e6  # ratios, factors, multipliers, thresholds
NUMBER_MAX = 1e12


def _ceiling_by_name(name: str, is_int: bool) -> float:
    if name.endswith("_s"):
        return SECONDS_MAX
    if name.endswith("_gib"):
        return GIB_MAX
    if is_int:
        return COUNT_MAX
    if any(w in name for w in ("ratio", "factor", "multiplier", "rel", "threshold", "allowance", "clip",
                                "floor", "ceiling", "magnitude", "weight", "min_prev", "noise")):
        return RATIO_MAX
    return NUMBER_MAX


def _field_bounds(field: Any) -> tuple[float | None, float | None]:
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, at.Ge | at.Gt):
            lo = float(m.ge if isinstance(m, at.Ge) else m.gt)  # type: ignore[arg-type]
        if isinstance(m, at.Le | at.Lt):
            hi = float(m.le if isinstance(m, at.Le) else m.lt)  # type: ignore[arg-type]
    return lo, hi


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (X, X | None, list[X], tuple[X, ...])."""
    out: list[type[BaseModel]] = []
    stack = [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            out.append(a)
        stack.extend(typing.get_args(a))
    return out


def _is_int(annotation: Any) -> bool:
    return int in typing.get_args(annotation) or annotation is int


def bound_of(dotted: str, field: Any) -> tuple[float | None, float]:
    """(lower, upper) bound of a numeric field: its own, else CEILINGS, else by its name."""
    lo, hi = _field_bounds(field)
    if hi is None:
        hi = CEILINGS.get(dotted)
    if hi is None:
        hi = _ceiling_by_name(dotted.rsplit(".", 1)[-1], _is_int(field.annotation))
    return lo, hi


def _numbers(value: Any) -> Iterator[float | int]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, int | float) and not isinstance(v, bool):
                yield v


def problems(data: Mapping[str, Any], sections: Mapping[str, type[BaseModel]]) -> list[str]:
    """One line per number in `data` (the spec file's tables) that is not finite or above its range.
    `sections` maps a top-level table to its model; list fields of a model are walked per item."""
    out: list[str] = []

    def walk(table: Mapping[str, Any], model: type[BaseModel], prefix: str) -> None:
        for key, value in table.items():
            field = model.model_fields.get(key)
            if field is None:
                continue  # an unknown key: the section's own validation names it
            dotted = f"{prefix}{key}"
            subs = _models(field.annotation)
            if subs and isinstance(value, Mapping):
                walk(value, subs[0], dotted + ".")
                continue
            if subs and isinstance(value, list):
                for item in value:
                    if isinstance(item, Mapping):
                        walk(item, subs[0], dotted + ".")
                continue
            for number in _numbers(value):
                lo, hi = bound_of(dotted, field)
                shown_range = f"[{'-inf' if lo is None else f'{lo:g}'}, {hi:g}]"
                if isinstance(number, float) and not math.isfinite(number):
                    out.append(f"{dotted} = {number}: not a finite number; give a value in {shown_range}")
                elif number > hi:  # a value below the field's own lower bound is named by its validation
                    shown = (f"{number:g}" if isinstance(number, float) or abs(number) < 10**15
                             else f"a {len(str(abs(number)))}-digit integer")
                    out.append(f"{dotted} = {shown} is outside its physical range {shown_range}")

    for name, model in sections.items():
        table = data.get(name)
        if isinstance(table, Mapping):
            walk(table, model, f"{name}.")
        elif isinstance(table, list):  # [[faults]]
            for item in table:
                if isinstance(item, Mapping):
                    walk(item, model, f"{name}.")
    return out
