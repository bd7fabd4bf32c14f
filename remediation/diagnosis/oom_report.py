"""The numbers of a CUDA OOM message (both torch formats): what was requested, allocated, reserved, free."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

MAX_GIB = float(1 << 20)   # a size above 1 PiB in an OOM message is garbage, not evidence
_UNITS = {"b": 1 / 2**30, "bytes": 1 / 2**30, "kib": 1 / 2**20, "mib": 1 / 2**10, "gib": 1.0, "tib": 2**10}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_REQUESTED = re.compile(r"Tried to allocate " + _SIZE, re.I)
# torch >= 2.5: "GPU 3 has a total capacity of 79.18 GiB of which 23.04 GiB is free. Including non-PyTorch
# memory, this process has 56.13 GiB memory in use. Of the allocated memory 51.20 GiB is allocated by PyTorch,
# [with 50.00 MiB allocated in private pools (e.g., CUDA Graphs),] and 3.41 GiB is reserved by PyTorch but
# unallocated." ("Process 105400 has ..." when another process is named).
_NEW_TOTAL = re.compile(r"total capacity of " + _SIZE + r" of which " + _SIZE + r" is free", re.I)
_NEW_IN_USE = re.compile(r"(?:this process|Process \d+) has " + _SIZE + r" memory in use", re.I)
_NEW_ALLOC = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", re.I)
_NEW_UNALLOC = re.compile(_SIZE + r" is reserved by PyTorch but unallocated", re.I)
# torch < 2.5: "(GPU 0; 39.59 GiB total capacity; 35.12 GiB already allocated; 1.04 GiB free; 36.80 GiB
# reserved in total by PyTorch)".
_OLD_TOTAL = re.compile(_SIZE + r" total capacity", re.I)
_OLD_ALLOC = re.compile(_SIZE + r" already allocated", re.I)
_OLD_FREE = re.compile(_SIZE + r" free", re.I)
_OLD_RESERVED = re.compile(_SIZE + r" reserved in total by PyTorch", re.I)


def _size(number: str, unit: str) -> float | None:
    v = float(number) * _UNITS[unit.lower()]
    return v if math.isfinite(v) and v <= MAX_GIB else None


def _gib(m: re.Match[str] | None) -> float | None:
    return None if m is None else _size(m.group(1), m.group(2))


@dataclass(frozen=True)
class OomReport:
    """The numbers of one CUDA OOM message, GiB (None where the message's format does not say)."""

    requested_gib: float
    total_gib: float | None
    free_gib: float | None
    allocated_gib: float | None             # allocated by PyTorch's caching allocator
    reserved_unallocated_gib: float | None  # reserved by the allocator but not allocated (fragmentation)
    in_use_gib: float | None                # the process's whole use, non-PyTorch memory included
    line: str

    def describe(self) -> str:
        def f(v: float | None) -> str:
            return "?" if v is None else f"{v:.2f}"
        return (f"CUDA OOM: requested {f(self.requested_gib)} GiB with {f(self.allocated_gib)} GiB allocated, "
                f"{f(self.reserved_unallocated_gib)} GiB reserved but unallocated, {f(self.free_gib)} GiB free "
                f"of {f(self.total_gib)} GiB")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "line"}


def parse_oom(lines: Iterable[str] | str) -> OomReport | None:
    """The first CUDA OOM message with a requested size among `lines` (either torch format); None if none."""
    for line in [lines] if isinstance(lines, str) else lines:
        if not isinstance(line, str) or "out of memory" not in line.lower():
            continue
        req = _gib(_REQUESTED.search(line))
        if req is None:
            continue
        total_free = _NEW_TOTAL.search(line)
        if total_free is not None:
            total, free = _size(total_free.group(1), total_free.group(2)), _size(total_free.group(3), total_free.group(4))
            return OomReport(req, total, free, _gib(_NEW_ALLOC.search(line)), _gib(_NEW_UNALLOC.search(line)),
                             _gib(_NEW_IN_USE.search(line)), line.strip())
        alloc, reserved = _gib(_OLD_ALLOC.search(line)), _gib(_OLD_RESERVED.search(line))
        unalloc = None if alloc is None or reserved is None else max(0.0, reserved - alloc)
        return OomReport(req, _gib(_OLD_TOTAL.search(line)), _gib(_OLD_FREE.search(line)), alloc, unalloc,
                         reserved, line.strip())
    return None
