"""accelerate-style loop: `epoch E step S loss=L` (S counts across epochs); checkpoints are folders
of its own naming `snapshot_step40/` holding model.pt and optim.pt (torch.save). --resume_from_checkpoint DIR."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build, train_step  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--output_dir", required=True)
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--steps_per_epoch", type=int, default=20)
p.add_argument("--checkpointing_steps", type=int, default=10)
p.add_argument("--resume_from_checkpoint", default=None)
a = p.parse_args()
os.makedirs(a.output_dir, exist_ok=True)
model, opt = build()
done = 0
if a.resume_from_checkpoint:
    model.load_state_dict(torch.load(os.path.join(a.resume_from_checkpoint, "model.pt")))
    opt.load_state_dict(torch.load(os.path.join(a.resume_from_checkpoint, "optim.pt")))
    done = int(open(os.path.join(a.resume_from_checkpoint, "step.txt")).read())
    print(f"Resumed from checkpoint: {a.resume_from_checkpoint}", flush=True)
step = 0
for e in range(a.epochs):
    for _ in range(a.steps_per_epoch):
        step += 1
        if step <= done:
            continue
        loss = train_step(model, opt, step)
        print(f"epoch {e} step {step} loss={loss:.4f}", flush=True)
        if step % a.checkpointing_steps == 0:
            d = os.path.join(a.output_dir, f"snapshot_step{step}")
            os.makedirs(d, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(d, "model.pt"))
            torch.save(opt.state_dict(), os.path.join(d, "optim.pt"))
            with open(os.path.join(d, "step.txt"), "w") as f:
                f.write(str(step))
print("training finished", flush=True)
