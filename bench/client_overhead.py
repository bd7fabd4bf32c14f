"""Per-step cost of ulyssesd.client on a training loop (CPU).

1. `Reporter.step` in a tight loop (the caller's cost: dict + queue put; the writer thread runs alongside);
2. what `attach(engine)` adds to each optimizer step, timed in isolation on a live engine (control.json
   poll + the step report + the stop check, with a control.json present), median of rounds;
3. a real tiny DeepSpeed step (examples' MLP, ZeRO-0, gloo, 1 process) with and without `attach(engine)`,
   interleaved rounds (on a shared, loaded box this difference is within the noise; 2. is the figure).

    DS_ACCELERATOR=cpu .venv/bin/python bench/client_overhead.py [--steps 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def reporter_cost(n: int, tmp: Path) -> float:
    from ulyssesd.client import Reporter, ReporterConfig

    rep = Reporter(tmp / "bench.jsonl", rank=0, config=ReporterConfig(queue_size=n + 10))
    t0 = time.perf_counter()
    for i in range(n):
        rep.step(i, 2.31, grad_norm=0.84, lr=1.2e-4, skipped=False, step_time_s=0.1, tokens=32768)
    per = (time.perf_counter() - t0) / n
    rep.close()
    assert rep.dropped == 0
    return per


def tiny_engine(width: int, batch: int):
    import deepspeed
    import torch

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29731")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    cfg = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def step_times(engine, steps: int, width: int, batch: int) -> list[float]:
    import torch

    x = torch.randn(batch, width)
    y = torch.randn(batch, 1)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reporter-calls", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=16, help="MLP width (16: a sub-ms step; 2048: tens of ms)")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    from ulyssesd.client.deepspeed import attach

    tmp = Path(tempfile.mkdtemp(prefix="client-bench-"))
    os.environ["ULYSSESD_RUN_DIR"] = str(tmp)
    rep_s = min(reporter_cost(args.reporter_calls // args.rounds, tmp) for _ in range(args.rounds))
    engine = tiny_engine(args.width, args.batch)
    step_times(engine, 20, args.width, args.batch)  # warm-up
    plain, attached = [], []
    for _ in range(args.rounds):
        plain.append(statistics.median(step_times(engine, args.steps, args.width, args.batch)))
        sup = attach(engine, signals=False)
        attached.append(statistics.median(step_times(engine, args.steps, args.width, args.batch)))
        sup.detach()
        sup.reporter.close()
    (tmp / "control.json").write_text(json.dumps({"version": 1, "lr_scale": 1.0}))
    import torch

    sup = attach(engine, signals=False)
    hooks = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for i in range(2000):
            sup._loss_sum, sup._loss_n = torch.tensor(1.0), 1
            sup.control.poll(i)
            sup._report()
            sup._stop_agreed()
        hooks.append((time.perf_counter() - t0) / 2000)
    sup.detach()
    sup.reporter.close()
    p, a = statistics.median(plain), statistics.median(attached)
    h = statistics.median(hooks)
    # On a shared box other processes only ever add time: the fastest round is the least disturbed one.
    result = {"reporter_step_us": rep_s * 1e6, "attach_hooks_us_median": h * 1e6,
              "attach_hooks_us_min": min(hooks) * 1e6, "tiny_step_plain_ms_min": min(plain) * 1e3,
              "attach_hooks_pct_of_tiny_step": 100 * min(hooks) / min(plain),
              "rounds_hooks_us": [x * 1e6 for x in hooks], "tiny_step_plain_ms": p * 1e3, "tiny_step_attached_ms": a * 1e3,
              "attach_overhead_us": (a - p) * 1e6, "attach_overhead_pct": 100 * (a - p) / p,
              "rounds_plain_ms": [x * 1e3 for x in plain], "rounds_attached_ms": [x * 1e3 for x in attached],
              "steps_per_round": args.steps, "width": args.width, "batch": args.batch, "python": sys.version.split()[0]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
