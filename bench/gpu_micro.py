"""Micro-benchmarks that explain end-to-end numbers on the lent GPUs (run with torchrun, 2 ranks):
bf16 matmul TF/s, causal SDPA fwd+bwd TF/s per backend at the Ulysses-local shape, and NCCL
all-gather / reduce-scatter bus bandwidth at ZeRO-3 block size. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def timed(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    out: dict = {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ a, 10)
    out["matmul_8k_tflops"] = round(2 * 8192**3 / t / 1e12, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    s, h, d = 32768, 16, 128  # 32K, 32 heads / SP=2, head_dim 128
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 4 * s * s * h * d / 2 * 3.5  # causal fwd (2 matmuls) + bwd (2.5x)
    for name, be in (("auto", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def step(be=be):
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            if be is None:
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            else:
                with sdpa_kernel([be]):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            o.sum().backward()
        try:
            out[f"sdpa_{name}_tflops"] = round(flops / timed(step, 3) / 1e12, 1)
        except Exception as exc:  # noqa: BLE001
            out[f"sdpa_{name}_error"] = str(exc)[:200]
    n = 201_326_592  # one gpt-7b block, bf16
    full = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    shard = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: dist.all_gather_into_tensor(full, shard), 10)
    out["allgather_block_ms"] = round(t * 1e3, 2)
    out["allgather_busbw_GBps"] = round(n * 2 / 2 / t / 1e9, 1)
    t = timed(lambda: dist.reduce_scatter_tensor(shard, full), 10)
    out["reducescatter_block_ms"] = round(t * 1e3, 2)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
