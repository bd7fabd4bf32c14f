"""Batches built ahead of the step by a background thread, so reading data never stalls the step.

The loader never decides the data order: it runs `batch_indices` on its own copy of the cursor, exactly as
the training loop does on the real one, and each step's prefetched indices are checked against the
loop's before use (a mismatch — the cursor was changed under it — drops the prefetch and rebuilds).
The thread reads memmapped token files (numpy releases the GIL while copying pages), stacks the micro
batches and, on CUDA, pins them so the host-to-device copy is asynchronous. A data error raised in the
thread is re-raised in the training loop at the step that needed the batch.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .batches import DataCursor, SampleSource, batch_indices


@dataclass
class StepBatches:
    """One optimizer step's data for this rank."""

    micro: list[torch.Tensor]  # per micro-step LongTensor [micro_batch, seq_len + 1]
    indices: list[list[int]]  # per micro-step global sample indices
    samples: tuple[int, int]  # the step's global [start, end)
    wait_s: float = 0.0  # time the training loop waited for these batches
    sources: list[list[int]] | None = None  # per micro-step the source id of each sample (multi-source data)


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class PrefetchLoader:
    """Yields `StepBatches` for consecutive steps; `depth` steps are built ahead (0 = inline)."""

    def __init__(self, source: SampleSource, cursor: DataCursor, dp_rank: int, dp_size: int, micro_batch: int,
                 grad_accum: int, depth: int = 2, pin_memory: bool = False):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.source, self.depth, self.pin = source, depth, pin_memory
        self._layout = (dp_rank, dp_size, micro_batch, grad_accum)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._fill, args=(copy.deepcopy(cursor),),
                                            name="ulyssesd-prefetch", daemon=True)
            self._thread.start()

    def _build(self, cursor: DataCursor) -> StepBatches:
        per_micro, samples = batch_indices(cursor, *self._layout)
        micro = [self.source.batch(ix) for ix in per_micro]
        if self.pin:
            micro = [t.pin_memory() for t in micro]
        sources = ([[self.source.source_of(i) for i in ix] for ix in per_micro]
                   if self.source.source_names is not None else None)
        return StepBatches(micro, per_micro, samples, sources=sources)

    def _fill(self, cursor: DataCursor) -> None:
        while not self._stop.is_set():
            try:
                item: StepBatches | _Failure = self._build(cursor)
            except BaseException as exc:  # re-raised in the training loop
                item = _Failure(exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def next(self, cursor: DataCursor) -> StepBatches:
        """The next step's batches; advances `cursor` exactly as `batch_indices` does."""
        expect = copy.deepcopy(cursor)
        per_micro, samples = batch_indices(cursor, *self._layout)
        if self._thread is None:
            t0 = time.perf_counter()
            built = self._build(expect)
            built.wait_s = time.perf_counter() - t0
            return built
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data prefetch thread died without a result") from None
        wait = time.perf_counter() - t0
        if isinstance(item, _Failure):
            raise item.exc
        if item.samples != samples or item.indices != per_micro:
            # The cursor moved under the loader (should not happen in a run): restart from the real cursor.
            self.close()
            self.__init__(self.source, cursor, *self._layout, depth=self.depth, pin_memory=self.pin)  # type: ignore[misc]
            t0 = time.perf_counter()
            item = self._build(expect)
            wait += time.perf_counter() - t0
        item.wait_s = wait
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
