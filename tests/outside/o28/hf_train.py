"""An HF Trainer script WITHOUT ulyssesd's callback: a tiny GPT-2 from a config, random tokens,
checkpoint-N/ folders in --output-dir, `--resume-from-checkpoint DIR` to continue.

Faults come from faults.py through a plain TrainerCallback of this script's own.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import maybe_fault  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)   # random tokens: a steady loss near ln(vocab)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Faults(TrainerCallback):
    def __init__(self, model, sleep: float):
        self.model = model
        self.sleep = sleep

    def on_step_end(self, args, state, control, **kwargs):
        import time

        def poison() -> None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.mul_(float("nan"))

        maybe_fault(state.global_step, poison)
        time.sleep(self.sleep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-steps", type=int, default=120)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.03)
    ap.add_argument("--resume-from-checkpoint", default=None)
    ap.add_argument("--tqdm", action="store_true", help="keep the Trainer's progress bar (disable_tqdm=False)")
    ap.add_argument("--nan-filter", action="store_true", help="keep HF's default logging_nan_inf_filter=True")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                              learning_rate=3e-3, logging_steps=1, save_steps=args.save_steps, report_to=[],
                              logging_nan_inf_filter=args.nan_filter, use_cpu=True, disable_tqdm=not args.tqdm,
                              dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(256, 16, 32),
                      callbacks=[Faults(model, args.sleep)])
    if args.resume_from_checkpoint:
        print(f"resuming from {args.resume_from_checkpoint}", flush=True)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint or None)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
