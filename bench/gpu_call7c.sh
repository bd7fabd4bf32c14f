#!/bin/bash
# Device call 7c (nvidia-h200, one GPU; issue 20): each speed lever alone on top of ZeRO-3 leaf blocks. In
# call 7 the levers were measured alone on the plain product, whose steps jitter by +-10 % (ZeRO-3 hooks);
# with leaf blocks steps are within +-0.5 %, so one lever's effect is resolvable. gpt-1b, 32K, every layer
# recomputed, 6 steps each (median of steps 3-6).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="CALL_BUDGET_S=235 bash bench/gpu_call7c.sh")
# CPU dry run: BENCH_CPU=1 PRESET=tiny SEQ_SCALE=256 DEVICE=cpu bash bench/gpu_call7c.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
export BASE=configs/gpt-1b-1xh200.toml NPROC=1
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-1b} train.device=${DEVICE:-cuda} train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 train.zero3_leaf_blocks=true steps=6 timeout=50"
bench --case "name=leaf $C" \
      --case "name=leaf-rotary $C model.rotary_fused=true" \
      --case "name=leaf-keepattn $C model.checkpoint_keep_attention=true" \
      --case "name=leaf-norm $C model.norm_fp32_copy=false" \
      --case "name=leaf-vview $C model.qkv_copy=false" \
      --case "name=leaf-tiled $C train.loss_chunk_tokens=$((4096/S))"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
