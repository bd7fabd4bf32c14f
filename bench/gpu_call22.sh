#!/bin/bash
# Device call 22 (nvidia-h100-x1; issues 39 and 33), ~5 min of command:
#  (a) the cost of the loss ladder's fp32 rung on the shipped gpt-1b config at 8K tokens, one rank, 12 steps each:
#      no fp32 blocks (the control), precision.fp32_layers=10 with fp32_mode full (today's rung: matmuls and
#      attention in fp32), tf32 (the same with TF32 tensor-core matmuls), residual (fp32 residual stream and
#      norms only, matmuls and attention in bf16);
#  (b) bench/gpu_standby_mem.py: what the warm standby holds on the GPU (replaces the planner's provisional 1 GiB).
#   run(carry=[".whl"], timeout_s=420, command="CALL_BUDGET_S=400 bash bench/gpu_call22.sh")
# CPU dry run: BENCH_CPU=1 BASE=configs/tiny-cpu.toml SEQ=64 CALL_BUDGET_S=900 bash bench/gpu_call22.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
SEQ=${SEQ:-8192}
BASE=${BASE:-configs/gpt-1b-1xh200.toml}
common="train.seq_len=$SEQ checkpoint.interval_steps=100000 timeout=150"
BENCH_DEADLINE=$((DEADLINE - 100)) BASE=$BASE NPROC=1 bench --steps 12 \
  --case "name=fp32-none $common" \
  --case "name=fp32-full10 precision.fp32_layers=10 precision.fp32_mode=full $common" \
  --case "name=fp32-tf32-10 precision.fp32_layers=10 precision.fp32_mode=tf32 $common" \
  --case "name=fp32-residual10 precision.fp32_layers=10 precision.fp32_mode=residual $common" \
  > "$OUT/fp32_rung.txt" 2>&1
cat "$OUT/fp32_rung.txt"
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -gt 95 ] && [ -z "${BENCH_CPU:-}" ]; then
  timeout 90 $PY bench/gpu_standby_mem.py --out "$OUT/standby" --budget 80 > "$OUT/standby_mem.txt" 2>&1
  tail -3 "$OUT/standby_mem.txt"
fi
collect_logs
