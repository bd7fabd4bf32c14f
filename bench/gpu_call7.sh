#!/bin/bash
# Device call 7 (nvidia-h200, one GPU; issue 20): gpt-1b at 32K, SP=1, against the plain DeepSpeed GPT of
# bench/reference_gpt.py in the same call. Both rows of the issue (every layer recomputed / no recompute):
# reference, product as it was, product with every speed lever; then each lever alone on the recompute row.
# Cases run in this order until the call's deadline (gpu_bench.py skips what cannot finish).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="CALL_BUDGET_S=545 bash bench/gpu_call7.sh")
# CPU dry run (tiny model, same case strings): BENCH_CPU=1 PRESET=tiny SEQ_SCALE=256 DEVICE=cpu bash bench/gpu_call7.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
export BASE=configs/gpt-1b-1xh200.toml NPROC=1
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-1b} train.device=${DEVICE:-cuda} train.seq_len=$((32768/S))"
R1="train.activation_checkpoint_every=1"; R0="train.activation_checkpoint_every=0"
# Every lever of the product (each measured alone below); keep_attention only matters when blocks recompute.
ALL="model.rotary_fused=true model.norm_fp32_copy=false model.qkv_copy=false train.zero3_leaf_blocks=true train.loss_chunk_tokens=$((4096/S))"
KEEP="model.checkpoint_keep_attention=true"
bench --case "name=ref-ckpt1 program=reference $C $R1 steps=8 timeout=100" \
      --case "name=p-ckpt1-base $C $R1 steps=8 timeout=100" \
      --case "name=p-ckpt1-all $C $R1 $ALL $KEEP steps=8 timeout=130" \
      --case "name=ref-nockpt program=reference $C $R0 steps=8 timeout=100" \
      --case "name=p-nockpt-all $C $R0 $ALL steps=8 timeout=130" \
      --case "name=p-nockpt-base $C $R0 steps=8 timeout=100" \
      --case "name=p-ckpt1-keepattn $C $R1 $KEEP steps=6 timeout=90" \
      --case "name=p-ckpt1-rotary $C $R1 model.rotary_fused=true steps=6 timeout=110" \
      --case "name=p-ckpt1-norm $C $R1 model.norm_fp32_copy=false steps=6 timeout=90" \
      --case "name=p-ckpt1-leaf $C $R1 train.zero3_leaf_blocks=true steps=6 timeout=90" \
      --case "name=p-ckpt1-tiled $C $R1 train.loss_chunk_tokens=$((4096/S)) steps=6 timeout=90" \
      --case "name=p-ckpt1-vview $C $R1 model.qkv_copy=false steps=6 timeout=90"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
