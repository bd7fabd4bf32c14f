"""Operating-system error codes that name a cause, in every OS's framing: memory exhaustion and full disks.

A host that runs out of memory says so in its own OS's words: Linux's ENOMEM (`[Errno 12] Cannot allocate memory`, at
fork/spawn or mmap), Windows' commit limit (`[WinError 1455] The paging file is too small for this operation to
complete`, `ERROR_COMMITMENT_LIMIT`, `ERROR_NOT_ENOUGH_MEMORY`), macOS's `mach_vm_map(size=N) failed`. A full disk
likewise (ENOSPC / EDQUOT / `ERROR_DISK_FULL`). The error *number* and its symbolic name are the structure; the tables
below turn each into patterns (with the lowercase literals the scanner prefilters on) that `rules.py` adds to its
label's rule, so every framing — a Python `OSError`, a C++ `what()`, a shell message — is read the same way.
"""

from __future__ import annotations

import re

# POSIX errno: (label, symbolic name, the strerror text glibc prints).
ERRNO: dict[int, tuple[str, str, str]] = {
    12: ("host_oom_killed", "ENOMEM", "Cannot allocate memory"),
    28: ("disk_full", "ENOSPC", "No space left on device"),
    122: ("disk_full", "EDQUOT", "Disk quota exceeded"),
}
# Windows system error codes (WinError N / GetLastError): (label, symbolic name, the message Windows prints).
WINERROR: dict[int, tuple[str, str, str]] = {
    8: ("host_oom_killed", "ERROR_NOT_ENOUGH_MEMORY", "Not enough memory resources are available to process this command"),
    14: ("host_oom_killed", "ERROR_OUTOFMEMORY", "Not enough storage is available to complete this operation"),
    1455: ("host_oom_killed", "ERROR_COMMITMENT_LIMIT", "The paging file is too small for this operation to complete"),
    39: ("disk_full", "ERROR_HANDLE_DISK_FULL", "The disk is full"),
    112: ("disk_full", "ERROR_DISK_FULL", "There is not enough space on the disk"),
}
# Other OSes' words for the same exhaustion with no number to read (macOS's allocator).
OTHER: dict[str, tuple[tuple[str, str], ...]] = {
    "host_oom_killed": ((r"mach_vm_map\(size=\d+\) failed", "mach_vm_map("),
                        (r"malloc: can't allocate region", "can't allocate region")),
}


def _message_head(msg: str) -> str:
    """The first words of a message: a message a line wraps or a search excerpt cuts still matches."""
    return " ".join(msg.split()[:6])


def patterns(label: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(regexes, lowercase prefilter literals) that read this label's OS error codes, names and messages."""
    rx: list[str] = []
    keys: list[str] = []
    errnos = [n for n, (lb, _, _) in ERRNO.items() if lb == label]
    wins = [n for n, (lb, _, _) in WINERROR.items() if lb == label]
    if errnos:
        alt = "|".join(str(n) for n in errnos)
        rx.append(rf"\[Errno (?:{alt})\]|\berrno[:= ]\s*(?:{alt})\b")
        keys += [f"errno {n}" for n in errnos] + [f"errno: {n}" for n in errnos] + [f"errno={n}" for n in errnos]
    if wins:
        alt = "|".join(str(n) for n in wins)
        rx.append(rf"\[?WinError (?:{alt})\b")
        keys += [f"winerror {n}" for n in wins]
    for table in (ERRNO, WINERROR):
        for lb, name, msg in table.values():
            if lb != label:
                continue
            rx.append(rf"\b{name}\b")
            keys.append(name.lower())
            head = _message_head(msg)
            if table is WINERROR:  # glibc's strerror texts are already in the label's rule
                rx.append(re.escape(head))
                keys.append(head.lower())
    for pattern, key in OTHER.get(label, ()):
        rx.append(pattern)
        keys.append(key)
    return tuple(rx), tuple(keys)
