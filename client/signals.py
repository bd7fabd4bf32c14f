"""The job's side of the daemon's signals (docs/CONTRACTS.md):

- SIGTERM = finish the step in flight, save (unless control.json says the weights are suspect), exit 0.
  The handler only sets a flag; the training loop checks `stop.requested` between steps.
- SIGUSR1 = append every thread's stack to `{run_dir}/stacks/attempt-{A}-rank-{R}.txt` (faulthandler, from
  C, so it works even when the Python main thread is stuck in a collective); the job keeps running.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from ulyssesd.client.contract import env_int, env_rank, env_run_dir, stack_dump_path

log = logging.getLogger("ulyssesd.client")


class GracefulStop:
    """Set by SIGTERM; read by the training loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, signum: int | None = None) -> None:
        self.signum = signum
        self._event.set()

    def _handler(self, signum: int, frame: Any) -> None:
        self.request(signum)  # only a flag: the step in flight finishes, then the loop saves and exits


_stack_files: list[Any] = []  # kept open for the process's life: faulthandler writes to the fd from C


def register_stack_dumps(run_dir: str | Path | None = None, attempt: int | None = None,
                         rank: int | None = None) -> Path | None:
    """SIGUSR1 -> this rank's stack file (stderr when the file cannot be opened). Returns the file's path."""
    run_dir = Path(run_dir) if run_dir is not None else env_run_dir()
    attempt = attempt if attempt is not None else (env_int("ULYSSESD_ATTEMPT") or 0)
    rank = env_rank() if rank is None else rank
    path = stack_dump_path(run_dir, attempt, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")  # noqa: SIM115 - must outlive this function
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
        _stack_files.append(fh)
        return path
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("per-rank stack file unavailable (%s); SIGUSR1 dumps go to stderr", exc)
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        except (ValueError, OSError, AttributeError):
            log.warning("SIGUSR1 stack dumps unavailable: stderr has no file descriptor")
        return None


def install_signal_handlers(run_dir: str | Path | None = None, attempt: int | None = None,
                            rank: int | None = None) -> GracefulStop:
    """SIGTERM -> the returned GracefulStop's flag; SIGUSR1 -> stack dumps. Call from the main thread."""
    stop = GracefulStop()
    signal.signal(signal.SIGTERM, stop._handler)
    register_stack_dumps(run_dir, attempt, rank)
    return stop
