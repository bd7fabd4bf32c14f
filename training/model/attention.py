"""Causal self-attention kernels, and the Ulysses wrapper that makes them sequence-parallel.

Tensors are batch-first `[b, s, h, d]` throughout. With SP > 1, DeepSpeed's `DistributedAttention`
all-to-alls q/k/v from `[b, s/sp, h, d]` to `[b, s, h/sp, d]`, runs the local kernel on the full
sequence for a slice of heads, and all-to-alls the output back (scatter_idx=2, gather_idx=1, docs/DEEPSPEED_NOTES.md).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Test-only negative control: run the local kernel on the local shard without the all-to-all (wrong
# result whenever SP > 1). Never set this in a real run.
UNSAFE_NO_ULYSSES_ENV = "ULYSSESD_UNSAFE_NO_ULYSSES"

_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                  "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_func


def resolve_backend(backend: str, device: torch.device) -> str:
    """Concrete kernel for `attention.backend` on this device; raises with the reason if unusable."""
    if backend == "flash_attn":
        if _flash_attn_func() is None:
            raise ValueError("attention.backend='flash_attn' but the flash-attn package is not installed "
                             "(pip install 'ulyssesd[flash]', needs nvcc) - use 'auto' or 'cudnn'")
        if device.type != "cuda":
            raise ValueError("attention.backend='flash_attn' needs a CUDA device")
        return "flash_attn"
    if backend == "auto":
        # Unrestricted SDPA: on H200 (torch >= 2.5) its own priority picks cuDNN attention, the fastest
        # measured there (docs/DEEPSPEED_NOTES.md), and it can still fall back when a shape/dtype has no cuDNN kernel.
        return "sdpa"
    if backend != "math" and device.type != "cuda":
        raise ValueError(f"attention.backend={backend!r} needs a CUDA device; use 'auto' or 'math' on CPU")
    return backend


class LocalAttention(torch.nn.Module):
    """Causal attention on `[b, s, h, d]` (s = full sequence when called through Ulysses)."""

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def _sdpa_context(self):
        if self.backend in _SDPA_BACKENDS:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            return sdpa_kernel([getattr(SDPBackend, _SDPA_BACKENDS[self.backend])])
        return contextlib.nullcontext()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.backend == "flash_attn":
            return _flash_attn_func()(q, k, v, causal=True)
        # SDPA takes [b, h, s, d]; softmax runs in fp32 inside every SDPA kernel (math upcasts half too).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.backend == "math" and q.dtype in (torch.float16, torch.bfloat16):
            # The math kernel would softmax in half precision; keep softmax in fp32 as the model promises.
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)
        else:
            with self._sdpa_context():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)


class UlyssesAttention(torch.nn.Module):
    """Local attention, wrapped in DeepSpeed's DistributedAttention when an SP group is given."""

    def __init__(self, backend: str, sp_group=None, sp_size: int = 1):
        super().__init__()
        self.local = LocalAttention(backend)
        self.sp_size = sp_size
        self.dist_attn = None
        if sp_size > 1 and os.environ.get(UNSAFE_NO_ULYSSES_ENV) != "1":
            from deepspeed.sequence.layer import DistributedAttention
            self.dist_attn = DistributedAttention(self.local, sp_group, scatter_idx=2, gather_idx=1)
        elif sp_size > 1:
            log.warning("%s=1: sequence shards attend only to themselves - results are WRONG (test only)",
                        UNSAFE_NO_ULYSSES_ENV)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.dist_attn is not None:
            return self.dist_attn(q, k, v, 0)  # batch_dim_idx is a required positional (docs/DEEPSPEED_NOTES.md)
        return self.local(q, k, v)
