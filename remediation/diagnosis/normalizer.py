"""Normalise a log before reading it: every launcher's and logger's line prefix off, one message per line.

The same failure reaches us in many framings: torchrun's `[rank3]:`, torchrun --tee's `[default3]:`, srun -l's `3: `,
mpirun's `[1,3]<stderr>:`, DeepSpeed's `[2024-07-24 08:45:13,616] [INFO] [engine.py:123:step]`, fairseq/hydra's
`2020-10-18 02:34:05 | INFO | train_inner |`, NeMo's `[NeMo W 2023-04-19 21:40:25 experimental:27]`, journald's
`Dec 07 11:40:01 host python[1234]:`, dmesg's `[12345.678901]`, a console copy's `[1743] ` line numbers, grep's
`job.o52401091:` file names, bare timestamps; ANSI colour codes; carriage-return progress bars; Windows paths.
`normalize` strips all of them, keeps each line's number in the tail (the number every fact cites), the rank the
prefix named, and marks the lines many ranks repeat so that a reader can take each message once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ulyssesd.remediation.diagnosis.model import DiagnosisConfig
from ulyssesd.remediation.diagnosis.scanner import normalise as _cut_and_split

# Each prefix pattern is tried at the start of the (remaining) line, repeatedly, in this order. Every one needs its own
# frame ([...], a trailing ':' or '|', a fixed shape) so that a message is never eaten.
_PREFIXES: tuple[tuple[str, re.Pattern], ...] = (
    ("line_number", re.compile(r"^\[\d{1,7}\] ")),  # a console copy's "[1743] " (not torchrun's "[0]:")
    ("grep_file", re.compile(r"^[\w.\-/]+\.(?:o|e|out|err|log|txt)\d*:(?=\S)")),  # grep's "job.o52401091:"
    ("journald", re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ [\w.@/\-]+(?:\[\d+\])?: ")),
    ("dmesg", re.compile(r"^\[\s*\d+\.\d+\]\s")),
    ("bracket_date", re.compile(r"^\[\d{4}-\d\d-\d\d[ T][\d:.,]+\]\s*")),  # DeepSpeed "[2024-07-24 08:45:13,616]"
    ("iso_time", re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?(?:\s*\|)?\s+")),
    ("time", re.compile(r"^\d\d:\d\d:\d\d(?:[.,]\d+)?(?:\s*\|)?\s+")),
    ("level", re.compile(r"^(?:\[(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL|FATAL)\]|(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)"
                         r"\s*\|\s*[\w.\-]+\s*\|)\s*")),  # "[INFO] " / fairseq "INFO | fairseq.trainer |"
    ("src_loc", re.compile(r"^\[[\w.\-/]+\.py:\d+(?::[\w<>]+)?\]\s*")),  # DeepSpeed "[engine.py:123:step]"
    ("nemo", re.compile(r"^\[NeMo [IWEDC] [^\]]{0,60}\]\s*")),
    ("rank", re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")),  # torchrun / torchrun --tee
    ("mpirun", re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>:\s?")),
    ("srun", re.compile(r"^(\d{1,5}): (?=\S|\s+\S)")),  # srun -l "3: " (needs the space: not "0:00:01")
    ("loguru", re.compile(r"^\s*> (?=File \")")),  # loguru marks the failing frame with "> "
)
# One anchored try for "does any prefix start here": most lines have none, and pay for one match instead of fourteen.
_ANY_PREFIX = re.compile("|".join(f"(?:{rx.pattern})" for _, rx in _PREFIXES))
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# A Windows path ("C:\Users\me\env\lib\site-packages\torch\serialization.py"): read as a POSIX one, so that the
# module of a frame is found the same way on every OS.
_WIN_PATH = re.compile(r"\b[A-Za-z]:\\[^\s\"'<>|]*")
_DIGITS = re.compile(r"\d+")
# Processes writing to one console at once (multiprocessing's spawned workers, mp.spawn) split an exception line: its
# type glued before another process's frame ('OSError  File "heap.py", line 55, in __setstate__') and its message on a
# later line (': [WinError 1455] The paging file is too small ...'). The type is held (per rank) and given back to the
# next line that is only ': message', so the exception line is read whole.
_GLUED_TYPE = re.compile(r'^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Fault))(\s+File ".*)$')
_ORPHAN_MESSAGE = re.compile(r"^\s*:\s*\S")


@dataclass(frozen=True)
class Line:
    """One line of the tail with every prefix stripped."""

    no: int  # 1-based number of the line in the normalised tail: what facts cite
    text: str  # the message, prefixes stripped, Windows paths read as POSIX
    raw: str  # the line as it stands in the tail (ANSI stripped)
    rank: int | None  # the rank the prefix named (torchrun, srun -l, mpirun), if any
    prefixes: tuple[str, ...]  # the kinds of prefix removed, outermost first
    repeat_of: int | None = None  # the number of an earlier line carrying the same message from another rank

    @property
    def key(self) -> str:
        """The message with its numbers blanked: the same for every rank's copy of it."""
        return _DIGITS.sub("#", self.text.strip())


def strip_prefixes(line: str) -> tuple[str, int | None, tuple[str, ...]]:
    """(message, rank, prefix kinds) of one line."""
    rank: int | None = None
    kinds: list[str] = []
    rest = line
    for _ in range(8):  # prefixes nest (time, then rank, then level...): a bounded number of passes
        if not _ANY_PREFIX.match(rest):
            break
        for kind, rx in _PREFIXES:
            m = rx.match(rest)
            if m and m.end() > 0:
                if kind in ("rank", "mpirun", "srun") and m.groups():
                    rank = int(m.group(1))
                kinds.append(kind)
                rest = rest[m.end():]
                break
        else:
            break
    if "\\" in rest and ":\\" in rest:
        rest = _WIN_PATH.sub(lambda m: m.group(0).replace("\\", "/"), rest)
    return rest, rank, tuple(kinds)


def normalize(text: str, cfg: DiagnosisConfig | None = None) -> list[Line]:
    """The tail (cut to `cfg.max_bytes` / `max_lines`, ANSI stripped, carriage returns as line breaks) as Lines.

    A line whose message (numbers blanked) another rank already printed among the last `dedup_window` lines is
    marked `repeat_of` that line: eight ranks' identical tracebacks read as one. An exception line that interleaved
    processes split (type glued to another's frame, message on a later line) is rejoined on the message's line."""
    cfg = cfg or DiagnosisConfig()
    out: list[Line] = []
    last_seen: dict[str, int] = {}
    split_types: dict[int | None, list[str]] = {}
    for i, raw in enumerate(_cut_and_split(text, cfg)):
        raw = _ANSI.sub("", raw)
        msg, rank, kinds = strip_prefixes(raw)
        glued = _GLUED_TYPE.match(msg)
        if glued:
            split_types.setdefault(rank, []).append(glued.group(1))
            msg = glued.group(2)
        elif split_types.get(rank) and _ORPHAN_MESSAGE.match(msg):
            msg = split_types[rank].pop(0) + msg.strip()
        ln = Line(i + 1, msg.rstrip(), raw, rank, kinds)
        key = ln.key
        prev = last_seen.get(key)
        if prev is not None and key and rank is not None and i + 1 - prev <= cfg.dedup_window \
                and out[prev - 1].rank != rank:
            ln = Line(ln.no, ln.text, ln.raw, rank, kinds, repeat_of=prev)
        else:
            last_seen[key] = i + 1
        out.append(ln)
    return out


def unique(lines: list[Line]) -> list[Line]:
    """The lines without other ranks' repeats."""
    return [ln for ln in lines if ln.repeat_of is None]
