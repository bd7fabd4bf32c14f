"""Bounded attempt logs, and the job's last lines read before its exit is judged.

`{run_dir}/logs/attempt-N.log` is the job's stdout and stderr (opened O_APPEND by the daemon, the job's own
fd). A job that prints without bound (100 MiB before its first step line in one probe) filled the disk with
it. `rotate_if_big`: once the live log is over `[daemon] attempt_log_max_mib`, its last half (from a line
start) is copied to `attempt-N.log.1` (the previous rotation is replaced) and the live file is truncated in
place (copytruncate: the job keeps writing through its O_APPEND fd, at the new end). On disk an attempt's
output is then at most 1.5 times the cap, and the newest output is always kept. For a stdout-telemetry job the
log pump is drained first (through its interface: `pump()` until it has read what was there), so no step line
is lost to a rotation.

`output_read` / `drain_before_exit`: the pump reads 4 MiB per tick; a job that printed more than that before it
exited had its step lines judged after its exit ("COMPLETED at step None"). The exit waits, tick after tick
(the control socket answered between), while the pump makes progress on the ended attempt's output
(bounded: `EXIT_WAIT_MAX_S`), then the pump is run until it has caught up (bounded: `DRAIN_MAX_S`), then an
ended attempt's log over the cap keeps its last half.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.core.decisions import DecisionsRun
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.safety.regular_file import is_regular
from ulyssesd.daemon.telemetry import log_source

log = get_logger("ulyssesd.supervisor")

#: Longest time spent reading a job's remaining output in the tick its exit is handled.
DRAIN_MAX_S = 30.0
#: Longest an ended attempt's exit waits, tick after tick, for its output to be read while reading progresses.
EXIT_WAIT_MAX_S = 900.0
#: Time one tick may spend reading a big log before rotating it (the rotation waits while the pump is behind).
ROTATE_DRAIN_S = 2.0
_COPY_CHUNK = 1 << 20


class AttemptLogRun(DecisionsRun, Protocol):
    """What draining and trimming an attempt's log uses of the run (with the telemetry path's `DecisionsRun`)."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _log_size(sup: AttemptLogRun) -> int:
    """The size of what the pump reads: the log at its path, or, when that is gone or no regular file (a tmp
    cleaner's `rm`, a `mkdir -p` there), the file the pump holds open, which the job still writes."""
    if is_regular(sup.log_path):
        return _size(sup.log_path)
    src = getattr(sup, "_log_source", None)
    held = getattr(src, "_held", None) if src is not None and src.attempt == sup.attempt else None
    try:
        return os.fstat(held.fileno()).st_size if held is not None and not held.closed else -1
    except OSError:
        return -1


def _pump_caught_up(sup: AttemptLogRun, size: int) -> bool:
    src = getattr(sup, "_log_source", None)
    return src is None or src.attempt != sup.attempt or src.offset >= size


def drain_pump(sup: AttemptLogRun, budget_s: float) -> bool:
    """Run the stdout pump (through the telemetry step, so records are acted upon) until it has read the log
    to its current end, or `budget_s` ran out; True when caught up. Jobs whose telemetry is not their stdout
    have nothing to drain (True)."""
    if not log_source.stdout_source(sup.config) or not sup.attempt:
        return True
    from ulyssesd.daemon.core import decisions

    deadline = SYSTEM.monotonic() + budget_s
    while True:
        size = _log_size(sup)
        src = getattr(sup, "_log_source", None)
        if size <= 0 or (src is not None and src.attempt == sup.attempt and src.offset >= size):
            return True
        if SYSTEM.monotonic() >= deadline:
            return False
        before = src.offset if src is not None else None
        decisions.read_telemetry(sup)
        src = getattr(sup, "_log_source", None)
        if src is None or src.offset == before:
            return False  # no progress (a partial last line, an unreadable log): not caught up


