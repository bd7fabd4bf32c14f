"""nanoGPT-style: `iter N: loss X, time Yms`; checkpoints are FILES ckpt_00040.pt in --out_dir.
Resumes from --init_from PATH (a .pt file) when given."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build, train_step  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out_dir", required=True)
p.add_argument("--max_iters", type=int, default=100)
p.add_argument("--eval_interval", type=int, default=10)
p.add_argument("--init_from", default="")
a = p.parse_args()
os.makedirs(a.out_dir, exist_ok=True)
model, opt = build()
start = 1
if a.init_from:
    ck = torch.load(a.init_from, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    start = ck["iter_num"] + 1
    print(f"resuming training from {a.init_from} (iter_num {ck['iter_num']})", flush=True)
else:
    print("Initializing a new model from scratch", flush=True)
for it in range(start, a.max_iters + 1):
    t0 = time.time()
    loss = train_step(model, opt, it)
    dt = (time.time() - t0) * 1000
    print(f"iter {it}: loss {loss:.4f}, time {dt:.2f}ms, mfu -100.00%", flush=True)
    if it % a.eval_interval == 0:
        path = os.path.join(a.out_dir, f"ckpt_{it:05d}.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": it}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"saving checkpoint to {a.out_dir}", flush=True)
