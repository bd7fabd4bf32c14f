"""Typed telemetry records (docs/CONTRACTS.md "Telemetry records") parsed from JSON lines or dicts.

Replay feeds millions of these, so parsing is not pydantic: a step line is decoded by msgspec straight into a
typed wire struct (no intermediate dict; ~2.5x faster than orjson + checks), anything that struct rejects
(non-finite strings, events, errors) goes through `json.loads` + the validating path below.
Non-finite floats arrive as the strings "nan", "inf", "-inf". Only `kind`, `step` and `loss` are required
for a step record; everything else is optional and None when absent.

Bounds (one hostile or broken line must never crash the reader, the store or replay): a line is at most
`MAX_LINE_BYTES`, JSON nests at most `MAX_NESTING_DEPTH` levels, every integer field (and `step`, which must
be >= 0) fits a signed 64-bit SQLite INTEGER, `time` is finite (it is the detectors' clock). A line outside
them raises RecordError naming the bound, like any other bad line; error messages show values through a
bounded repr.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

_fast_loads: Callable[[str | bytes], Any]  # orjson's or the stdlib's: both take str or bytes
try:  # optional: orjson parses a telemetry line ~3x faster than the stdlib (replay of millions of records)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = json.loads

try:  # optional: msgspec decodes a plain step line into a typed struct without building a dict
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - depends on the environment
    _msgspec = None  # type: ignore[assignment]  # absent: the `_msgspec is not None` checks below skip it

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "NaN": math.nan, "Infinity": math.inf,
              "-Infinity": -math.inf}


MAX_LINE_BYTES = 1 << 20  # real records are < 1 KiB; an event's fields (e.g. an error text) stay far below
MAX_NESTING_DEPTH = 32  # real records nest 2 levels; deep JSON costs recursion in json, repr and the store
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # SQLite INTEGER: a larger step overflows at the insert


class RecordError(ValueError):
    """A telemetry line or dict is not a valid record; the message names the problem."""


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 2, 60, 60, 40


def bounded_repr(val: Any) -> str:
    """repr for error messages: bounded in length and depth (a plain repr of deep JSON recurses)."""
    return _repr.repr(val)


def nesting_depth_exceeds(obj: Any, limit: int = MAX_NESTING_DEPTH) -> bool:
    """True when decoded JSON `obj` nests containers deeper than `limit` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | tuple))
    return False


@dataclass(slots=True)
class StepRecord:
    step: int
    loss: float
    time: float | None = None
    attempt: int | None = None
    grad_norm: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    step_time_s: float | None = None
    step_time_max_s: float | None = None
    slowest_rank: int | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    mem_allocated_gib: float | None = None
    mem_max_allocated_gib: float | None = None
    mem_max_rank: int | None = None
    mem_reserved_gib: float | None = None
    samples: tuple[int, int] | None = None
    config_version: int | None = None
    # {data source: mean loss of its samples in this step} (optional; docs/CONTRACTS.md `loss_by_source`).
    loss_by_source: dict[str, float] | None = None
    # Early-warning signals (optional; docs/CONTRACTS.md): the largest |output logit| of the step, and the
    # update-to-weight ratio ||delta W|| / ||W|| of the step per layer group.
    logit_max: float | None = None
    update_ratio: dict[str, float] | None = None
    v: int = 1
    kind: str = "step"


@dataclass(slots=True)
class EventRecord:
    event: str
    step: int | None = None
    time: float | None = None
    attempt: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    v: int = 1
    kind: str = "event"


Record = StepRecord | EventRecord

_FLOATS = ("grad_norm", "lr", "loss_scale", "step_time_s", "step_time_max_s", "tokens_per_s",
           "mem_allocated_gib", "mem_max_allocated_gib", "mem_reserved_gib", "logit_max")
_INTS = ("attempt", "slowest_rank", "tokens", "mem_max_rank", "config_version")


def _float(d: dict[str, Any], key: str, required: bool = False) -> float | None:
    val = d.get(key)
    if val is None:
        if required:
            raise RecordError(f"step record is missing required field {key!r}")
        return None
    if type(val) is float:  # fast path
        return val
    if isinstance(val, bool):
        raise RecordError(f"field {key!r} must be a number, got bool {val!r}")
    if isinstance(val, int):
        try:
            return float(val)
        except OverflowError:
            raise RecordError(f"field {key!r} is too large for a float: {bounded_repr(val)}") from None
    if isinstance(val, str):
        try:
            return _NONFINITE[val]
        except KeyError:
            raise RecordError(f"field {key!r} must be a number or one of \"nan\"/\"inf\"/\"-inf\", "
                              f"got string {bounded_repr(val)}") from None
    raise RecordError(f"field {key!r} must be a number, got {type(val).__name__} {bounded_repr(val)}")


def _int(d: dict[str, Any], key: str) -> int | None:
    val = d.get(key)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, int):
        if isinstance(val, float) and val.is_integer():
            val = int(val)
        else:
            raise RecordError(f"field {key!r} must be an integer, got {type(val).__name__} {bounded_repr(val)}")
    if not INT64_MIN <= val <= INT64_MAX:
        raise RecordError(f"field {key!r} is out of the 64-bit integer range: {bounded_repr(val)}")
    return val


