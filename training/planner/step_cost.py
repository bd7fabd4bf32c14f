"""The step-time cost model of the memory levers: how much slower one optimizer step gets (a fraction of the
step without any memory lever) for each setting the fix search (`fixes.py`) may choose. One row per lever;
each row says where its figure comes from: a measurement in bench/RESULTS.md (device call, configuration,
the two step times) or, where none exists, an estimate and how it was made (docs/PLANNER.md "The fix search").

The costs add (a sum of fractions): exact for one lever, an approximation for several. The search ranks the
fitting combinations by this sum, so only the order matters for the choice; `bench/gpu_plan_grid.py --score`
checks the predicted ratios of step times against measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import ResolvedModel


@dataclass(frozen=True)
class LeverCost:
    """One lever's step-time cost and where the figure comes from."""

    fraction: float   # extra step time over the same step without this lever (0.113 = +11.3 %)
    source: str       # "measured: ..." (bench/RESULTS.md row) or "estimate: ..." (how it was made)

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


# Recomputing every block, per block share (cost = fraction x recomputed blocks / L). bench/RESULTS.md "GPU: step
# speed on 1xH200 against a plain DeepSpeed GPT", gpt-1b 32K micro-batch 1: the plain reference 1.507 s with every
# layer recomputed vs 1.211 s without (call 7b, +24.4 %); the product without keep-attention 1.722 s vs its
# keep-attention build's 1.538 s (call 7c), i.e. the same +24-25 %.
RECOMPUTE = LeverCost(0.244, "measured: gpt-1b 32K on 1xH200, every layer recomputed 1.507 s vs none 1.211 s "
                             "(bench/RESULTS.md, call 7b reference rows)")
# Recompute with model.checkpoint_keep_attention (the attention kernel's forward is not re-run): the shipped
# build 1.345 s with every layer recomputed vs 1.208 s without (call 7b, +11.3 %).
RECOMPUTE_KEEP_ATTENTION = LeverCost(0.113, "measured: gpt-1b 32K on 1xH200, every layer recomputed with "
                                            "keep-attention 1.345 s vs none 1.208 s (bench/RESULTS.md, call 7b)")
# Micro-batch halved, accumulation doubled (same global batch): issue 21's OOM run on 1xH200 trained micro-batch
# 2 x accumulation 2 at 32K in 4.76 s per step = 1.19 s per sequence vs the shipped micro-batch 1's 1.208 s
# (call 9 vs call 7b): no cost while a micro-batch keeps the GPU busy. Below LONG_ENOUGH_TOKENS local tokens per
# micro-batch the GPU is no longer saturated: an estimate per halving.
MICRO_BATCH_SPLIT = LeverCost(0.0, "measured: gpt-1b 32K on 1xH200, micro-batch 2 x accumulation 2 1.19 s per "
                                   "sequence vs micro-batch 1's 1.208 s (bench/RESULTS.md, calls 9 and 7b)")
MICRO_BATCH_SPLIT_SHORT = LeverCost(0.05, "estimate: +5 % per halving below 8K local tokens per micro-batch "
                                          "(kernels no longer saturate the GPU); not measured")
LONG_ENOUGH_TOKENS = 8192
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: no speed change (MFU levers row 4, gpt-7b 32K on 2xH200).
EXPANDABLE_SEGMENTS = LeverCost(0.0, "measured: no speed change (bench/RESULTS.md 'GPU: MFU levers' row 4)")
# Lower persistence threshold / fewer live parameters / smaller prefetch: more, smaller ZeRO-3 fetches.
# Persistence 1e10 vs 1e6 on one H200 was +0.5 % (call 12, noise); the other direction is not measured.
PERSISTENCE_LOWER = LeverCost(0.01, "estimate: +1 % (more per-module fetches); the opposite change measured "
                                    "+0.5 % on 1xH200 (bench/RESULTS.md, call 12)")
LIVE_PARAMS_HALVED = LeverCost(0.01, "estimate: +1 % per halving of stage3_max_live_parameters and prefetch "
                                     "(less fetch overlap); not measured")
# Checkpointed inputs offloaded to pinned host RAM (model.offload_checkpoints): the copies overlap compute; the
# 1M run (call 20) mixes it with other levers, so no figure of its own.
OFFLOAD_CHECKPOINTS = LeverCost(0.05, "estimate: +5 % (D2H/H2D copies of the block inputs, mostly overlapped); "
                                      "not measured alone")
# ZeRO-Offload: optimizer step on the CPU (DeepSpeedCPUAdam) and gradients over PCIe every step.
OFFLOAD_OPTIMIZER = LeverCost(0.5, "estimate: +50 % (CPU Adam + PCIe gradient traffic every step); not measured "
                                   "(bench/RESULTS.md: optimizer offload 'Not measured')")
OFFLOAD_PARAMS = LeverCost(1.0, "estimate: +100 % more (every parameter crosses PCIe twice per step); not measured")


