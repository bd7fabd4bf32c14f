"""Read the faulthandler stack dumps of a hung attempt: which ranks wait inside a collective, and which
rank they wait for.

A rank whose training thread sits in a collective (torch.distributed, deepspeed.comm, ZeRO-3's parameter
fetch, the Ulysses all-to-all) is a victim; a rank that is somewhere else (a data loader, a sleep, a Python
loop) while others wait is the one they wait for. When any rank waits in a collective the attempt's
diagnosis is `nccl_timeout` (the daemon killed it long before NCCL's own watchdog would have said so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_THREAD_RE = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):", re.M)
_FRAME_RE = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
# Frames that mean "waiting for the other ranks".
_COLLECTIVE_PATH = re.compile(r"torch/distributed/|deepspeed/comm/|deepspeed/sequence/|deepspeed/runtime/zero/")
_COLLECTIVE_FUNC = re.compile(r"^(all_reduce|all_gather\w*|_all_gather\w*|reduce_scatter\w*|_reduce_scatter\w*|"
                              r"all_to_all\w*|broadcast\w*|barrier|monitored_barrier|send|recv|wait)$")
_TRAINING = "ulyssesd/training/"


@dataclass(frozen=True)
class RankStack:
    rank: int | None  # None when the dump could not be attributed to a rank
    in_collective: bool
    where: str  # innermost frame of the training thread, "path:line in func"
    collective_frame: str | None  # the outermost collective frame, if any


@dataclass(frozen=True)
class HangReading:
    label: str | None  # "nccl_timeout" or None (no rank in a collective: not a communication hang)
    ranks: tuple[RankStack, ...]
    waited_for: tuple[int, ...]  # ranks outside any collective while others wait
    summary: str


def _frames(block: str) -> list[tuple[str, str, str]]:
    return [(m["path"], m["line"], m["func"]) for m in _FRAME_RE.finditer(block)]


def _training_threads(text: str) -> list[list[tuple[str, str, str]]]:
    """The threads running the training loop (one per rank in the text; most recent call first), else the
    dump's current thread, else the first thread with Python frames."""
    starts = [m.start() for m in _THREAD_RE.finditer(text)]
    # No thread header at all (a chatty hang's log excerpt, a truncated dump): the whole text is one block.
    blocks = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)] if starts else [text]
    # The data prefetch thread (training/data/loader.py) runs training code too, but never a collective: not the loop.
    training = [f for f in map(_frames, blocks) if any(_TRAINING in p for p, _, _ in f)
                and not any(p.endswith("training/data/loader.py") and fn == "_fill" for p, _, fn in f)]
    if training:
        return training
    current = [b for b in blocks if b.startswith("Current thread")]
    for block in current + blocks:
        frames = _frames(block)
        if frames:
            return [frames]
    return []


def _is_collective(frame: tuple[str, str, str]) -> bool:
    return bool(_COLLECTIVE_PATH.search(frame[0]) or _COLLECTIVE_FUNC.match(frame[2]))


def read_rank(text: str, rank: int | None) -> RankStack:
    """One rank's dump (or, with rank None, a log excerpt holding several ranks' dumps)."""
    threads = _training_threads(text)
    waiting = [t for t in threads if any(map(_is_collective, t))]
    other = [t for t in threads if t not in waiting]
    shown = (other or waiting or [[]])[0]
    where = f"{shown[0][0]}:{shown[0][1]} in {shown[0][2]}" if shown else "(no Python frame)"
    outer = None
    if waiting:
        coll = [f for f in waiting[0] if _is_collective(f)]
        outer = f"{coll[-1][0]}:{coll[-1][1]} in {coll[-1][2]}"
    return RankStack(rank=rank, in_collective=bool(waiting), where=where, collective_frame=outer)


def read_hang(per_rank: dict[int, str] | None = None, unattributed: str = "") -> HangReading:
    """Classify a hang from per-rank dumps (preferred) or from one log excerpt with every rank mixed in.
    Never raises: the dumps are whatever a hung job printed, and a reading that fails must not stop the
    hang's own remediation (the restart); it is reported as unreadable instead."""
    try:
        return _read_hang(per_rank, unattributed)
    except Exception as exc:  # noqa: BLE001 - any text at all; the relaunch must go on
        return HangReading(None, (), (), f"the stack dumps could not be read ({type(exc).__name__}: {exc})")


def _read_hang(per_rank: dict[int, str] | None, unattributed: str) -> HangReading:
    ranks = tuple(read_rank(t, r) for r, t in sorted((per_rank or {}).items()) if t.strip())
    if not ranks and unattributed.strip():
        ranks = (read_rank(unattributed, None),)
    waiting = [r for r in ranks if r.in_collective]
    waited_for = tuple(r.rank for r in ranks if not r.in_collective and r.rank is not None) if waiting else ()
    if not ranks:
        return HangReading(None, (), (), "no stack dump was written")
    if not waiting:
        return HangReading(None, ranks, (), "no rank is inside a collective: "
                           + "; ".join(f"rank {'?' if r.rank is None else r.rank}: {r.where}" for r in ranks))
    who = ("ranks " if len(waiting) > 1 else "rank ") + ", ".join(str(r.rank) for r in waiting)
    if waiting[0].rank is None:
        who = "the ranks"  # one log with every rank's dump mixed in: no attribution
    parts = [f"{who} wait inside a collective ({waiting[0].collective_frame})"]
    if waited_for:
        others = [r for r in ranks if r.rank in waited_for]
        parts.append("; ".join(f"rank {r.rank} is outside any collective at {r.where}" for r in others)
                     + " - the rank the others wait for")
    return HangReading("nccl_timeout", ranks, waited_for, "; ".join(parts))
