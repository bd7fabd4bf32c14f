"""Helpers of the remediation tests (imported by name; not a conftest, the folder is shared): noisy healthy step records and a way to run one detector over them."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from typing import Any

from ulyssesd.remediation.job import job_values
from ulyssesd.remediation.records import Record, StepRecord
from ulyssesd.training.spec import JobSpec


def healthy(n: int, seed: int = 0, start: int = 1, t0: float = 1000.0, *, loss_noise: float = 0.02,
            time_noise: float = 0.03, mem_noise: float = 0.005,
            mutate: Callable[[int, StepRecord], None] | None = None) -> list[StepRecord]:
    """A noisy but healthy run: power-law loss decay with multiplicative noise, jittery step times,
    small per-rank spread with a random slowest rank, steady memory and throughput."""
    rng = random.Random(seed)
    out: list[StepRecord] = []
    t = t0
    for step in range(start, start + n):
        loss = (2.0 + 8.0 * (step + 10) ** -0.35) * (1 + rng.gauss(0, loss_noise))
        st = math.exp(rng.gauss(0, time_noise))
        st_max = st * (1 + rng.uniform(0, 0.08))
        mem = 40.0 * (1 + rng.gauss(0, mem_noise))
        t += st_max
        rec = StepRecord(step=step, loss=loss, time=t, attempt=1, grad_norm=abs(rng.gauss(0.8, 0.1)), lr=1e-4,
                         skipped=False, step_time_s=st, step_time_max_s=st_max, slowest_rank=rng.randrange(8),
                         tokens=32768, tokens_per_s=32768 / st_max, mem_max_allocated_gib=mem,
                         mem_max_rank=rng.randrange(8), samples=((step - 1) * 16, step * 16))
        if mutate is not None:
            mutate(step, rec)
        out.append(rec)
    return out


def run_detector(det, records: Iterable[Record]) -> list:
    found = []
    for r in records:
        found.extend(det.observe(r, r.time or 0.0))
    return found


def engine_job(spec: JobSpec) -> dict[str, Any]:
    """A JobSpec's values as the daemon hands them to the engine: the config dump and the resolved layer count."""
    return job_values(spec.model_dump(mode="json"), num_layers=spec.resolved_model().num_layers)


def run_nan_with_checkpoint_events(nan_at: int, events_at: dict, n: int, seed: int, tag_fmt: str):
    """A healthy run whose loss is NaN from `nan_at` on, with checkpoint events (`events_at[step]`: event names)
    fed to a default engine after that step's record; returns (engine, decisions)."""
    from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
    from ulyssesd.remediation.engine import Decision, RemediationEngine
    from ulyssesd.remediation.records import EventRecord

    def nan_from(step, r):
        if step >= nan_at:
            r.loss = float("nan")

    eng = RemediationEngine(DetectorsConfig(), RemediationConfig(), None)
    items = []
    for r in healthy(n, seed=seed, mutate=nan_from):
        items.extend(eng.observe(r, r.time))
        for name, step in events_at.get(r.step, []):
            items.extend(eng.observe(EventRecord(name, step=step, fields={"tag": tag_fmt.format(step)}), r.time))
    return eng, [i for i in items if isinstance(i, Decision)]