def output_read(sup: AttemptLogRun) -> bool:
    """Before an ended attempt's exit is judged: has its output been read to its end (a stdout-telemetry job)?
    Each call reads on for up to ROTATE_DRAIN_S; False while output is left and that call made progress, so the
    loop answers the control socket between calls and the exit is judged at a later tick (a job that printed
    100 MiB before its step lines, on a loaded box, had them judged after its exit: "COMPLETED at step None").
    True once caught up, when reading makes no progress, or after EXIT_WAIT_MAX_S (then said in the log)."""
    src = getattr(sup, "_log_source", None)
    if src is not None and src.attempt == sup.attempt:
        src.job_ended = True  # its unterminated last line (a `\r`-only progress bar) is read now
    before = src.offset if src is not None else None
    if drain_pump(sup, ROTATE_DRAIN_S):
        return True
    src = getattr(sup, "_log_source", None)
    if src is None or src.offset == before:
        return True  # no progress (a partial last line, an unreadable log): judge with what was read
    now = SYSTEM.monotonic()
    if src.exit_wait_since is None:
        src.exit_wait_since = now
    if now - src.exit_wait_since < EXIT_WAIT_MAX_S:
        return False
    log.warning("ended attempt's output not read to its end in time; its exit is judged now", attempt=sup.attempt,
                waited_s=round(now - src.exit_wait_since, 1), read_to=src.offset)
    return True


def drain_before_exit(sup: AttemptLogRun) -> None:
    """Read the ended attempt's output to its end, then bound its log (`trim_ended`)."""
    src = getattr(sup, "_log_source", None)
    if src is not None and src.attempt == sup.attempt:
        src.job_ended = True  # its unterminated last line (a `\r`-only progress bar) is read now
    drain_pump(sup, DRAIN_MAX_S)
    trim_ended(sup)


def trim_ended(sup: AttemptLogRun) -> bool:
    """An ended attempt's log over the cap (a burst the per-tick rotation had no chance to see): keep its
    last half, from a line start, in the live file (the exit diagnosis and `ulyssesctl logs` read its end)."""
    cap = int(sup.dcfg.attempt_log_max_mib * (1 << 20))
    path = sup.log_path
    size = _size(path)
    if size <= cap or cap <= 0:
        return False
    keep = cap // 2
    tmp = path.with_name(path.name + ".trim.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(size - keep)
        first = src.readline(_COPY_CHUNK)
        if first and not first.endswith(b"\n"):
            dst.write(first)
        while chunk := src.read(_COPY_CHUNK):
            dst.write(chunk)
    os.replace(tmp, path)
    _shortened(sup, size - _size(path))
    log.warning("ended attempt's log over its cap: its last part kept", path=str(path), size=size,
                cap_mib=sup.dcfg.attempt_log_max_mib, kept_bytes=_size(path))
    return True


def _shortened(sup: AttemptLogRun, removed: int) -> None:
    src = getattr(sup, "_log_source", None)
    if src is not None and src.attempt == sup.attempt and hasattr(src, "log_shortened"):
        src.log_shortened(removed)


def rotate_if_big(sup: AttemptLogRun) -> bool:
    """Copy the live attempt log's last half to `.1` and truncate it when it is over the cap; True if done."""
    cap = int(sup.dcfg.attempt_log_max_mib * (1 << 20))
    path = sup.log_path
    size = _size(path)
    if size <= cap or cap <= 0:
        return False
    src = getattr(sup, "_log_source", None)
    if src is not None and src.attempt == sup.attempt and src.job_ended:
        return False  # ended, its exit waiting for the pump: `trim_ended` bounds it, keeping its tail live
    # The pump reads what is there first (no step line is lost to the rotation); while it has not caught up
    # the rotation waits for a later tick (the pump reads 4 MiB per read).
    if not drain_pump(sup, ROTATE_DRAIN_S):
        return False
    size = _size(path)
    keep = min(size, cap // 2)
    rotated = path.with_name(path.name + ".1")
    tmp = path.with_name(path.name + ".1.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(size - keep)
        first = src.readline(_COPY_CHUNK) if size > keep else b""  # start the copy at a line start
        if first and not first.endswith(b"\n"):
            dst.write(first)  # no newline within a MiB: keep the bytes rather than search further
        while chunk := src.read(_COPY_CHUNK):  # to the end as it is now, not as stat'ed: the truncate follows
            dst.write(chunk)
    os.replace(tmp, rotated)
    os.truncate(path, 0)  # the job's O_APPEND fd writes at the new end
    _shortened(sup, size)  # what the pump had read is gone from the live file; it reads on from the start
    log.warning("attempt log over its cap: its last part kept in the .1 file, the live log truncated",
                path=str(path), size=size, cap_mib=sup.dcfg.attempt_log_max_mib, kept_bytes=keep)
    return True
