"""The OS seam: spawning the job, finding its processes, signalling them, and the clocks.

Everything the supervisor does to the operating system goes through `OSInterface`, so the fault logic
(hang -> dump -> TERM -> KILL, crash loops, backoff, re-adoption) runs in unit tests against `FakeOS`
(tests/daemon) with a fake clock, and against `RealOS` in the end-to-end tests.

A job is identified by `JobHandle(pid, start_time)`: the wrapper's pid plus its kernel start time
(psutil `create_time`), so a recycled pid is never mistaken for our job after a daemon restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

#: How long `RealOS.host_load` measures CPU use over (psutil's cpu_percent needs an interval).
HOST_CPU_INTERVAL_S = 0.2


@dataclass(frozen=True)
class JobHandle:
    """A launched attempt: the wrapper process (session + group leader)."""

    pid: int
    start_time: float

    @property
    def pgid(self) -> int:
        return self.pid


@dataclass(frozen=True)
class ExitStatus:
    """How an attempt ended. `signal` set when the launcher was killed by a signal."""

    returncode: int | None
    signal: int | None
    source: str  # "wait" (we reaped it), "file" (the wrapper's exit file), "unknown" (no record)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.signal is None

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"killed by {name}"
        if self.returncode is None:
            return "exit status unknown"
        return f"exit code {self.returncode}"


@dataclass(frozen=True)
class HostLoad:
    """What the host is busy with (slow-step evidence): load average, CPUs, every process's CPU use."""

    load_avg: list[float]  # 1, 5 and 15 minute load averages
    cpu_count: int | None  # logical CPUs (None if the OS does not say)
    processes: list[tuple[float, int, str]]  # (cpu_percent, pid, command line or name), busiest first


class OSInterface(Protocol):
    def time(self) -> float: ...
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...
    def host_load(self) -> HostLoad: ...
    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> JobHandle: ...
    def is_alive(self, job: JobHandle) -> bool: ...
    def exit_status(self, job: JobHandle, exit_file: Path) -> ExitStatus | None: ...
    def job_pids(self, job: JobHandle, marker: tuple[str, str] | None = None) -> list[int]: ...
    def rank_pids(self, job: JobHandle, module: str, marker: tuple[str, str] | None = None) -> list[int]: ...
    def signal_pids(self, pids: list[int], sig: int) -> list[int]: ...
    def start_time_of(self, pid: int) -> float | None: ...


def read_exit_file(path: Path) -> ExitStatus | None:
    """The status the job wrapper recorded in `path` (`attempts/N.exit`); None when absent or damaged."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):  # damaged: as if absent (the status is then unknown), never a crash
        return None
    code, sig = data.get("returncode"), data.get("signal")
    return ExitStatus(code if type(code) is int else None, sig if type(sig) is int else None, "file")


class RealOS:
    """The real thing: subprocess + psutil + os.kill."""

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen] = {}

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def host_load(self, interval_s: float = HOST_CPU_INTERVAL_S) -> HostLoad:
        procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
        for p in procs:  # the first cpu_percent call only starts the interval
            try:
                p.cpu_percent(None)
            except psutil.Error:
                continue
        time.sleep(interval_s)
        rows = []
        for p in procs:
            try:
                rows.append((p.cpu_percent(None), p.pid, " ".join(p.info.get("cmdline") or [])[:120] or p.info["name"]))
            except psutil.Error:
                continue
        rows.sort(reverse=True)
        return HostLoad(list(os.getloadavg()), psutil.cpu_count(), rows)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> JobHandle:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab", buffering=0) as log:
            # New session: the job is its own process group and outlives the daemon (re-adoption).
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self._children[proc.pid] = proc
        start = self.start_time_of(proc.pid) or time.time()
        return JobHandle(proc.pid, start)

    def start_time_of(self, pid: int) -> float | None:
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None

    def _same_process(self, job: JobHandle) -> psutil.Process | None:
        try:
            p = psutil.Process(job.pid)
            if abs(p.create_time() - job.start_time) > 1.0:
                return None  # pid recycled: not our job
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except psutil.Error:
            return None

    def is_alive(self, job: JobHandle) -> bool:
        child = self._children.get(job.pid)
        if child is not None:
            return child.poll() is None
        return self._same_process(job) is not None

    def exit_status(self, job: JobHandle, exit_file: Path) -> ExitStatus | None:
        """None while the job runs; afterwards the best record of how it ended."""
        child = self._children.get(job.pid)
        if child is not None:
            rc = child.poll()
            if rc is None:
                return None
            self._children.pop(job.pid, None)
            from_file = read_exit_file(exit_file)
            if from_file is not None:
                return from_file
            # The wrapper itself was killed (SIGKILL of the group): no file, the wait status says so.
            return ExitStatus(None, -rc, "wait") if rc < 0 else ExitStatus(rc, None, "wait")
        if self._same_process(job) is not None:
            return None
        return read_exit_file(exit_file) or ExitStatus(None, None, "unknown")

    def job_pids(self, job: JobHandle, marker: tuple[str, str] | None = None) -> list[int]:
        """Every live process of the attempt: the wrapper's descendants, its process group, and any
        process carrying the attempt's environment marker (ranks torchrun put in their own sessions
        that lost their parent)."""
        pids: set[int] = set()
        root = self._same_process(job)
        if root is not None:
            pids.add(root.pid)
            try:
                pids.update(c.pid for c in root.children(recursive=True))
            except psutil.Error:
                pass
        me = os.getpid()
        for p in psutil.process_iter(["pid", "status"]):
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if os.getpgid(p.pid) == job.pgid and root is not None:
                    pids.add(p.pid)
                    continue
            except OSError:
                continue
            if marker is not None:
                try:
                    env = p.environ()
                except psutil.Error:
                    continue
                if env.get(marker[0]) == marker[1]:
                    pids.add(p.pid)
        alive = []
        for pid in sorted(pids):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        return alive

    def rank_pids(self, job: JobHandle, module: str, marker: tuple[str, str] | None = None) -> list[int]:
        """The training ranks among the job's processes (their command line runs `module`)."""
        out = []
        for pid in self.job_pids(job, marker):
            try:
                cmd = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if pid != job.pid and any(module in part for part in cmd) and not any(
                    "torchrun" in part or "job_wrapper" in part or "torch.distributed.run" in part for part in cmd):
                out.append(pid)
        return out

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        sent = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                pass
        return sent