def _step(d: dict[str, Any], required: bool) -> int | None:
    if "step" not in d or d["step"] is None:
        if required:
            raise RecordError("step record is missing required field 'step'")
        return None
    val = _int(d, "step")
    assert val is not None
    if val < 0:
        raise RecordError(f"field 'step' must be >= 0, got {bounded_repr(val)}")
    return val


_NUM = frozenset((float, int, type(None)))
_INT = frozenset((int, type(None)))


# Positional order of StepRecord's fields (kwargs matching 20 names per record is measurably slow).
_ORDER = ("step", "loss", "time", "attempt", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s",
          "step_time_max_s", "slowest_rank", "tokens", "tokens_per_s", "mem_allocated_gib", "mem_max_allocated_gib",
          "mem_max_rank", "mem_reserved_gib", "samples", "config_version", "loss_by_source", "logit_max",
          "update_ratio")
_FLOAT_AT = itemgetter(*(_ORDER.index(k) for k in (*_FLOATS, "time")))
_INT_AT = itemgetter(*(_ORDER.index(k) for k in _INTS))


def _fast_step(d: dict[str, Any]) -> StepRecord | None:
    """The common case (plain numbers): positional construction and C-level type checks. Returns None to
    fall back to the validating path, which names the problem."""
    # Any: the checks below establish each field's type before StepRecord(*vals) is built.
    vals: tuple[Any, ...] = tuple(map(d.get, _ORDER))
    step, loss, sk, smp = vals[0], vals[1], vals[7], vals[17]
    if vals[19] is not None or vals[21] is not None:   # {name: value} fields: the validating path checks them
        return None
    if (type(step) is not int or step < 0 or type(loss) not in _NUM or loss is None
            or not _NUM.issuperset(map(type, _FLOAT_AT(vals))) or not _INT.issuperset(map(type, _INT_AT(vals)))
            or (sk is not None and type(sk) is not bool)):
        return None
    v = d.get("v", 1)
    if type(v) is not int:
        return None
    # Out-of-range ints (a float field's int too: float() of a huge int overflows) and a non-finite `time`
    # take the validating path, which names the problem.
    if any(type(x) is int and not INT64_MIN <= x <= INT64_MAX for x in vals) or not -INT64_MAX <= v <= INT64_MAX:
        return None
    t = vals[2]
    if t is not None and not math.isfinite(t):
        return None
    rec = StepRecord(*vals)
    if smp is not None:
        if (type(smp) is not list or len(smp) != 2 or type(smp[0]) is not int or type(smp[1]) is not int
                or not (INT64_MIN <= smp[0] <= INT64_MAX and INT64_MIN <= smp[1] <= INT64_MAX)):
            return None
        rec.samples = (smp[0], smp[1])
    if type(loss) is int:
        rec.loss = float(loss)
    if v != 1:
        rec.v = v
    return rec


