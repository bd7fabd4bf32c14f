"""A Lightning-style script (lightning is not installed here): it prints Lightning's tqdm progress bar
(`Epoch 0:  40%|████      | 8/20 [00:01<00:01, 6.02it/s, v_num=0, train_loss=2.310]`, carriage-return
redraws) and saves `lightning_logs/version_0/checkpoints/epoch=E-step=N.ckpt` with torch.save, as Lightning does.

    python lightning_style.py --default-root-dir out --max-epochs 10 [--ckpt_path out/.../epoch=0-step=40.ckpt]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import maybe_fault  # noqa: E402


def bar(epoch: int, n: int, total: int, t0: float, loss: float) -> str:
    frac = n / total
    filled = int(frac * 10)
    el = time.time() - t0
    rate = n / el if el > 0 else 0.0
    return (f"Epoch {epoch}: {int(frac * 100):3d}%|{'█' * filled}{' ' * (10 - filled)}| {n}/{total} "
            f"[00:{int(el):02d}<00:00, {rate:.2f}it/s, v_num=0, train_loss={loss:.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--default-root-dir", required=True)
    ap.add_argument("--max-epochs", type=int, default=10)
    ap.add_argument("--batches", type=int, default=20, help="batches per epoch")
    ap.add_argument("--every-n-train-steps", type=int, default=20)
    ap.add_argument("--sleep", type=float, default=0.03)
    ap.add_argument("--ckpt_path", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    global_step = 0
    if args.ckpt_path:
        ck = torch.load(args.ckpt_path, weights_only=True)
        model.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer_states"][0])
        global_step = ck["global_step"]
        print(f"Restoring states from the checkpoint path at {args.ckpt_path}", flush=True)
    ckdir = os.path.join(args.default_root_dir, "lightning_logs", "version_0", "checkpoints")
    os.makedirs(ckdir, exist_ok=True)
    print("GPU available: False, used: False", flush=True)
    print("  | Name  | Type       | Params\n0 | model | Sequential | 420", flush=True)
    gen = torch.Generator().manual_seed(7 + global_step)

    def poison() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(float("nan"))

    start_epoch, start_batch = divmod(global_step, args.batches)
    for epoch in range(start_epoch, args.max_epochs):
        t0 = time.time()
        first = start_batch if epoch == start_epoch else 0
        for b in range(first, args.batches):
            x = torch.randn(256, 8, generator=gen)
            y = x.sum(dim=1, keepdim=True) + 0.5 * torch.randn(256, 1, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            global_step += 1
            sys.stdout.write("\r" + bar(epoch, b + 1, args.batches, t0, loss.item()))
            sys.stdout.flush()
            if global_step % args.every_n_train_steps == 0:
                path = os.path.join(ckdir, f"epoch={epoch}-step={global_step}.ckpt")
                torch.save({"epoch": epoch, "global_step": global_step, "state_dict": model.state_dict(),
                            "optimizer_states": [opt.state_dict()], "pytorch-lightning_version": "2.4.0"}, path)
            maybe_fault(global_step, poison)
            time.sleep(args.sleep)
        sys.stdout.write("\n")
        sys.stdout.flush()
    print(f"`Trainer.fit` stopped: `max_epochs={args.max_epochs}` reached.", flush=True)


if __name__ == "__main__":
    main()
