"""The host's own OOM evidence for a SIGKILLed attempt: the cgroup's `memory.events` and the kernel log.

A bare SIGKILL is diagnosed `host_oom_killed` at medium confidence (the kernel OOM killer is its usual sender);
before acting on it the daemon asks the host (`ulyssesd.remediation.diagnosis.refine_with_host` decides):

- cgroup v2 `memory.events` of the daemon's cgroup (its jobs are its descendants): the `oom_kill` counter.
  The count at each attempt's end is kept in `<run_dir>/host_oom.json`, so the next attempt compares with it;
  with no earlier count, 0 means "no OOM kill" and a positive count is unknown (it may predate the attempt).
- the kernel log (`/dev/kmsg`, readable by root or with CAP_SYSLOG): OOM-killer records stamped after the
  attempt started (kmsg stamps are CLOCK_MONOTONIC microseconds, the clock of `SYSTEM.monotonic()`).

Every read is bounded (bytes, records, a time budget) and failing reads yield None ("unreadable"), never an
exception: the check must not be able to break crash handling.
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulyssesd.daemon.clock import SYSTEM

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = Path("/dev/kmsg")
_OOM_KERNEL = re.compile(r"invoked oom-killer|Out of memory: Kill|oom-kill:|Memory cgroup out of memory|oom_reaper")


@dataclass(frozen=True)
class HostOomEvidence:
    """What the host says about OOM kills during one attempt (None = could not be read)."""

    oom_kills: int | None  # new oom_kill events of the cgroup during the attempt
    kernel_lines: list[str] | None  # OOM-killer lines of the kernel log during the attempt
    detail: str  # where it was read from, for the incident's evidence

    def to_dict(self) -> dict:
        return {"oom_kills": self.oom_kills, "kernel_lines": self.kernel_lines, "detail": self.detail}


def own_cgroup_dir(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> Path | None:
    """The cgroup v2 directory of this process ("0::/system.slice/ulyssesd.service"), or None."""
    try:
        for line in proc_cgroup.read_text().splitlines()[:64]:
            if line.startswith("0::"):
                d = root / line[3:].lstrip("/")
                return d if (d / "memory.events").exists() else None
    except OSError:
        return None
    return None


def read_oom_kill(events: Path) -> int | None:
    """The `oom_kill` counter of a cgroup's memory.events file, or None when unreadable."""
    try:
        text = events.read_text()[:4096]
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def read_kernel_oom_lines(since_monotonic: float, kmsg: Path = KMSG, max_records: int = 50_000,
                          budget_s: float = 0.5, max_lines: int = 5) -> list[str] | None:
    """OOM-killer records of the kernel log stamped at or after `since_monotonic`; None when unreadable."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    out: list[str] = []
    deadline = SYSTEM.monotonic() + budget_s
    try:
        for _ in range(max_records):
            if SYSTEM.monotonic() > deadline:
                break
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break  # no more records
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # a record was overwritten while reading: go on with the next
                return None
            if not rec:
                break
            head, _, msg = rec.decode("utf-8", "replace").partition(";")
            fields = head.split(",")
            try:
                stamp_s = int(fields[2]) / 1e6
            except (IndexError, ValueError):
                continue
            if stamp_s >= since_monotonic and _OOM_KERNEL.search(msg):
                out.append(msg.strip()[:300])
                if len(out) >= max_lines:
                    break
    finally:
        os.close(fd)
    return out


class HostOomProbe:
    """Reads the host's OOM evidence at an attempt's end (the real host; tests pass their own paths)."""

    def __init__(self, state_file: Path, cgroup_dir: Path | None = None, kmsg: Path = KMSG):
        self.state_file = state_file
        self.cgroup_dir = cgroup_dir if cgroup_dir is not None else own_cgroup_dir()
        self.kmsg = kmsg

    def _last_count(self) -> int | None:
        try:
            data = json.loads(self.state_file.read_text())
            return int(data["oom_kill"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def evidence(self, since_monotonic: float) -> HostOomEvidence:
        count = read_oom_kill(self.cgroup_dir / "memory.events") if self.cgroup_dir is not None else None
        kills: int | None = None
        if count is not None:
            last = self._last_count()
            kills = count - last if last is not None and count >= last else (0 if count == 0 else None)
            try:
                self.state_file.write_text(json.dumps({"oom_kill": count}))
            except OSError:
                pass  # next attempt compares with nothing: it says "unknown" rather than a wrong count
        lines = read_kernel_oom_lines(since_monotonic, self.kmsg)
        where = [f"{self.cgroup_dir}/memory.events oom_kill={count}" if count is not None else "memory.events unreadable",
                 f"kernel log: {len(lines)} OOM line(s)" if lines is not None else "kernel log unreadable"]
        return HostOomEvidence(kills, lines, "; ".join(where))


def evidence_for_attempt(sup: Any) -> dict[str, Any] | None:
    """The host's OOM evidence for the supervisor's ended attempt, as a dict for refine_with_host; None when
    there is no real host to ask (a test's fake OS without a probe)."""
    probe = getattr(sup, "host_oom_probe", None)
    if probe is None:
        from ulyssesd.daemon.host.process import RealOS

        if not isinstance(sup.os, RealOS):
            return None
        probe = HostOomProbe(sup.run_dir / "host_oom.json")
    # kmsg stamps and the attempt's start are both CLOCK_MONOTONIC; 5 s of slack for the spawn itself.
    return probe.evidence(max(0.0, sup.attempt_started_mono - 5.0)).to_dict()
