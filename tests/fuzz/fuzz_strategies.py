"""Hypothesis strategies for hostile input: JSON-ish values at the edges (huge ints, non-finite floats, deep
nesting, odd strings), telemetry-shaped records, control requests, and byte-level mutations of valid lines.

Drawing is kept cheap (hypothesis spends most of a fuzz run drawing): nested values come from a pool built
once from a fixed seed, scalars from small sampled sets plus hypothesis's own integers/floats/text."""

from __future__ import annotations

import json
import random

from hypothesis import strategies as st

EDGE_INTS = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, 10**400]
EDGE_FLOATS = [0.0, -0.0, 1e-320, 1e308, -1e308, 1.5, float("inf"), float("-inf"), float("nan")]
EDGE_STRINGS = ["", "nan", "inf", "-inf", "NaN", "Infinity", "step", "event", "\x00", "\ud800", "é", "a" * 300,
                "\n", "../../x", '"', "\\"]
_EDGES = [None, True, False, *EDGE_INTS, *EDGE_FLOATS, *EDGE_STRINGS]


def _nested_pool(n: int = 300, seed: int = 13) -> list:
    rng = random.Random(seed)

    def value(depth: int):
        r = rng.random()
        if depth > 4 or r < 0.5:
            return rng.choice(_EDGES)
        if r < 0.75:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["a", "kind", "step", "", "é", "id"]): value(depth + 1) for _ in range(rng.randrange(4))}

    return [value(0) for _ in range(n)]


NESTED = _nested_pool()
SCALARS = st.one_of(st.sampled_from(_EDGES), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6))
VALUES = st.one_of(SCALARS, st.sampled_from(NESTED))
STEP_KEYS = ["step", "loss", "time", "attempt", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s",
             "step_time_max_s", "slowest_rank", "tokens", "tokens_per_s", "mem_allocated_gib",
             "mem_max_allocated_gib", "mem_max_rank", "mem_reserved_gib", "samples", "config_version", "v"]
EVENT_KEYS = ["event", "step", "time", "attempt", "tag", "reason", "seconds", "fields", "v"]


def _dumps(obj) -> bytes:
    # allow_nan: NaN/Infinity literals are what a careless writer emits; the parser must cope with them.
    return json.dumps(obj, allow_nan=True).encode()


def deep(depth: int, inner: str = "1") -> bytes:
    return (b"[" * depth) + inner.encode() + (b"]" * depth)


@st.composite
def record_dicts(draw):
    kind = draw(st.sampled_from(["step", "step", "event", None, "Step", 3]))
    keys = STEP_KEYS if kind == "step" else EVENT_KEYS
    d = {k: draw(VALUES) for k in draw(st.lists(st.sampled_from(keys), max_size=6, unique=True))}
    if kind == "step" and draw(st.booleans()):  # mostly-valid step records reach deep into the checks
        d.setdefault("step", draw(st.one_of(st.integers(0, 10**6), st.sampled_from(EDGE_INTS))))
        d.setdefault("loss", draw(st.one_of(st.floats(), st.sampled_from([*EDGE_FLOATS, "nan"]))))
    if kind is not None:
        d["kind"] = kind
    return d


_DEPTHS = [31, 32, 33, 100, 1025, 5000]


@st.composite
def telemetry_lines(draw) -> bytes:
    """One line (no newline): a record, a deeply nested one, random bytes, or a mutated valid line."""
    how = draw(st.integers(0, 5))
    if how <= 1:
        return _dumps(draw(record_dicts()))
    if how == 2:
        nest = deep(draw(st.sampled_from(_DEPTHS))).decode()
        key = draw(st.sampled_from(["note", "step", "loss", "event", "samples"]))
        kind = draw(st.sampled_from(["step", "event"]))
        return f'{{"kind": "{kind}", "event": "x", "step": 1, "loss": 1, "{key}": {nest}}}'.encode()
    if how == 3:
        return draw(st.binary(max_size=80)).replace(b"\n", b" ")
    line = bytearray(_dumps(draw(record_dicts())))
    for _ in range(draw(st.integers(1, 3))):  # byte-level mutations: cut, insert, flip
        if not line:
            break
        at = draw(st.integers(0, len(line) - 1))
        op = draw(st.integers(0, 2))
        if op == 0:
            del line[at:]
        elif op == 1:
            line[at:at] = draw(st.sampled_from([b"{", b"[", b"\"", b"\xff", b"9" * 30, b",", b"NaN", b"\x00"]))
        else:
            line[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(line).replace(b"\n", b" ")


CMDS = st.sampled_from(["status", "pause", "resume", "stop", "restart", "ack", "boom", "Pause", "", "x" * 40,
                        "../x", 3, None])


@st.composite
def control_requests(draw) -> bytes:
    """One control request line (no newline): an envelope with hostile values, deep nesting, random bytes or a
    mutated valid one."""
    how = draw(st.integers(0, 4))
    if how <= 1:
        env = {}
        for key in draw(st.lists(st.sampled_from(["cmd", "cmd", "args", "v", "deadline", "extra"]), max_size=4,
                                 unique=True)):
            if key == "cmd":
                env[key] = draw(CMDS)
            elif key == "args":
                env[key] = draw(st.one_of(st.dictionaries(st.sampled_from(["id", "by", "x"]), VALUES, max_size=2),
                                          VALUES))
            elif key == "deadline":
                env[key] = draw(st.one_of(SCALARS, st.sampled_from([1e10, 1.0])))
            else:
                env[key] = draw(SCALARS)
        return _dumps(env)
    if how == 2:
        depth = draw(st.sampled_from([7, 8, 9, 100, 1001, 30_000]))
        return b'{"cmd": "status", "args": {"x": ' + deep(depth) + b"}}"
    if how == 3:
        return draw(st.binary(max_size=60)).replace(b"\n", b" ")
    return _dumps({"cmd": draw(CMDS), "args": {"id": draw(SCALARS)}})
