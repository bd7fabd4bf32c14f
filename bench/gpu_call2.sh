#!/bin/bash
# Device call 2 (nvidia-h200-x2): why call 1 was slower than the reference (micro-benchmarks + a profiled
# step), the fix (linear layers called as modules so ZeRO-3 prefetches their weights), MFU levers one at a
# time, the 128K point of the sequence curve, and the optimizer-offload planner point.
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-7b} train.device=${DEVICE:-cuda}"
if [ -z "${BENCH_CPU:-}" ]; then
  NCCL_DEBUG=INFO timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/gpu_micro.py \
    > "$OUT/micro.log" 2>&1
  grep -m 12 "via\|NCCL version" "$OUT/micro.log" > "$OUT/nccl_transport.txt"; grep '^{' "$OUT/micro.log"
fi
EXP=env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
bench --case "name=7b-32k-ckpt1-fix $C train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 steps=8 env.ULYSSESD_PROFILE_STEP=8 timeout=120" \
      --case "name=7b-32k-sel8-fix $C train.seq_len=$((32768/S)) train.activation_checkpoint_layers=8 steps=6 timeout=100" \
      --case "name=7b-32k-sel6-normbf16-exp $C train.seq_len=$((32768/S)) train.activation_checkpoint_layers=6 model.norm_fp32_copy=false $EXP steps=6 timeout=100" \
      --case "name=7b-128k-ckpt1 $C train.seq_len=$((131072/S)) train.activation_checkpoint_every=1 steps=3 timeout=150" \
      --case "name=7b-16k-nockpt-fix $C train.seq_len=$((16384/S)) train.activation_checkpoint_every=0 steps=6 timeout=90" \
      --case "name=7b-32k-offload $C train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 'deepspeed.config.zero_optimization.offload_optimizer={\"device\":\"cpu\",\"pin_memory\":true}' steps=3 timeout=200"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
