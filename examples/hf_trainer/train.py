"""A Hugging Face Trainer run supervised by ulyssesd through `UlyssesCallback` (needs `pip install .[hf]`).

A tiny GPT-2 built from a config (no download), trained on random tokens; checkpoints in --output-dir get
manifests, so the daemon resumes only from complete ones. Under the daemon:

    [job]
    kind = "command"
    command = ["examples/hf_trainer/train.py", "--output-dir", "{checkpoint_dir}", "--resume", "{resume}"]
    checkpoint_dir = "hf-out"

    python examples/hf_trainer/train.py --output-dir /tmp/hf-out --max-steps 20     # by hand

Demo faults, on attempt 1 of a supervised run only ($ULYSSESD_ATTEMPT): EXAMPLE_KILL_AT=N SIGKILLs the
process at step N; EXAMPLE_NAN_AT=N makes the loss NaN from step N on (the weights really go bad).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ulyssesd.client.hf import UlyssesCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


FAULTY = os.environ.get("ULYSSESD_ATTEMPT", "1") == "1"
KILL_AT = int(os.environ.get("EXAMPLE_KILL_AT", "0")) if FAULTY else 0
NAN_AT = int(os.environ.get("EXAMPLE_NAN_AT", "0")) if FAULTY else 0


class FaultyTrainer(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if NAN_AT and self.state.global_step + 1 >= NAN_AT:
            loss = loss * float("nan")
        return loss


class KillAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if KILL_AT and state.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-steps", type=int, default=50)
    ap.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    ap.add_argument("--save-steps", type=int, default=10)
    args = ap.parse_args()
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                              logging_steps=1, save_steps=args.save_steps, report_to=[], logging_nan_inf_filter=False,
                              use_cpu=not torch.cuda.is_available())
    trainer = FaultyTrainer(model=model, args=targs, train_dataset=RandomTokens(512, 32, 128),
                            callbacks=[UlyssesCallback(tokens_per_step=4 * 32), KillAt()])
    trainer.train(resume_from_checkpoint=args.resume or None)


if __name__ == "__main__":
    main()
