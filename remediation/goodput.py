"""Goodput model of a long run: expected ETTR (effective training time ratio) against the checkpoint interval.

Pure arithmetic (no I/O, no clocks), used by `bench/goodput.py` (tables, docs/REMEDIATION.md "Goodput model")
and by `ulyssesctl plan` (suggested checkpoint interval).

The run alternates `interval_s` of training with a checkpoint that stalls training for `block_s`; an
asynchronous save then writes for `write_s` in the background and is durable only when that write ends.
Interruptions arrive as a Poisson process with mean time between them `mtbf_s` (the whole run's, i.e. the
per-GPU rate times the GPU count). After an interruption the run pays `restart_s` (detection, start-up,
checkpoint load, first step) and redoes the work since the last *durable* checkpoint.

- `ettr(i, x)`: the exact expectation for blocking saves (Daly 2006, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", eq. 7: T = M·e^(R/M)·(e^((τ+δ)/M) − 1) per segment of τ work),
  with the background write charged as extra lost work per interruption (R → R + w: a failure inside the
  write window rolls back one more period, which averages to w per failure — exact to first order in 1/M,
  exact for w = 0).
- `young_interval` / `daly_interval`: the closed forms (Young 1974: τ = √(2δM); Daly's higher-order one).
- `optimal_interval`: the exact numeric maximiser of `ettr` (golden-section search on log τ, bounded).
- `simulate`: a Monte Carlo of the same process, event by event — the check that the formula models it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

HOUR = 3600.0
DAY = 24 * HOUR

# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, §3.3.4 and Table 5): 419 unexpected
# interruptions during a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16384
LLAMA3_SOURCE = ("Llama 3 (arXiv:2407.21783, section 3.3.4, Table 5): 419 unexpected interruptions in 54 days "
                 "on 16,384 H100 GPUs")

GOLDEN = (math.sqrt(5) - 1) / 2
SEARCH_ITERATIONS = 200   # golden-section steps: the bracket shrinks by 0.618^200, far below float precision


def failure_rate_per_gpu_hour(interruptions: int = LLAMA3_INTERRUPTIONS, days: float = LLAMA3_DAYS,
                              gpus: int = LLAMA3_GPUS) -> float:
    """Interruptions per GPU-hour from a published count (default: Llama 3's)."""
    if interruptions < 0 or days <= 0 or gpus <= 0:
        raise ValueError(f"need interruptions >= 0, days > 0, gpus > 0 (got {interruptions}, {days}, {gpus})")
    return interruptions / (days * 24.0 * gpus)


def run_mtbf_s(gpus: int, rate_per_gpu_hour: float | None = None) -> float:
    """Mean time between interruptions of a run on `gpus` GPUs, seconds (independent failures add up)."""
    rate = failure_rate_per_gpu_hour() if rate_per_gpu_hour is None else rate_per_gpu_hour
    if gpus <= 0 or rate <= 0:
        raise ValueError(f"need gpus > 0 and a positive failure rate (got {gpus}, {rate})")
    return HOUR / (rate * gpus)


@dataclass(frozen=True)
class GoodputInputs:
    """The component times of one run, seconds."""

    block_s: float        # training stalled per checkpoint (whole save when blocking; the snapshot when async)
    write_s: float        # background write after the stall until the tag is durable (0: blocking saves)
    restart_s: float      # interruption -> next productive step: detection + start-up + load + first step
    mtbf_s: float         # mean time between interruptions of the whole run

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in (("block_s", self.block_s), ("write_s", self.write_s),
                                        ("restart_s", self.restart_s)) if not (v >= 0 and math.isfinite(v))]
        if not (self.mtbf_s > 0 and math.isfinite(self.mtbf_s)):
            bad.append(f"mtbf_s={self.mtbf_s!r}")
        if bad:
            raise ValueError(f"goodput inputs must be finite, >= 0 (mtbf_s > 0): {', '.join(bad)}")


def effective_block_s(interval_s: float, x: GoodputInputs) -> float:
    """The stall per save including back-pressure: one save in flight, so a save due before the previous
    background write ends waits for it."""
    return max(x.block_s, x.write_s - interval_s)


