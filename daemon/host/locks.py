"""One supervisor per state dir and per run.

Two daemons driving one job both send it SIGTERM, both relaunch it and both record FAILED. The control
socket cannot prevent it (its file can be removed, or a second daemon can be given another socket_path
and `--run-id` of the live run), so each daemon holds, for its whole life:

- `{state_dir}/ulyssesd.lock`: an exclusive `flock`, taken before anything else is touched;
- `{run_dir}/supervisor.lock`: the same for the run it supervises (another state dir or socket path
  that reaches the same run through a shared database still finds it taken).

`flock` locks belong to the open file: the kernel drops them when the daemon dies, however it dies (no
stale lock to clean up after SIGKILL), and the fd is close-on-exec, so the training job the daemon
spawns never inherits it (the next daemon can re-adopt the job). The lock files are never unlinked
(unlinking a flock'ed file races with the next locker); their content names the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.store.permissions import FILE_MODE

STATE_LOCK_NAME = "ulyssesd.lock"
RUN_LOCK_NAME = "supervisor.lock"


class LockHeld(RuntimeError):
    """Another live process holds the lock; `holder` is what it wrote into the lock file."""

    def __init__(self, message: str, path: Path, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.path = path
        self.holder = holder


def _holder_text(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (it has not written its pid yet)"
    since = holder.get("started")
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)) if isinstance(since, int | float) else "?"
    parts = [f"pid {holder.get('pid', '?')}", f"since {when}"]
    for key in ("run_id", "socket"):
        if holder.get(key):
            parts.append(f"{key.replace('_', ' ')} {holder[key]}")
    return f"another ulyssesd ({', '.join(parts)})"


@dataclass
class FileLock:
    """An exclusive flock held on `path` until `release()` (or the process's death)."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only fd of the open file drops the flock
            self.fd = -1


def read_holder(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes()[:4096] or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def acquire(path: str | os.PathLike[str], what: str, info: dict[str, Any]) -> FileLock:
    """Take the exclusive lock on `path` now or raise LockHeld naming the holder; never waits."""
    p = Path(path)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = read_holder(p)
        raise LockHeld(f"{_holder_text(holder)} already supervises {what} (lock {p}); "
                       f"this daemon exits and changes nothing", p, holder) from None
    except BaseException:
        os.close(fd)
        raise
    body = json.dumps({"pid": os.getpid(), "started": SYSTEM.time(), **info}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, body + b"\n", 0)
    return FileLock(p, fd)


@dataclass
class InstanceLocks:
    """The locks of one daemon process: its state dir's, then its run's (see the module doc)."""

    state_dir: Path
    info: dict[str, Any] = field(default_factory=dict)
    held: list[FileLock] = field(default_factory=list)

    def lock_state_dir(self) -> None:
        self.held.append(acquire(self.state_dir / STATE_LOCK_NAME, f"state dir {self.state_dir}", self.info))

    def lock_run(self, run_dir: Path, run_id: str) -> None:
        """Called by the supervisor once it knows the run (created or re-adopted), before it acts on it.
        Idempotent: a lock this process already holds is not taken again (a second flock on a new open file
        of the same path would fail against our own lock and call this daemon "another ulyssesd"; re-adopting
        a run from its directory reaches here twice)."""
        path = (Path(run_dir) / RUN_LOCK_NAME).resolve()
        if any(lk.fd >= 0 and lk.path.resolve() == path for lk in self.held):
            return
        self.held.append(acquire(Path(run_dir) / RUN_LOCK_NAME, f"run {run_id} ({run_dir})",
                                 {**self.info, "run_id": run_id}))

    def release(self) -> None:
        while self.held:
            self.held.pop().release()
