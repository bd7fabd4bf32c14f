"""`Reporter`: a job's steps and events to the run's telemetry.jsonl, never blocking training on I/O.

`step()`/`event()` build a small dict and put it on a bounded queue (no JSON, no syscall on the caller's
thread); one daemon writer thread encodes, appends, flushes each batch (the daemon tails the file) and
fsyncs after events (an `exiting` or `checkpoint_saved` must survive a host crash). A full queue drops the
STEP record (counted, reported as a `telemetry_dropped` event) rather than stall the training loop; events
are never dropped: they wait up to `event_put_timeout_s`. `close()` (also at interpreter exit) drains.
A file whose last line is torn (a writer killed mid-line) gets that line ended before the first append.
Only global rank 0 writes; on other ranks every call is a cheap no-op.
`total_steps` (the constructor's, or `set_total_steps` once the script knows its length) goes into every
step record: `ulyssesctl status` shows it as a command job's total (an older daemon ignores the field).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulyssesd.client.contract import (
    SCHEMA_VERSION,
    TELEMETRY_NAME,
    encode_record,
    env_int,
    env_rank,
    env_run_dir,
    jsonable,
)

log = logging.getLogger("ulyssesd.client")

_STOP = object()
_PLAIN = frozenset((float, int, bool, str, type(None)))


@dataclass
class ReporterConfig:
    """Bounds of the writer."""

    queue_size: int = 10_000
    """Records held in memory at most; a full queue drops step records (counted)."""
    flush_interval_s: float = 0.2
    """Longest time a record waits before it reaches the file (the writer's batch window)."""
    event_put_timeout_s: float = 5.0
    """How long event() may wait for queue space before it drops the event (logged)."""
    close_timeout_s: float = 30.0
    """How long close() waits for the writer to drain."""
    synchronous: bool = False
    """Write and flush on the caller's thread (no queue, no thread): for a job that may kill itself right
    after a record (fault injection) and would lose what sits in the queue."""


def repair_torn_tail(fh: Any) -> bool:
    """End a torn last line (a writer killed mid-line) with a newline before anything is appended, so the
    fragment stays a line of its own (the reader skips it as garbage) and the next record is not glued onto it
    and lost. True when a fragment was closed. `fh` is the append-mode handle."""
    try:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return False
        with open(fh.name, "rb") as rd:
            rd.seek(size - 1)
            if rd.read(1) == b"\n":
                return False
        fh.write("\n")
        fh.flush()
        return True
    except OSError as exc:  # a file we cannot read back: appending is still better than not reporting
        log.warning("telemetry file %s: could not check its last line (%s)", fh.name, exc)
        return False


class Reporter:
    """Telemetry writer for any training script (docs/CLIENT.md).

    path: telemetry file; default `$ULYSSESD_RUN_DIR/telemetry.jsonl` (the daemon's), else ./telemetry.jsonl.
    attempt, config_version: default `$ULYSSESD_ATTEMPT` / `$ULYSSESD_CONFIG_VERSION`.
    rank: default the launcher's `RANK`; only rank 0 writes.
    total_steps: the run's length in optimizer steps, when the script knows it (progress and ETA).
    """

    def __init__(self, path: str | Path | None = None, *, attempt: int | None = None,
                 config_version: int | None = None, rank: int | None = None,
                 config: ReporterConfig | None = None, total_steps: int | None = None):
        self.config = config or ReporterConfig()
        if self.config.queue_size < 1:
            raise ValueError(f"ReporterConfig.queue_size must be >= 1, got {self.config.queue_size}")
        self.path = Path(path) if path is not None else env_run_dir() / TELEMETRY_NAME
        self.attempt = attempt if attempt is not None else env_int("ULYSSESD_ATTEMPT")
        self.config_version = (config_version if config_version is not None
                               else env_int("ULYSSESD_CONFIG_VERSION"))
        self.rank = env_rank() if rank is None else rank
        self.enabled = self.rank == 0
        self.total_steps: int | None = None
        self.set_total_steps(total_steps)
        self.dropped = 0
        self.written = 0
        self._q: queue.Queue[Any] = queue.Queue(maxsize=self.config.queue_size)
        self._dropped_reported = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()/the writer
            self.repaired_tail = repair_torn_tail(self._fh)
            self._lock = threading.Lock()
            if not self.config.synchronous:
                self._thread = threading.Thread(target=self._run, name="ulyssesd-reporter", daemon=True)
                self._thread.start()
            atexit.register(self.close)

    # ------------------------------------------------------------------------------- callers
    def set_total_steps(self, total_steps: int | None) -> None:
        """The run's length in optimizer steps from now on (None: unknown). A bool or a count below 1 is
        refused: a wrong total would show a wrong ETA."""
        if total_steps is not None and (type(total_steps) is bool or not isinstance(total_steps, int)
                                        or total_steps < 1):
            raise ValueError(f"total_steps must be a positive integer or None, got {total_steps!r}")
        self.total_steps = total_steps

    def step(self, step: int, loss: Any, *, source: str | None = None, **fields: Any) -> None:
        """Record one optimizer step. `loss` and fields may be floats or 0-d tensors (a tensor's `.item()`
        runs here: pass floats you already have to avoid a device sync). Never blocks.

        `source`: the data source this step's batch came from (a dataset of a blend, a task, a language):
        the daemon then judges the loss against that source's own level (a hard source's high loss is not
        a spike). A batch mixing sources passes `loss_by_source={name: loss, ...}` instead."""
        if not self.enabled or self._closed:
            return
        if type(loss) not in _PLAIN:  # a tensor: read it on the caller's thread, where it is current
            loss = jsonable(loss)
        if source is not None:
            if not isinstance(source, str) or not source:
                raise ValueError(f"source must be a non-empty string naming the data source, got {source!r}")
            fields["loss_by_source"] = {source: loss}
        rec = {"v": SCHEMA_VERSION, "kind": "step", "time": time.time(), "attempt": self.attempt,
               "step": int(step), "loss": loss, "config_version": self.config_version}
        if self.total_steps is not None:
            rec["total_steps"] = self.total_steps
        if fields:
            for key, value in fields.items():
                rec[key] = value if type(value) in _PLAIN else jsonable(value)
        if self._thread is None:
            self._write_now(rec)
            return
        try:
            self._q.put_nowait(rec)
        except queue.Full:
            self.dropped += 1

    def event(self, event: str, step: int | None = None, **fields: Any) -> None:
        """Record one event (started, checkpoint_saved, exiting, ...). Waits for queue space at most
        `event_put_timeout_s`; the writer fsyncs after it."""
        if not self.enabled or self._closed:
            return
        rec = {"v": SCHEMA_VERSION, "kind": "event", "time": time.time(), "attempt": self.attempt,
               "step": step, "event": event, **fields}
        if self._thread is None:
            self._write_now(rec)
            return
        try:
            self._q.put(rec, timeout=self.config.event_put_timeout_s)
        except queue.Full:
            self.dropped += 1
            log.warning("telemetry queue full for %.1fs: event %s dropped", self.config.event_put_timeout_s, event)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record queued so far is in the file; False when `timeout` ran out."""
        if not self.enabled or self._thread is None or not self._thread.is_alive():
            return True
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout is None else timeout)
        while self._q.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Drain and close (idempotent; also runs at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            if self.enabled:
                with self._lock:
                    self._fh.close()
            atexit.unregister(self.close)
            return
        try:
            self._q.put(_STOP, timeout=self.config.close_timeout_s)
        except queue.Full:
            log.warning("telemetry queue still full at close; %d records may be lost", self._q.qsize())
        self._thread.join(self.config.close_timeout_s)
        atexit.unregister(self.close)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _write_now(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if not self._fh.closed:
                self._write(self._fh, [rec])

    # --------------------------------------------------------------------------- writer thread
    def _run(self) -> None:
        fh = self._fh
        try:
            while True:
                first = self._q.get()
                batch = [first]
                deadline = time.monotonic() + self.config.flush_interval_s
                while first is not _STOP and first["kind"] != "event" and len(batch) < 4096:
                    try:  # gather what arrives within the window: one write + flush per batch
                        item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    batch.append(item)
                    if item is _STOP or item["kind"] == "event":
                        break  # an event goes to disk now (fsynced), not at the end of the window
                stop = self._write(fh, batch)
                for _ in batch:
                    self._q.task_done()
                if stop:
                    return
        finally:
            fh.close()

    def _write(self, fh: Any, batch: list[Any]) -> bool:
        lines = []
        has_event = False
        stop = False
        for rec in batch:
            if rec is _STOP:
                stop = True
                continue
            try:
                lines.append(encode_record(rec))
            except (TypeError, ValueError) as exc:  # a field the caller passed is not JSON: say which record
                log.warning("telemetry record not encodable (%s): %r", exc, {k: type(v).__name__ for k, v in rec.items()})
                continue
            has_event = has_event or rec["kind"] == "event"
        if self.dropped > self._dropped_reported:
            lines.append(encode_record({"v": SCHEMA_VERSION, "kind": "event", "time": time.time(),
                                        "attempt": self.attempt, "step": None, "event": "telemetry_dropped",
                                        "dropped": self.dropped}))
            self._dropped_reported = self.dropped
        if lines:
            try:
                fh.write("\n".join(lines) + "\n")
                fh.flush()
                if has_event or stop:
                    os.fsync(fh.fileno())
                self.written += len(lines)
            except OSError as exc:  # disk full etc.: supervision degrades, training goes on
                if self._error is None:
                    log.error("telemetry write to %s failed: %s (records are being lost)", self.path, exc)
                self._error = exc
        return stop