def ettr(interval_s: float, x: GoodputInputs) -> float:
    """Expected fraction of wall time spent on training that is kept, for saves every `interval_s` of training."""
    if not interval_s > 0:
        raise ValueError(f"checkpoint interval must be > 0 s (got {interval_s!r})")
    m = x.mtbf_s
    period = interval_s + effective_block_s(interval_s, x)
    lost_fixed = x.restart_s + x.write_s
    # Daly eq. 7; expm1 keeps precision when period << M. Past ~700·M the exponent overflows: ETTR is 0.
    exponent = period / m
    if exponent + lost_fixed / m > 700:
        return 0.0
    expected_wall = m * math.exp(lost_fixed / m) * math.expm1(exponent)
    return interval_s / expected_wall


def ettr_first_order(interval_s: float, x: GoodputInputs) -> float:
    """The textbook first-order estimate: 1 − δ/(τ+δ) − (R + w + (τ+δ)/2)/M (for checking; `ettr` is exact)."""
    period = interval_s + effective_block_s(interval_s, x)
    return interval_s / period - (x.restart_s + x.write_s + period / 2) / x.mtbf_s


def young_interval(x: GoodputInputs) -> float:
    """Young (1974): τ = √(2δM), the first-order optimum."""
    return math.sqrt(2 * x.block_s * x.mtbf_s)


def daly_interval(x: GoodputInputs) -> float:
    """Daly (2006) eq. 20: √(2δM)·[1 + ⅓√(δ/2M) + δ/(18M)] − δ for δ < 2M, else M."""
    d, m = x.block_s, x.mtbf_s
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d


def optimal_interval(x: GoodputInputs, lo_s: float = 1.0, hi_s: float | None = None) -> tuple[float, float]:
    """(interval, ETTR) maximising `ettr` over [lo_s, hi_s] (default hi: 10·M). ETTR is unimodal in τ."""
    hi = 10 * x.mtbf_s if hi_s is None else hi_s
    if not 0 < lo_s < hi:
        raise ValueError(f"need 0 < lo_s < hi_s (got {lo_s}, {hi})")
    a, b = math.log(lo_s), math.log(hi)
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = ettr(math.exp(c), x), ettr(math.exp(d), x)
    for _ in range(SEARCH_ITERATIONS):
        if b - a < 1e-12:
            break
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = ettr(math.exp(c), x)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = ettr(math.exp(d), x)
    best = math.exp((a + b) / 2)
    return best, ettr(best, x)


def simulate(interval_s: float, x: GoodputInputs, horizon_s: float, seed: int = 0) -> float:
    """Monte Carlo ETTR: training kept / wall time over `horizon_s` of wall time, failures drawn exponentially.

    Failures may strike during training, a stall, a background write or a restart. Each save's tag becomes
    durable `write_s` after its stall ends; a failure rolls back to the newest durable tag.
    """
    rng = random.Random(seed)
    block = effective_block_s(interval_s, x)
    t = 0.0                 # wall clock
    durable = 0.0           # training kept in the newest durable tag
    progress = 0.0          # training done since the start (including what a failure will lose)
    pending: list[tuple[float, float]] = []   # (wall time durable, progress it holds)
    next_fail = rng.expovariate(1 / x.mtbf_s)
    while t < horizon_s:
        while pending and pending[0][0] <= t:   # background writes finished by now
            durable = max(durable, pending.pop(0)[1])
        # One period: train interval_s, then stall `block` for the save.
        end_train = t + interval_s
        if next_fail < end_train:
            progress += next_fail - t
            t = next_fail
        else:
            progress += interval_s
            t = end_train
            if next_fail >= t + block:
                t += block
                pending.append((t + x.write_s, progress))
                continue
            t = next_fail
        # A failure at wall time t: tags durable by now count, the rest are lost.
        for when, prog in pending:
            if when <= t:
                durable = max(durable, prog)
        pending.clear()
        progress = durable
        # Restart; a failure during the restart starts it again.
        while True:
            next_fail = t + rng.expovariate(1 / x.mtbf_s)
            if next_fail >= t + x.restart_s:
                t += x.restart_s
                break
            t = next_fail
    # Progress at the horizon (a run ending there keeps it); the bias is one period over the whole horizon.
    return progress / t


