"""A plain PyTorch training loop as a user writes it: no ulyssesd import, its own log wording, its own
checkpoint folders (`CKPT/step_000040/` holding `model.pt` + `optim.pt`, written in place with torch.save).

    python plain_torch_job.py --ckpt-dir ckpt --steps 100 --save-every 10 [--resume ckpt/step_000040]

Faults (environment; each fires on attempt FAULT_ATTEMPT_<NAME> only, default 1, read from $ULYSSESD_ATTEMPT):
PLAIN_NAN_AT=N poisons the weights at step N (the loss turns NaN and stays NaN, later saves hold NaN weights);
PLAIN_CRASH_AT=N raises at step N. PLAIN_STEP_SLEEP paces the steps (seconds).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch


def fault_at(name: str) -> int:
    attempt = os.environ.get("ULYSSESD_ATTEMPT", "1")
    if attempt != os.environ.get(f"FAULT_ATTEMPT_{name}", "1"):
        return 0
    return int(os.environ.get(f"PLAIN_{name}_AT", "0"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    pace = float(os.environ.get("PLAIN_STEP_SLEEP", "0.1"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    if args.resume:
        model.load_state_dict(torch.load(Path(args.resume) / "model.pt"))
        state = torch.load(Path(args.resume) / "optim.pt")
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        print(f"resumed from {args.resume} at step {start}", flush=True)
    nan_at, crash_at = fault_at("NAN"), fault_at("CRASH")
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    for step in range(start + 1, args.steps + 1):
        if step == nan_at:
            with torch.no_grad():
                model[0].weight.fill_(math.nan)   # a blown-up update: every later step and save is poisoned
        x = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == crash_at:
            raise RuntimeError(f"dataloader worker died at step {step}")
        out = Path(args.ckpt_dir) / f"step_{step:06d}"
        if step % args.save_every == 0:   # saved before the step's line is printed (and so before anyone reads it)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), out / "model.pt")
            torch.save({"optim": opt.state_dict(), "step": step}, out / "optim.pt")
        print(f"step {step} | loss: {loss.item():.4f} | lr: {opt.param_groups[0]['lr']:.3g}", flush=True)
        if step % args.save_every == 0:
            print(f"saved checkpoint {out}", flush=True)
        time.sleep(pace)
    print("training done", flush=True)


if __name__ == "__main__":
    main()
