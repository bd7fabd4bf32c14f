"""Periodic jobs, run ON the supervisor's main loop.

APScheduler's BackgroundScheduler fires triggers from its own thread. The supervisor's invariant is one
thread doing the work (no locks around the store, the job handle or the state machine), so a trigger does
only one thing: put the job's name on a thread-safe queue. The main loop drains the queue each tick and
runs the job body itself. `coalesce=True` + `max_instances=1` + a queue that holds each name at most
once mean a slow loop never accumulates a backlog of the same job.

Jobs (bodies live in the supervisor): checkpoint retention + disk guard, store maintenance, stale-attempt
sweep, periodic status summary.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from apscheduler.schedulers.background import BackgroundScheduler

from ulyssesd.daemon.host.logging import get_logger

log = get_logger("ulyssesd.scheduler")


class LoopScheduler:
    def __init__(self, use_thread: bool = True) -> None:
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._bodies: dict[str, Callable[[], None]] = {}
        self._sched = BackgroundScheduler(timezone="UTC", job_defaults={"coalesce": True, "max_instances": 1,
                                                                        "misfire_grace_time": None}) if use_thread else None
        self.runs: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def add(self, name: str, every_s: float, body: Callable[[], None]) -> None:
        self._bodies[name] = body
        if self._sched is not None:
            self._sched.add_job(self.enqueue, "interval", seconds=every_s, args=[name], id=name,
                                replace_existing=True)

    def enqueue(self, name: str) -> None:
        """Called from APScheduler's thread (or a test): mark `name` due, at most once."""
        with self._lock:
            if name in self._pending:
                return
            self._pending.add(name)
        self._queue.put(name)

    def start(self) -> None:
        if self._sched is not None and not self._sched.running:
            self._sched.start()

    def shutdown(self) -> None:
        if self._sched is not None and self._sched.running:
            self._sched.shutdown(wait=False)

    def run_due(self, limit: int = 8) -> list[str]:
        """Run due jobs on the caller's (main loop's) thread; a failing job is logged, never fatal."""
        ran = []
        for _ in range(limit):
            try:
                name = self._queue.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._pending.discard(name)
            body = self._bodies.get(name)
            if body is None:
                continue
            try:
                body()
                self.runs[name] = self.runs.get(name, 0) + 1
            except Exception as exc:  # noqa: BLE001 - a housekeeping failure must not kill supervision
                self.errors[name] = self.errors.get(name, 0) + 1
                log.error("scheduled job failed", job=name, error=repr(exc))
            ran.append(name)
        return ran