# ------------------------------------------------------------------------------ measured component times
@dataclass(frozen=True)
class Sourced:
    """A figure and where it was measured or published."""

    value: float
    source: str


ISSUE21 = "issue #21: 1x H200, gpt-1b (1.41B) at 16K under the daemon (bench/gpu_daemon.py on one rank)"
CALL13 = ("bench/RESULTS.md device call 13 (2026-12-02): 1x H200, gpt-1b at 16K, SIGKILL of the rank -> first "
          "step of a cold relaunch, 27.80 s in all")
# The figures the model is scaled from. Times that move data scale with the bytes each node moves.
MEASURED: dict[str, Sourced] = {
    "checkpoint_bytes": Sourced(16.97e9, "bench/RESULTS.md 'Checkpoint save/load': a gpt-1b tag is 16.97 GB "
                                         "(bf16 weights + fp32 master + Adam m, v)"),
    "checkpoint_params": Sourced(1_414_105_088, "`ulyssesctl plan --spec configs/gpt-1b-1xh200.toml`: 1.41B params"),
    "block_s": Sourced(42.0, f"{ISSUE21}: a synchronous save blocks training 36-42 s (the worst, 42 s, is used)"),
    "detection_s": Sourced(2.72, f"{CALL13}: SIGKILL -> crash incident recorded"),
    "startup_s": Sourced(10.21, f"{CALL13}: relaunch, imports, process group, model build, deepspeed.initialize "
                                "(the tag's verification read excluded: it is in load_s)"),
    "load_s": Sourced(13.60, f"{CALL13}: sha256 verification of the 17 GB tag from disk 10.82 s + mapped load 2.78 s"),
    "first_step_s": Sourced(1.27, f"{CALL13}: first step after the load"),
    "disk_write_gbps": Sourced(1.3, f"{ISSUE21}: the same disk's sequential write, dd oflag=direct"),
}
# Asynchronous saves as measured on the same job (registered snapshot pool, the writer hashing each byte once).
ASYNC_MEASURED: dict[str, Sourced] = {
    "block_s": Sourced(0.352, "bench/RESULTS.md device calls 13-14 (2026-12-02): every async save of a 17 GB tag "
                              "blocked training 0.33-0.35 s, the first of each process included (worst used)"),
    "write_fraction": Sourced(0.99, "bench/RESULTS.md device call 14 (2026-12-02): background write 1.43-1.54 GB/s, "
                                    "99-107 % of the same call's dd oflag=direct (worst used)"),
}


def scaled_inputs(params: float, nodes: int, gpus: int, *, async_save: bool = False,
                  rate_per_gpu_hour: float | None = None) -> GoodputInputs:
    """Component times for a run of `params` parameters on `nodes` nodes / `gpus` GPUs, from MEASURED.

    Save and load times scale with the checkpoint bytes per node (nodes write and read their own ranks' shards
    in parallel, each at the measured single-node speed); detection, start-up and the first step are taken as
    measured (a lower bound for bigger models, whose build and first step take longer).
    """
    if params <= 0 or nodes <= 0 or gpus < nodes:
        raise ValueError(f"need params > 0, nodes > 0, gpus >= nodes (got {params}, {nodes}, {gpus})")
    m = {k: v.value for k, v in MEASURED.items()}
    ratio = params * (m["checkpoint_bytes"] / m["checkpoint_params"]) / nodes / m["checkpoint_bytes"]
    restart = m["detection_s"] + m["startup_s"] + m["load_s"] * ratio + m["first_step_s"]
    if async_save:
        block = ASYNC_MEASURED["block_s"].value * ratio
        write = ratio * m["checkpoint_bytes"] / (ASYNC_MEASURED["write_fraction"].value * m["disk_write_gbps"] * 1e9)
    else:
        block, write = m["block_s"] * ratio, 0.0
    return GoodputInputs(block_s=block, write_s=write, restart_s=restart,
                         mtbf_s=run_mtbf_s(gpus, rate_per_gpu_hour))


def checkpoint_bytes(params: float) -> float:
    """Bytes of one tag at the measured bytes per parameter."""
    return params * MEASURED["checkpoint_bytes"].value / MEASURED["checkpoint_params"].value
