"""An attempt is "gone" only on more than one sign, confirmed over a short window.

A daemon that re-adopts a job (or watches one it did not spawn) learns of its end from the process table:
the wrapper's pid with its start time. One such reading is not enough: a restarted daemon once read `alive:
false` 10 ms before the job printed its next step, ended the attempt "exit status unknown" and relaunched a
healthy job (a full restart for nothing on eight GPUs). So when the process check finds no process and the
wrapper left no exit file (status "unknown"), the verdict waits `CONFIRM_S` and is dropped as soon as any
sign of life shows:

- the wrapper's exit file appears: that is the record of the end (taken at once);
- the attempt's output (its log, its telemetry file) grows: the job is alive, whatever the process check said;
- a process of the attempt is found by its process group or its environment marker (its ranks).

Only a process check that stays negative for the whole window, with no output and no process of the attempt,
makes the attempt gone with an unknown status.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.process import ExitStatus, read_exit_file
from ulyssesd.daemon.ports import HostSide, RunFiles

log = get_logger("ulyssesd.supervisor")

#: How long "no process, no exit file" must hold, with no output and no process of the attempt, to be "gone".
CONFIRM_S = 3.0


class LivenessRun(RunFiles, HostSide, Protocol):
    """What confirming an attempt is gone uses of the run: its files, the OS seam and the job."""


@dataclass
class GoneCheck:
    """The pending "gone" verdict of one attempt."""

    since: float | None = None  # monotonic time the process check first said gone
    output: int = -1  # the attempt's output size then
    overruled: int = 0  # times a sign of life overruled the process check (logged the first time)


def _output_size(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def confirm(sup: LivenessRun, status: ExitStatus, check: GoneCheck) -> ExitStatus | None:
    """`status` when the end is certain; None while the verdict waits or a sign of life overruled it."""
    if status.source != "unknown":
        check.since = None
        return status
    job = sup.job
    now = sup.os.monotonic()
    size = _output_size([sup.log_path, sup.telemetry_path])
    if check.since is None:
        check.since, check.output = now, size
        log.info("the attempt's process is not found and it left no exit file; confirming before 'gone'",
                 attempt=sup.attempt, pid=job.pid if job else None, confirm_s=CONFIRM_S)
        return None
    from_file = read_exit_file(sup.exit_file)
    if from_file is not None:
        check.since = None
        return from_file
    alive_sign = None
    if size != check.output:
        alive_sign = "its output grew"
    elif job is not None and sup.os.job_pids(job, sup.marker()):
        alive_sign = "a process of the attempt runs"
    if alive_sign is not None:
        check.overruled += 1
        if check.overruled == 1:
            log.warning("the process check said the attempt is gone but it is alive; supervising on",
                        attempt=sup.attempt, sign=alive_sign)
        check.since, check.output = now, size
        return None
    if now - check.since < CONFIRM_S:
        return None
    check.since = None
    return status
