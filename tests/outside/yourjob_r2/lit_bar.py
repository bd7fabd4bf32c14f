"""Lightning-like: a progress bar per epoch `Epoch 1:  40%|████      | 8/20 [00:01<00:02,  5.00it/s, v_num=0, train_loss=1.234]`
redrawn with \\r, checkpoints `epoch=1-step=28.ckpt` files in --default_root_dir/checkpoints. --ckpt_path FILE."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build, train_step  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--default_root_dir", required=True)
p.add_argument("--max_epochs", type=int, default=4)
p.add_argument("--batches", type=int, default=20)
p.add_argument("--every_n_train_steps", type=int, default=10)
p.add_argument("--ckpt_path", default=None)
a = p.parse_args()
cdir = os.path.join(a.default_root_dir, "checkpoints")
os.makedirs(cdir, exist_ok=True)
model, opt = build()
gstep = 0
if a.ckpt_path:
    st = torch.load(a.ckpt_path, weights_only=False)
    model.load_state_dict(st["state_dict"])
    opt.load_state_dict(st["optimizer_states"][0])
    gstep = st["global_step"]
    print(f"Restored all states from the checkpoint at {a.ckpt_path}", flush=True)
t0 = time.time()
for ep in range(a.max_epochs):
    for b in range(1, a.batches + 1):
        if ep * a.batches + b <= gstep:
            continue
        gstep = ep * a.batches + b
        loss = train_step(model, opt, gstep)
        pct = int(100 * b / a.batches)
        bar = "█" * (pct // 10) + " " * (10 - pct // 10)
        el = time.time() - t0
        sys.stdout.write(f"\rEpoch {ep}: {pct:3d}%|{bar}| {b}/{a.batches} [00:{int(el):02d}<00:01, "
                         f"{b / max(el, 1e-3):.2f}it/s, v_num=0, train_loss={loss:.3f}]")
        sys.stdout.flush()
        if gstep % a.every_n_train_steps == 0:
            path = os.path.join(cdir, f"epoch={ep}-step={gstep}.ckpt")
            torch.save({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                        "global_step": gstep, "epoch": ep}, path)
    sys.stdout.write("\n")
print(f"`Trainer.fit` stopped: `max_epochs={a.max_epochs}` reached.", flush=True)