_step_decode: Any = None
if _msgspec is not None:
    from typing import Annotated, Literal

    # Range checks run inside the decoder (C); a value outside them takes the dict path, which names it.
    _I64 = Annotated[int, _msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
    # Ints stay ints, as on the dict path; a float field's huge int (10**400: float() overflows) is out of range.
    _F = _I64 | float | None
    _OptI64 = _I64 | None

    class _WireStep(_msgspec.Struct, kw_only=True, gc=False):
        """A plain step line, fields in StepRecord's positional order; `kind` is required and must be "step".
        Strict decoding rejects everything the dict path would convert or reject (bools as numbers, floats
        as ints, "nan" strings, short `samples`): those lines take the dict path, which decides."""
        step: Annotated[int, _msgspec.Meta(ge=0, le=INT64_MAX)]
        loss: float
        time: _F = None
        attempt: _OptI64 = None
        grad_norm: _F = None
        lr: _F = None
        loss_scale: _F = None
        skipped: bool | None = None
        step_time_s: _F = None
        step_time_max_s: _F = None
        slowest_rank: _OptI64 = None
        tokens: _OptI64 = None
        tokens_per_s: _F = None
        mem_allocated_gib: _F = None
        mem_max_allocated_gib: _F = None
        mem_max_rank: _OptI64 = None
        mem_reserved_gib: _F = None
        samples: tuple[_I64, _I64] | None = None
        config_version: _OptI64 = None
        loss_by_source: dict[str, float] | None = None
        logit_max: _F = None
        update_ratio: dict[str, float] | None = None
        v: _I64 = 1
        kind: Literal["step"]

    assert _WireStep.__struct_fields__ == (*_ORDER, "v", "kind")
    _step_decode = _msgspec.json.Decoder(_WireStep).decode
    _astuple = _msgspec.structs.astuple
    _DecodeError = _msgspec.DecodeError


MAX_SOURCES = 256   # per record: a blend of more named datasets is not a per-step loss view


def _loss_by_source(val: Any, key: str = "loss_by_source", what: str = "{source: loss}") -> dict[str, float]:
    if not isinstance(val, dict):
        raise RecordError(f"field {key!r} must be an object {what}, got {bounded_repr(val)}")
    if len(val) > MAX_SOURCES:
        raise RecordError(f"field {key!r} names {len(val)} entries; at most {MAX_SOURCES}")
    out: dict[str, float] = {}
    for name, loss in val.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise RecordError(f"field {key!r} needs non-empty names (<= 200 characters), "
                              f"got {bounded_repr(name)}")
        got = _float({"v": loss}, "v", required=True)
        assert got is not None
        out[name] = got
    return out


def parse_record(d: Any) -> Record:
    """Build a StepRecord or EventRecord from a decoded telemetry dict; raises RecordError."""
    if type(d) is dict and d.get("kind") == "step":
        rec = _fast_step(d)
        if rec is not None:
            return rec
    if not isinstance(d, dict):
        raise RecordError(f"record must be a JSON object, got {type(d).__name__}")
    kind = d.get("kind")
    if kind is None:
        raise RecordError("record is missing required field 'kind' (\"step\" or \"event\")")
    if nesting_depth_exceeds(d):
        raise RecordError(f"record nests deeper than {MAX_NESTING_DEPTH} levels")
    if kind == "step":
        loss = _float(d, "loss", required=True)
        step = _step(d, required=True)
        assert loss is not None and step is not None
        rec = StepRecord(step=step, loss=loss)
        if "time" in d:
            rec.time = _float(d, "time")
            if rec.time is not None and not math.isfinite(rec.time):
                raise RecordError(f"field 'time' must be a finite number (epoch seconds), got {bounded_repr(rec.time)}")
        for key in _FLOATS:
            if key in d:
                setattr(rec, key, _float(d, key))
        for key in _INTS:
            if key in d:
                setattr(rec, key, _int(d, key))
        sk = d.get("skipped")
        if sk is not None:
            if not isinstance(sk, bool):
                raise RecordError(f"field 'skipped' must be true/false, got {bounded_repr(sk)}")
            rec.skipped = sk
        smp = d.get("samples")
        if smp is not None:
            if (not isinstance(smp, list | tuple) or len(smp) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in smp)):
                raise RecordError(f"field 'samples' must be [start, end) integers, got {bounded_repr(smp)}")
            if not all(INT64_MIN <= x <= INT64_MAX for x in smp):
                raise RecordError(f"field 'samples' is out of the 64-bit integer range: {bounded_repr(smp)}")
            rec.samples = (smp[0], smp[1])
        by_source = d.get("loss_by_source")
        if by_source is not None:
            rec.loss_by_source = _loss_by_source(by_source)
        ratios = d.get("update_ratio")
        if ratios is not None:
            rec.update_ratio = _loss_by_source(ratios, "update_ratio", "{layer group: ||delta W|| / ||W||}")
        if "v" in d:
            rec.v = _int(d, "v") or 1
        return rec
    if kind == "event":
        name = d.get("event")
        if not isinstance(name, str) or not name:
            raise RecordError(f"event record needs a non-empty string field 'event', got {bounded_repr(name)}")
        extra = {k: v for k, v in d.items() if k not in ("v", "kind", "event", "step", "time", "attempt")}
        t = _float(d, "time")
        if t is not None and not math.isfinite(t):
            raise RecordError(f"field 'time' must be a finite number (epoch seconds), got {bounded_repr(t)}")
        return EventRecord(event=name, step=_step(d, required=False), time=t,
                           attempt=_int(d, "attempt"), fields=extra, v=_int(d, "v") or 1)
    raise RecordError(f"field 'kind' must be \"step\" or \"event\", got {bounded_repr(kind)}")


def parse_line(line: str | bytes) -> Record:
    """Parse one telemetry JSON line (str or bytes); raises RecordError naming the problem."""
    if len(line) > MAX_LINE_BYTES:
        raise RecordError(f"line is {len(line)} bytes long; telemetry lines are at most {MAX_LINE_BYTES}")
    text = line.strip()
    if not text:
        raise RecordError("empty line")
    if _step_decode is not None:
        try:
            vals = _astuple(_step_decode(text))
        except (_DecodeError, RecursionError):  # msgspec recurses into an unknown field's deep JSON
            pass  # not a plain step line: the dict path parses it or names the problem
        else:  # msgspec never yields a non-finite float from JSON (NaN literals and 1e400 are errors)
            return StepRecord(*vals)
    try:
        d = _fast_loads(text)
    except Exception:  # noqa: BLE001 - orjson is strict (NaN literals, depth > 1024) or absent: the stdlib decides
        try:
            d = json.loads(text)
        except RecursionError:
            raise RecordError(f"JSON nests deeper than {MAX_NESTING_DEPTH} levels") from None
        except ValueError as exc:
            shown = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
            snippet = shown if len(shown) <= 60 else shown[:57] + "..."
            what = (f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError)
                    else f"{type(exc).__name__}: {exc}")
            raise RecordError(f"not JSON ({what}): {snippet!r}") from None
    return parse_record(d)


def is_finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def finite_or_none(x: float | None) -> float | None:
    """The value when it is a finite number, else None (for JSON and tables: NaN and inf are not numbers there)."""
    return x if x is not None and math.isfinite(x) else None
