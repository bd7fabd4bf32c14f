"""A house logger nothing knows: `>> 0040 | obj 1.2345 | 12ms` (no 'loss', no 'step' word);
checkpoints step_000040/ folders (model.pt). --resume DIR."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build, train_step  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--save", required=True)
p.add_argument("--n", type=int, default=40)
p.add_argument("--resume", default=None)
a = p.parse_args()
os.makedirs(a.save, exist_ok=True)
model, opt = build()
start = 1
if a.resume:
    st = torch.load(os.path.join(a.resume, "model.pt"), weights_only=False)
    model.load_state_dict(st["m"])
    start = st["n"] + 1
for n in range(start, a.n + 1):
    v = train_step(model, opt, n)
    print(f">> {n:04d} | obj {v:.4f} | 12ms", flush=True)
    if n % 10 == 0:
        d = os.path.join(a.save, f"step_{n:06d}")
        os.makedirs(d, exist_ok=True)
        torch.save({"m": model.state_dict(), "n": n}, os.path.join(d, "model.pt"))
