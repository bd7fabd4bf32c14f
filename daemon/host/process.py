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
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from ulyssesd.daemon.clock import SYSTEM, Clock

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


class OSInterface(Clock, Protocol):
    """The host as the supervisor sees it: the clock (time, monotonic, sleep) and process control."""

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


#: The variables a launcher sets in each rank's environment (torchrun, the DeepSpeed launcher, the local
#: launcher of launcher.py): what tells a rank of a `[job] kind = "command"` job, whose command line is the user's.
RANK_ENV_VARS = ("RANK", "LOCAL_RANK")
#: What a launcher sets per rank (torchrun, the DeepSpeed launcher, the local launcher): a process whose values
#: all equal its parent's only inherited them (a helper), it was not launched as a rank.
LAUNCH_ENV_VARS = (*RANK_ENV_VARS, "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                   "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CROSS_RANK")
#: `python -m X` of the programs that start ranks but are none themselves (they inherit or set RANK too).
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher.runner",
                              "deepspeed.launcher.launch", "ulyssesd.daemon.job.wrapper",
                              "ulyssesd.daemon.job.slurm_watch"})
#: Launcher executables, as the program or the script the interpreter runs (`python /venv/bin/torchrun`).
LAUNCHER_PROGRAMS = frozenset({"torchrun", "deepspeed", "srun", "mpirun"})


@dataclass(frozen=True)
class ProcInfo:
    """What `pick_ranks` needs to know of one process of the job."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    launch_vars: tuple[str | None, ...] | None  # LAUNCH_ENV_VARS' values; None when the environment is unreadable

    @property
    def has_rank_vars(self) -> bool:
        return self.launch_vars is not None and any(v is not None for v in self.launch_vars[:len(RANK_ENV_VARS)])


def launch_vars_of(env: dict[str, str]) -> tuple[str | None, ...]:
    return tuple(env.get(name) for name in LAUNCH_ENV_VARS)


def is_launcher(cmdline: tuple[str, ...] | list[str]) -> bool:
    """torchrun, the DeepSpeed launcher, srun or the daemon's wrapper/watcher (by module or program name)."""
    parts = list(cmdline)
    for i, part in enumerate(parts[:-1]):
        if part == "-m" and parts[i + 1] in LAUNCHER_MODULES:
            return True
    return any(os.path.basename(part) in LAUNCHER_PROGRAMS for part in parts[:2])


def catches_signal(pid: int, sig: int) -> bool | None:
    """Whether `pid` has a handler installed for `sig` (Linux: /proc/PID/status `SigCgt`); None when unknown."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def pick_ranks(procs: list[ProcInfo], module: str) -> list[int]:
    """The ranks among a job's processes. A candidate is no launcher and either runs `module` (the built-in
    job, also when its environment cannot be read) or carries torch's rank variables, set for it (its
    LAUNCH_ENV_VARS differ from its parent's, or its parent is outside the scan: the local launcher's wrapper):
    any job kind; a process that merely inherited them, like a launcher's helper when the daemon's own
    environment holds RANK, is none. A rank is a candidate whose parent chain inside the job holds no other
    candidate: a rank's DataLoader workers, compile workers or shell-outs inherit its environment and command
    line and are not ranks (their exit is not a lost rank). Known limit: a rank's child orphaned by the
    rank's death (parent now outside the job) looks like a rank of its own until it exits."""
    by_pid = {p.pid: p for p in procs}

    def candidate(p: ProcInfo) -> bool:
        if is_launcher(p.cmdline):
            return False
        if any(module in part for part in p.cmdline):
            return True
        parent = by_pid.get(p.ppid)
        return p.has_rank_vars and (parent is None or parent.launch_vars != p.launch_vars)

    like = {p.pid for p in procs if candidate(p)}
    out = []
    for pid in sorted(like):
        seen, parent = {pid}, by_pid[pid].ppid
        while parent in by_pid and parent not in like and parent not in seen:
            seen.add(parent)
            parent = by_pid[parent].ppid
        if parent not in like:
            out.append(pid)
    return out


class RealOS:
    """The real thing: subprocess + psutil + os.kill."""

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen] = {}

    # The clock part of the seam is the daemon's one clock (daemon/clock.py).
    def time(self) -> float:
        return SYSTEM.time()

    def monotonic(self) -> float:
        return SYSTEM.monotonic()

    def sleep(self, seconds: float) -> None:
        SYSTEM.sleep(seconds)

    def host_load(self, interval_s: float = HOST_CPU_INTERVAL_S) -> HostLoad:
        procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
        for p in procs:  # the first cpu_percent call only starts the interval
            try:
                p.cpu_percent(None)
            except psutil.Error:
                continue
        self.sleep(interval_s)
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
        start = self.start_time_of(proc.pid) or self.time()
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
        """The training ranks among the job's processes (`pick_ranks`: torch's rank variables in the
        environment, or `module` on the command line; never a launcher, never a rank's own child)."""
        procs = []
        for pid in self.job_pids(job, marker):
            if pid == job.pid:
                continue  # the wrapper: it carries the local launcher's RANK=0 but is no rank
            try:
                p = psutil.Process(pid)
                cmd, ppid = p.cmdline(), p.ppid()
            except psutil.Error:
                continue
            try:
                env: dict[str, str] | None = p.environ()
            except psutil.Error:  # another user's process: its command line still tells a builtin rank
                env = None
            procs.append(ProcInfo(pid, ppid, tuple(cmd), None if env is None else launch_vars_of(env)))
        return pick_ranks(procs, module)

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        """Send `sig` to each pid; returns those it was sent to. A SIGUSR1 (the stack-dump request) goes only
        to processes that catch it: its default action kills, and a user's script without the client's
        handler must not die of a request for its stacks."""
        sent = []
        for pid in pids:
            if sig == signal.SIGUSR1 and catches_signal(pid, sig) is False:
                continue
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                pass
        return sent
