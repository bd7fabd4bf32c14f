"""The launcher wrapper: `python -m ulyssesd.daemon.job.wrapper --exit-file F -- LAUNCHER ARGV...`.

The daemon spawns this as the leader of a new session/process group; it runs the launcher (torchrun,
deepspeed, srun, or the rank module directly) as its child and, when the launcher exits, writes
`{"returncode", "signal", "ended"}` to the exit file atomically. A daemon that re-adopts a job it did not
spawn (it cannot `waitpid` it) learns the exit status from that file.

Why the wrapper exists besides the exit file:
- it ignores SIGTERM/SIGINT/SIGHUP/SIGUSR1, so the daemon's signals reach the ranks while the recorder stays;
- it makes itself a child subreaper (Linux prctl), so ranks that torchrun starts in their own sessions
  stay its descendants even if torchrun dies, and after the launcher exits it kills any leftover
  descendant: no orphan rank survives an attempt.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.training.durable import atomic_write_text

PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort; the daemon also scans by environment
        pass


def _kill_leftovers(grace_s: float = 5.0) -> list[int]:
    """SIGTERM then SIGKILL every descendant still alive once the launcher is gone; reap them."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    me = psutil.Process()
    left = [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    if not left:
        _reap()
        return []
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    _reap()
    return [p.pid for p in left]


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def write_exit_file(path: str, returncode: int | None, sig: int | None, extra: dict | None = None) -> None:
    data = {"returncode": returncode, "signal": sig, "ended": SYSTEM.time(), **(extra or {})}
    try:
        atomic_write_text(path, json.dumps(data))  # its temp file is removed when the write fails
    except OSError as exc:
        # A full or read-only disk: the daemon that spawned us still learns the status through waitpid; only
        # a re-adopting daemon misses it (it then closes the attempt as "unknown"). Never a traceback here.
        print(f"ulyssesd job_wrapper: cannot write the exit file {path}: {exc}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--exit-file" or "--" not in argv:
        print("usage: python -m ulyssesd.daemon.job.wrapper --exit-file FILE -- ARGV...", file=sys.stderr)
        return 2
    exit_file = argv[1]
    cmd = argv[argv.index("--") + 1:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _set_subreaper()
    try:
        # The child restores default dispositions (SIG_IGN would be inherited otherwise).
        proc = subprocess.Popen(cmd, restore_signals=True,
                                preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in
                                                    (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)])
    except OSError as exc:
        print(f"ulyssesd job_wrapper: cannot start launcher {cmd[0]!r}: {exc}", file=sys.stderr, flush=True)
        write_exit_file(exit_file, 127, None, {"error": str(exc)})
        return 127
    rc = proc.wait()
    killed = _kill_leftovers()
    if killed:
        print(f"ulyssesd job_wrapper: killed leftover processes {killed} after the launcher exited",
              file=sys.stderr, flush=True)
    returncode: int | None = None if rc < 0 else rc
    signum: int | None = -rc if rc < 0 else None
    write_exit_file(exit_file, returncode, signum)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
