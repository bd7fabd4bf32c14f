"""A plain PyTorch loop, its own wording: `ep 0 it 40/300 train-loss=2.31`; saves ckpt/step_000040.pt.

    python plain_train.py --ckpt-dir ckpt --steps 300 [--resume ckpt/step_000040.pt]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import maybe_fault  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--steps-per-epoch", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.03)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w_true = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    start = 0
    if args.resume:
        state = torch.load(args.resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"resumed from {args.resume} at it {start}", flush=True)
    else:
        print("starting from scratch", flush=True)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(1000 + start)

    def poison() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(float("nan"))

    for step in range(start + 1, args.steps + 1):
        x = torch.randn(256, 8, generator=gen)
        y = x @ w_true + 0.5 * torch.randn(256, 1, generator=gen)   # a noise floor: a steady loss, no spikes
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ep = (step - 1) // args.steps_per_epoch
        if os.environ.get("O28_UNKNOWN_WORDING"):  # a wording no reader knows (the unknown-is-loud test)
            print(f"E{ep} #{step}/{args.steps} L~{loss.item():.4f}", flush=True)
        else:
            print(f"ep {ep} it {step}/{args.steps} train-loss={loss.item():.4f}", flush=True)
        if step % args.save_every == 0:
            path = os.path.join(args.ckpt_dir, f"step_{step:06d}.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
            print(f"saved {path}", flush=True)
        maybe_fault(step, poison)
        time.sleep(args.sleep)
    print("done", flush=True)


if __name__ == "__main__":
    main()
