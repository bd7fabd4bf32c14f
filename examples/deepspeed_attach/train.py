"""A hand-written DeepSpeed loop supervised through `attach(engine)`: one added line.

attach() reports each optimizer step to the run's telemetry (loss, grad norm, LR, loss scale, skipped,
step time, memory), applies control.json between steps (LR scale, clipping: hot, no restart), saves
`--save-dir/step-XXXXXXXX` with a manifest on SIGTERM (unless the daemon marked the weights suspect) and
dumps stacks on SIGUSR1. Under the daemon the run directory comes from $ULYSSESD_RUN_DIR.

    DS_ACCELERATOR=cpu python examples/deepspeed_attach/train.py --steps 50 --save-dir /tmp/ckpt

Demo fault: EXAMPLE_SPIKE_AT=N multiplies the loss by 8 for 30 steps from step N (attempt 1 only).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import deepspeed
import deepspeed.ops
import torch

from ulyssesd.client.deepspeed import attach

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 1000,
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
    ap.add_argument("--save-dir", default="checkpoints")
    ap.add_argument("--resume", action="store_true", help="load the newest checkpoint in --save-dir")
    ap.add_argument("--resume-from", default=None, help="load this checkpoint directory (the daemon's {resume})")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (demo pacing)")
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    _single_process_defaults()
    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce (an inference-only op)
        # in init_distributed: ~60-90 s on a cold extension cache, under a lock file that others wait on.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    if args.resume_from:
        ckpt = Path(args.resume_from)
        engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name)
    elif args.resume:
        engine.load_checkpoint(args.save_dir)  # DeepSpeed's `latest` file names the newest tag
    sup = attach(engine, save_dir=args.save_dir, tokens_per_step=8 * 2 * 16)  # <- the one line
    sup.reporter.set_total_steps(args.steps)  # the run's length: ulyssesctl status's total and ETA
    spike_at = int(os.environ.get("EXAMPLE_SPIKE_AT", "0")) if os.environ.get("ULYSSESD_ATTEMPT", "1") == "1" else 0
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    while engine.global_steps < args.steps:
        x = torch.randn(8, 16, generator=gen).to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), x @ w_true.to(engine.device))
        if spike_at and spike_at <= engine.global_steps + 1 < spike_at + 30:
            loss = loss * 8.0
        engine.backward(loss)
        engine.step()
        if args.step_sleep and engine.is_gradient_accumulation_boundary():
            time.sleep(args.step_sleep)
    sup.reporter.event("exiting", int(engine.global_steps), reason="completed")
    sup.detach()


if __name__ == "__main__":
    main()
