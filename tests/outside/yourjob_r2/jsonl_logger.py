"""A JSON-lines logger: one object per step on stdout, {"ts":..., "iteration": N, "train_loss": X, "lr": Y};
checkpoints `weights-iter000040.pth` files in --ckpt (torch.save). --resume FILE."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build, train_step  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--iters", type=int, default=80)
p.add_argument("--save_every", type=int, default=10)
p.add_argument("--resume", default=None)
a = p.parse_args()
os.makedirs(a.ckpt, exist_ok=True)
model, opt = build()
start = 1
if a.resume:
    st = torch.load(a.resume, weights_only=False)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    start = st["iteration"] + 1
    print(json.dumps({"ts": time.time(), "event": "resumed", "from": a.resume}), flush=True)
for i in range(start, a.iters + 1):
    loss = train_step(model, opt, i)
    print(json.dumps({"ts": round(time.time(), 3), "iteration": i, "train_loss": loss, "lr": 0.05}), flush=True)
    if i % a.save_every == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "iteration": i},
                   os.path.join(a.ckpt, f"weights-iter{i:06d}.pth"))