# The daemon's host-memory switches (`[restart] standby_preload` / `standby`) change restart time, never the step:
# a relaunch without the preloaded tag or without the warm standby starts slower (1xH200 gpt-1b: 17.86 s warm
# vs 27.80 s cold, device call 13), so they cost no step time; the fix ranking then lists a GPU-only fix of
# the same step time first (fewer changes).
STANDBY_OFF = LeverCost(0.0, "measured: no step-time change (restart time only: 17.86 s warm vs 27.80 s cold "
                             "relaunch on 1xH200, bench/RESULTS.md call 13)")
# Blocking saves instead of async ones: gpt-1b on 1xH200 blocks ~44 s per save instead of 0.33 s (calls 13-14);
# at the shipped interval of 500 steps of 1.2 s that is 44/600 of the training time. Scales with the tag's size
# and the save interval, which this row does not model.
SYNC_SAVES = LeverCost(0.07, "estimate: +7 % (a blocking save ~44 s instead of 0.33 s async every 500 steps of "
                             "1.2 s, gpt-1b on 1xH200, bench/RESULTS.md calls 13-14); scales with the save interval")


def _flops_per_token(m: ResolvedModel, seq_len: int) -> float:
    """Training FLOPs per token as bench/gpu_bench.py counts them (docs/DEEPSPEED_NOTES.md): 6·N_non-embedding +
    6·V·h + 6·L·h·S (causal attention)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    mlp_mats = 3 if m.mlp == "swiglu" else 2
    n_non_emb = m.num_layers * (4 * h * h + mlp_mats * h * f)
    return 6 * n_non_emb + 6 * m.vocab_size * h + 6 * m.num_layers * h * seq_len


def tiled_loss_cost(m: ResolvedModel, seq_len: int) -> LeverCost:
    """train.loss_chunk_tokens: each chunk's head forward runs again in backward (2·V·h FLOPs per token)."""
    frac = 2 * m.vocab_size * m.hidden_size / _flops_per_token(m, seq_len)
    return LeverCost(frac, f"estimate: +{frac:.1%} (FLOPs of one more head forward); not resolvable alone on a GPU "
                           "so far (bench/RESULTS.md, call 7: within the plain product's jitter)")


def tiled_mlp_cost(m: ResolvedModel, seq_len: int) -> LeverCost:
    """model.mlp_chunk_tokens (TiledMLP): each block's MLP forward runs once more in backward."""
    fin = (2 if m.mlp == "swiglu" else 1) * m.ffn_hidden_size
    frac = m.num_layers * 2 * m.hidden_size * (fin + m.ffn_hidden_size) / _flops_per_token(m, seq_len)
    return LeverCost(frac, f"estimate: +{frac:.1%} (FLOPs of one more MLP forward per block); not measured")


def recompute_cost(m: ResolvedModel, recomputed_blocks: int, keep_attention: bool) -> float:
    """Extra step time of recomputing `recomputed_blocks` of the L blocks (every-k chunks recompute all L)."""
    row = RECOMPUTE_KEEP_ATTENTION if keep_attention else RECOMPUTE
    return row.fraction * min(recomputed_blocks, m.num_layers) / m.num_layers


def micro_batch_cost(tokens_per_micro_batch: int, halvings: int) -> float:
    """Extra step time of splitting the micro-batch `halvings` times (global batch kept)."""
    if tokens_per_micro_batch >= LONG_ENOUGH_TOKENS:
        return MICRO_BATCH_SPLIT.fraction * halvings
    return MICRO_BATCH_SPLIT_SHORT.fraction * halvings


def cost_table(m: ResolvedModel, seq_len: int) -> list[tuple[str, LeverCost]]:
    """Every lever's row, for `ulyssesctl plan --json`, the docs and the grid's scoring."""
    return [("recompute every block", RECOMPUTE), ("recompute every block, keep attention", RECOMPUTE_KEEP_ATTENTION),
            ("micro-batch split (>= 8K local tokens)", MICRO_BATCH_SPLIT),
            ("micro-batch split (< 8K local tokens)", MICRO_BATCH_SPLIT_SHORT),
            ("tiled loss", tiled_loss_cost(m, seq_len)), ("TiledMLP", tiled_mlp_cost(m, seq_len)),
            ("expandable segments", EXPANDABLE_SEGMENTS), ("lower persistence threshold", PERSISTENCE_LOWER),
            ("halve live parameters + prefetch", LIVE_PARAMS_HALVED),
            ("offload checkpointed inputs", OFFLOAD_CHECKPOINTS), ("offload optimizer to CPU", OFFLOAD_OPTIMIZER),
            ("offload parameters to CPU", OFFLOAD_PARAMS), ("warm standby / its preload off", STANDBY_OFF),
            ("blocking saves (async_save off)", SYNC_SAVES)]
