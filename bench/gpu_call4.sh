#!/bin/bash
# Device call 4 (nvidia-h200-x2, session 2): issue 3's 20-step figure with the shipped gpt-7b-2xh200 build
# (zero3_leaf_blocks + NCCL_PROTO=Simple, torch AdamW), the lever never combined with it (selective recompute,
# 8 of 32 blocks checkpointed), the two parts of call 3's row 6 separated (leaf blocks without NCCL_PROTO=Simple),
# a profiled step of the fastest build, and the 64K/128K points of the curve with the new build.
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-7b} train.device=${DEVICE:-cuda} train.zero3_leaf_blocks=true"
P=env.NCCL_PROTO=Simple
bench --case "name=7b-32k-ckpt1-leaf-proto-20 $C $P train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 steps=20 timeout=150" \
      --case "name=7b-32k-sel8-leaf-proto-20 $C $P train.seq_len=$((32768/S)) train.activation_checkpoint_layers=8 steps=20 timeout=130" \
      --case "name=7b-32k-ckpt1-leaf-noproto $C train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 steps=8 timeout=90" \
      --case "name=7b-32k-sel8-leaf-proto-prof $C $P train.seq_len=$((32768/S)) train.activation_checkpoint_layers=8 steps=8 env.ULYSSESD_PROFILE_STEP=7 timeout=90" \
      --case "name=7b-64k-ckpt1-leaf-proto $C $P train.seq_len=$((65536/S)) train.activation_checkpoint_every=1 steps=4 timeout=90" \
      --case "name=7b-128k-ckpt1-leaf-proto $C $P train.seq_len=$((131072/S)) train.activation_checkpoint_every=1 steps=3 timeout=130"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
