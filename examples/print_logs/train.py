"""A plain DeepSpeed training script that knows nothing about ulyssesd: it only prints log lines.

Run it under the daemon with `[telemetry] source = "stdout"` (docs/CLIENT.md): the daemon reads DeepSpeed's
own lines (OVERFLOW, step=/lr) and this script's `step=N loss=X` lines from the attempt's log.

    deepspeed --num_gpus 1 examples/print_logs/train.py --steps 200        # or torchrun / python
    DS_ACCELERATOR=cpu python examples/print_logs/train.py --steps 50     # CPU, one process

Demo faults (environment, for tests and trying the daemon out): EXAMPLE_CRASH_AT=N raises at step N,
EXAMPLE_HANG_AT=N sleeps forever at step N, EXAMPLE_SPIKE_AT=N multiplies the loss printed from step N on
for 20 steps by 5. They fire on attempt EXAMPLE_FAULT_ATTEMPT (default 1) of a supervised run only
($ULYSSESD_ATTEMPT), so the restarted attempt runs clean.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import deepspeed
import deepspeed.ops
import torch

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0},
}


def _single_process_defaults() -> None:
    """Run without a launcher too: one process, a free local port."""
    if "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (demo pacing)")
    ap.add_argument("--deepspeed_config", default=None, help="a DeepSpeed config JSON (default: the one above)")
    ap.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = ap.parse_args()
    _single_process_defaults()
    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce (an inference-only op)
        # in init_distributed: ~60-90 s on a cold extension cache, under a lock file that others wait on.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    config = DS_CONFIG
    if args.deepspeed_config:
        with open(args.deepspeed_config) as fh:
            config = json.load(fh)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"gradient_clipping={engine.gradient_clipping()}", flush=True)
    faulty = os.environ.get("ULYSSESD_ATTEMPT", "1") == os.environ.get("EXAMPLE_FAULT_ATTEMPT", "1")
    crash_at = int(os.environ.get("EXAMPLE_CRASH_AT", "0")) if faulty else 0
    hang_at = int(os.environ.get("EXAMPLE_HANG_AT", "0")) if faulty else 0
    spike_at = int(os.environ.get("EXAMPLE_SPIKE_AT", "0")) if faulty else 0
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    for step in range(1, args.steps + 1):
        x = torch.randn(8, 16, generator=gen).to(engine.device)
        y = x @ w_true.to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if step == crash_at:
            raise RuntimeError(f"demo crash at step {step}")
        if step == hang_at:
            while True:
                time.sleep(60)
        shown = loss.item() * (5.0 if spike_at and spike_at <= step < spike_at + 20 else 1.0)
        if engine.global_rank == 0:
            print(f"step={step} loss={shown:.5f} lr={engine.get_lr()[0]:.3e}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
