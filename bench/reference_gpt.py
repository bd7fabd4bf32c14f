"""The plain DeepSpeed GPT that the product is measured against (issue 20), run by bench/gpu_bench.py.

A ~60-line model of the same shape as the product's preset: pre-LN, GELU 4h MLP, no bias, NO positional
encoding, torch AdamW, ZeRO-3 bf16 with DeepSpeed's usual knobs (parameter persistence threshold 1e6,
overlap_comm, reduce bucket 1e8, prefetch bucket 5e8; env REFERENCE_PERSISTENCE_THRESHOLD overrides the
threshold), no leaf modules, untiled fp32 loss, SDPA (cuDNN on
Hopper). It reads the same spec.toml the product case would get (model shape, seq_len, steps, recompute,
optimizer hyper-parameters) and writes the product's telemetry fields (`kind: step`, `step_time_s`, `tokens`,
`mem_max_allocated_gib`, ...) so gpu_bench.py times both with one code path: per step, wall time from the
batch to the synchronized end of the optimizer step, peak `max_memory_allocated` reset per step.

    torchrun --standalone --nproc_per_node 1 bench/reference_gpt.py --spec run/spec.toml --run-dir run
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h, bias=False), nn.LayerNorm(h, bias=False)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.fc_in, self.fc_out = nn.Linear(h, ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, h: int, layers: int, heads: int, ffn: int, recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, ffn) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(h, bias=False), nn.Linear(h, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.recompute else blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


# The reference's one knob for an equal-settings check of the product's persistence lever (1e6 otherwise).
PERSISTENCE_THRESHOLD = int(float(os.environ.get("REFERENCE_PERSISTENCE_THRESHOLD", "1e6")))


def ds_config(train: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": train["gradient_clipping"], "bf16": {"enabled": True},
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": train["lr"], "betas": list(train["betas"]),
                                                      "eps": 1e-8, "weight_decay": train["weight_decay"],
                                                      "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
                                  "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": int(1e8), "stage3_prefetch_bucket_size": int(5e8)}}


def settings(spec_path: Path) -> tuple[dict, dict]:
    """(resolved model shape, train section) of a product spec; recompute = every layer or none."""
    import tomllib

    from ulyssesd.training.spec import job_spec_from_dict

    job = job_spec_from_dict(tomllib.loads(spec_path.read_text()), str(spec_path))
    tr = job.train
    if tr.activation_checkpoint_layers is not None or tr.activation_checkpoint_every not in (0, 1):
        raise SystemExit(f"{spec_path}: the reference recomputes every layer or none "
                         f"(train.activation_checkpoint_every 0 or 1, no activation_checkpoint_layers)")
    if job.train.micro_batch_size != 1 or job.parallel.sequence_parallel_size != 1:
        raise SystemExit(f"{spec_path}: the reference runs micro-batch 1 at SP=1 only")
    return job.resolved_model().model_dump(), tr.model_dump()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, required=True, help="the case's spec.toml (written by gpu_bench.py)")
    ap.add_argument("--run-dir", type=Path, required=True, help="telemetry.jsonl is written here")
    ap.add_argument("--attempt", type=int, default=1, help="accepted for gpu_bench.py's command line; unused")
    args = ap.parse_args()
    m, tr = settings(args.spec)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else a ~60 s C++ build on CPU (inference only)
    deepspeed.init_distributed()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(tr["seed"])
    cfg = ds_config(tr)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = PlainGPT(m["vocab_size"], m["hidden_size"], m["num_layers"], m["num_attention_heads"],
                         m["ffn_hidden_size"], recompute=tr["activation_checkpoint_every"] == 1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    world, seq = int(os.environ.get("WORLD_SIZE", 1)), tr["seq_len"]
    args.run_dir.mkdir(parents=True, exist_ok=True)
    tele = open(args.run_dir / "telemetry.jsonl", "a") if int(os.environ.get("RANK", 0)) == 0 else None

    def record(**rec) -> None:
        if tele is not None:
            tele.write(json.dumps({"time": time.time(), **rec}) + "\n")
            tele.flush()

    record(kind="event", event="started", step=0)
    gen = torch.Generator(device=dev).manual_seed(tr["seed"])
    for step in range(1, tr["steps"] + 1):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        tok = torch.randint(0, m["vocab_size"], (1, seq + 1), device=dev, generator=gen)
        loss = engine(tok[:, :-1], tok[:, 1:])
        engine.backward(loss)
        engine.step()
        loss_value = float(loss.detach())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        step_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        reserved = torch.cuda.memory_reserved(dev) / 2**30 if dev.type == "cuda" else 0.0
        record(kind="step", step=step, loss=loss_value, step_time_s=round(step_s, 6), tokens=seq * world,
               mem_max_allocated_gib=round(peak, 4), mem_reserved_gib=round(reserved, 4))
    record(kind="event", event="exiting", step=tr["steps"], reason="completed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
