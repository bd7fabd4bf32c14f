"""Seeded synthetic telemetry for tests, benchmarks and docs: a realistic noisy run (power-law loss decay
with multiplicative noise and occasional small bumps, jittery step times, per-rank spread, checkpoints)
plus optional injected faults. Pure: returns dicts in the telemetry contract's shape."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Injection:
    kind: str                     # "spike" | "nan" | "slow_rank" | "memory" | "oscillation" | "overflow"
    at: int                       # first step
    steps: int = 1                # duration
    magnitude: float = 3.0        # loss multiplier / slowdown factor / GiB factor / swing amplitude


@dataclass
class TraceSpec:
    steps: int = 5000
    seed: int = 0
    ranks: int = 8
    batch: int = 16               # samples per step
    tokens: int = 32768
    step_time_s: float = 1.0
    loss_noise: float = 0.02      # multiplicative std of the loss
    bump_every: int = 700         # a small (~5-8 %) bump that decays over ~10 steps, this often
    ckpt_every: int = 500
    mem_gib: float = 40.0
    start_time: float = 1_764_444_444.0
    injections: list[Injection] = field(default_factory=list)


def trace(spec: TraceSpec) -> Iterator[dict]:
    rng = random.Random(spec.seed)
    t = spec.start_time
    yield {"v": 1, "kind": "event", "event": "started", "time": t, "attempt": 1, "step": 0}
    bump_left, bump_amp = 0, 0.0
    by_step: dict[int, list[Injection]] = {}
    for inj in spec.injections:
        for s in range(inj.at, inj.at + inj.steps):
            by_step.setdefault(s, []).append(inj)
    for step in range(1, spec.steps + 1):
        loss = 2.0 + 8.0 * (step + 10) ** -0.35
        loss *= 1 + rng.gauss(0, spec.loss_noise)
        if spec.bump_every and step % spec.bump_every == 0:
            bump_left, bump_amp = 10, rng.uniform(0.05, 0.08)
        if bump_left:
            loss *= 1 + bump_amp * bump_left / 10
            bump_left -= 1
        st = spec.step_time_s * math.exp(rng.gauss(0, 0.03))
        if rng.random() < 0.01:
            st *= 1.6  # the occasional GC / dataloader hiccup
        st_max = st * (1 + rng.uniform(0.0, 0.08))
        slowest = rng.randrange(spec.ranks)
        mem = spec.mem_gib * (1 + rng.gauss(0, 0.005))
        grad_norm: float | str = abs(rng.gauss(0.8, 0.1))
        skipped = False
        loss_out: float | str = loss
        for inj in by_step.get(step, ()):
            if inj.kind == "spike":
                loss_out = loss * inj.magnitude
            elif inj.kind == "nan":
                loss_out, grad_norm = "nan", "nan"
            elif inj.kind == "slow_rank":
                st_max, slowest = st * inj.magnitude, 1
            elif inj.kind == "memory":
                mem *= inj.magnitude
            elif inj.kind == "oscillation":
                loss_out = loss * (1 + inj.magnitude * 0.1 * (1 if step % 2 else -1))
            elif inj.kind == "overflow":
                skipped = rng.random() < 0.5
        t += st_max
        yield {"v": 1, "kind": "step", "time": round(t, 3), "attempt": 1, "step": step, "loss": loss_out,
               "grad_norm": grad_norm, "lr": 1.2e-4, "loss_scale": None, "skipped": skipped,
               "step_time_s": round(st, 4), "step_time_max_s": round(st_max, 4), "slowest_rank": slowest,
               "tokens": spec.tokens, "tokens_per_s": round(spec.tokens / st_max, 1),
               "mem_allocated_gib": round(mem * 0.6, 3), "mem_max_allocated_gib": round(mem, 3),
               "mem_max_rank": rng.randrange(spec.ranks), "mem_reserved_gib": round(mem * 1.05, 3),
               "samples": [(step - 1) * spec.batch, step * spec.batch], "config_version": 1}
        if spec.ckpt_every and step % spec.ckpt_every == 0:
            yield {"v": 1, "kind": "event", "event": "checkpoint_saving", "time": round(t, 3), "attempt": 1,
                   "step": step, "tag": f"step-{step:08d}"}
            t += 4.0
            yield {"v": 1, "kind": "event", "event": "checkpoint_saved", "time": round(t, 3), "attempt": 1,
                   "step": step, "tag": f"step-{step:08d}", "seconds": 4.0}
