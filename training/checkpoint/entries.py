"""What one entry of a checkpoint directory is, for the budget's categories (budget.py): a checkpoint (its
step, complete or not), a set-aside copy, or neither. The built-in job's tags are `step-NNNNNNNN` directories;
a command job's are its own names (files and folders), recognised by the caller's `Recogniser` (the daemon's,
the same it watches the job's saves with)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .files import step_of_tag, validate_tag

#: A set-aside copy: a rolled-back or quarantined tag, `{tag}.{kind}-{time}[-n]`, where `{time}` is when it was set
#: aside: Unix seconds (what ulyssesd writes, `step-00000050.corrupt-1764444444`) or ISO-like UTC
#: (`step-00000050.rolledback-20261207T121503Z`, copies set aside by hand or by other tools); `-n` tells apart
#: two set aside in the same second.
SET_ASIDE_RE = re.compile(r"^(step-\d{8,})\.(corrupt|rolledback)-(\d+|\d{8}T\d{6}Z)(?:-\d+)?$")
#: A set-aside copy of any checkpoint name (a command job's own: `ckpt_00050.pt.rolledback-<time>`).
SET_ASIDE_ANY_RE = re.compile(r"^(.+)\.(corrupt|rolledback)-(\d+|\d{8}T\d{6}Z)(?:-\d+)?$")
#: Recognises one entry as a checkpoint: (step, complete), or None when it is none (a command job's naming).
Recogniser = Callable[[Path], "tuple[int, bool] | None"]


class Kind(NamedTuple):
    """A checkpoint (`tag`) or a set-aside copy, with its step when known."""

    set_aside: bool
    step: int | None
    complete: bool


def entry_kind(p: Path, recognise: Recogniser | None) -> Kind | None:
    """What `p` is (None: neither a checkpoint nor a set-aside copy); `recognise` None: the built-in job's tags."""
    if recognise is None:
        step = step_of_tag(p.name)
        if step is not None and p.is_dir():
            return Kind(False, step, validate_tag(p, verify_checksums=False)[0])
        m = SET_ASIDE_RE.match(p.name)
        return Kind(True, step_of_tag(m.group(1)), False) if m and p.is_dir() else None
    if SET_ASIDE_ANY_RE.match(p.name):
        return Kind(True, None, False)   # never a checkpoint, whatever its name still looks like
    try:
        own = recognise(p)
    except OSError:
        return None   # removed or unreadable meanwhile: not counted as a checkpoint
    return None if own is None else Kind(False, own[0], own[1])
