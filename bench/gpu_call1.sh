#!/bin/bash
# Device call 1 (nvidia-h200-x2): issue 3's 32K figure (20 steps), the planner-vs-measured peaks of issue 8,
# and the first MFU lever (selective recompute). Cases run one after another; none starts past the deadline.
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
S=${SEQ_SCALE:-1}   # CPU dry run divides the sequence lengths
C="model.preset=${PRESET:-gpt-7b} train.device=${DEVICE:-cuda}"
bench --case "name=7b-32k-ckpt1 $C train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 steps=20 timeout=200" \
      --case "name=7b-16k-nockpt $C train.seq_len=$((16384/S)) train.activation_checkpoint_every=0 steps=5 timeout=120" \
      --case "name=7b-8k-mb2-nockpt $C train.seq_len=$((8192/S)) train.micro_batch_size=2 train.activation_checkpoint_every=0 steps=5 timeout=120" \
      --case "name=7b-32k-ckpt4 $C train.seq_len=$((32768/S)) train.activation_checkpoint_every=4 steps=5 timeout=120" \
      --case "name=7b-64k-ckpt1 $C train.seq_len=$((65536/S)) train.activation_checkpoint_every=1 steps=5 timeout=150" \
      --case "name=7b-32k-sel8 $C train.seq_len=$((32768/S)) train.activation_checkpoint_layers=8 steps=8 timeout=120" \
      --case "name=7b-32k-offload $C train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 'deepspeed.config.zero_optimization.offload_optimizer={\"device\":\"cpu\",\"pin_memory\":true}' steps=3 timeout=240"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
cat "$OUT/bench.jsonl"
