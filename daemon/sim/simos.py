"""The OS seam (`host/process.py: OSInterface`) over a simulated clock and a process table of `SimJob`s.

Wall time (`time`) and monotonic time (`monotonic`) advance together; a clock step moves only the wall clock,
as NTP does. `sleep` advances both. Nothing here reads the real clock.
"""

from __future__ import annotations

from pathlib import Path

from ulyssesd.daemon.host.process import ExitStatus, HostLoad, JobHandle
from ulyssesd.daemon.sim.disk import SimDisk
from ulyssesd.daemon.sim.job import JobModel, SimJob

#: Wall-clock start of every simulated run (2026-01-01 UTC): runs are comparable and replayable.
EPOCH = 1_767_225_600.0


class SimOS:
    """What the supervisor sees of the machine."""

    def __init__(self, disk: SimDisk, model: JobModel) -> None:
        self.m = 0.0
        self.wall_offset = EPOCH
        self.disk = disk
        self.model = model
        self.jobs: dict[int, SimJob] = {}
        self.next_pid = 1000
        self.spawned: list[tuple[float, int]] = []  # (monotonic time, pid) of every spawn

    # ------------------------------------------------------------------ clocks
    def time(self) -> float:
        return self.m + self.wall_offset

    def monotonic(self) -> float:
        return self.m

    def sleep(self, seconds: float) -> None:
        self.advance_to(self.m + max(0.0, seconds))

    def advance_to(self, m: float) -> None:
        """Time moves on; every live job does what it does until then."""
        self.m = max(self.m, m)
        for job in list(self.jobs.values()):
            if job.alive:
                job.advance(self.m)

    def step_wall_clock(self, seconds: float) -> None:
        self.wall_offset += seconds

    def host_load(self) -> HostLoad:
        return HostLoad([1.0, 1.0, 1.0], 16, [])

    # ------------------------------------------------------------------ processes
    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> JobHandle:
        pid = self.next_pid
        self.next_pid += 10
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.jobs[pid] = SimJob(pid, list(argv), dict(env), log_path, self.disk, self.model, self.m,
                                self.wall_offset)
        self.spawned.append((self.m, pid))
        return JobHandle(pid, self.time())

    def live_jobs(self) -> list[SimJob]:
        return [j for j in self.jobs.values() if j.alive]

    def start_time_of(self, pid: int) -> float | None:
        job = self.jobs.get(pid)
        return job.started_m + job.wall_offset if job is not None and job.alive else None

    def is_alive(self, job: JobHandle) -> bool:
        j = self.jobs.get(job.pid)
        return j is not None and j.alive

    def exit_status(self, job: JobHandle, exit_file: Path) -> ExitStatus | None:
        j = self.jobs.get(job.pid)
        if j is None:
            return ExitStatus(None, None, "unknown")
        return None if j.alive else j.status

    def job_pids(self, job: JobHandle, marker: tuple[str, str] | None = None) -> list[int]:
        j = self.jobs.get(job.pid)
        return [job.pid, *j.ranks] if j is not None and j.alive else []

    def rank_pids(self, job: JobHandle, module: str, marker: tuple[str, str] | None = None) -> list[int]:
        j = self.jobs.get(job.pid)
        return list(j.ranks) if j is not None and j.alive else []

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        sent = []
        for pid in pids:
            owner = next((j for j in self.jobs.values() if pid == j.pid or pid in j.ranks), None)
            if owner is None or not owner.alive:
                continue
            owner.signal(sig, self.m)
            sent.append(pid)
        return sent
