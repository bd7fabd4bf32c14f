#!/bin/bash
# Device call 7b (nvidia-h200, one GPU; issue 20), after call 7: the best build of call 7 again beside the
# reference (same call), + fused AdamW, torch.compile of the whole engine under ZeRO-3 (train.compile), a
# profiled no-recompute step (where the rest of the gap is), and 256K tokens with every lever (2 steps: the
# second one has the Adam moments allocated, the steady-state peak).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="CALL_BUDGET_S=580 bash bench/gpu_call7b.sh")
# CPU dry run: BENCH_CPU=1 PRESET=tiny SEQ_SCALE=256 DEVICE=cpu bash bench/gpu_call7b.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
export BASE=configs/gpt-1b-1xh200.toml NPROC=1
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-1b} model.max_seq_len=1048576 train.device=${DEVICE:-cuda}"
L32="train.seq_len=$((32768/S))"
R1="train.activation_checkpoint_every=1"; R0="train.activation_checkpoint_every=0"
ALL="model.rotary_fused=true model.norm_fp32_copy=false model.qkv_copy=false train.zero3_leaf_blocks=true"
KEEP="model.checkpoint_keep_attention=true"; FA="train.fused_adam=true"
bench --case "name=ref-ckpt1 program=reference $C $L32 $R1 steps=8 timeout=100" \
      --case "name=p-ckpt1-all $C $L32 $R1 $ALL train.loss_chunk_tokens=$((4096/S)) $KEEP steps=8 timeout=100" \
      --case "name=p-ckpt1-all-fadam $C $L32 $R1 $ALL train.loss_chunk_tokens=$((4096/S)) $KEEP $FA steps=8 timeout=100" \
      --case "name=ref-nockpt program=reference $C $L32 $R0 steps=8 timeout=100" \
      --case "name=p-nockpt-all-fadam $C $L32 $R0 $ALL train.loss_chunk_tokens=$((4096/S)) $FA steps=8 timeout=100" \
      --case "name=p-ckpt1-all-compile $C $L32 $R1 $ALL train.loss_chunk_tokens=$((4096/S)) $KEEP train.compile=true steps=8 timeout=150" \
      --case "name=p-nockpt-all-prof $C $L32 $R0 $ALL train.loss_chunk_tokens=$((4096/S)) env.ULYSSESD_PROFILE_STEP=6 steps=6 timeout=90" \
      --case "name=p-256k-all-keep $C train.seq_len=$((262144/S)) $R1 $ALL train.loss_chunk_tokens=$((8192/S)) $KEEP steps=2 timeout=200" \
      --case "name=p-nockpt-all-compile $C $L32 $R0 $ALL train.loss_chunk_tokens=$((4096/S)) train.compile=true steps=8 timeout=150"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
