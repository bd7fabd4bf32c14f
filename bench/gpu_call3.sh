#!/bin/bash
# Device call 3 (nvidia-h200-x2): two levers for issue 3/7 at 32K, one at a time against call 2's
# 7b-32k-ckpt1-fix (NCCL_PROTO=Simple: the profile showed ZeRO all-gathers on RING_LL and a 26 GB/s Ulysses
# all-to-all; fused AdamW: the foreach AdamW took 417 ms of GPU time per step; then both + ZeRO-3 leaf blocks,
# as the profile showed 2.9 s of CPU per step in ZeRO-3 hooks), then supervision
# on the real GPUs with gpt-1b (bench/gpu_daemon.py): overhead bare vs daemon, MTTR after SIGKILL, NCCL hang.
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
C="model.preset=${PRESET:-gpt-7b} train.device=${DEVICE:-cuda}"
S=${SEQ_SCALE:-1}
if [ -z "${SKIP_LEVER:-}" ]; then
  BENCH_DEADLINE=$((T0 + 160))  # the supervision phases below must keep >= 280 s
  K="$C train.seq_len=$((32768/S)) train.activation_checkpoint_every=1 steps=6 timeout=70"
  bench --case "name=7b-32k-ckpt1-leaf-fused-proto $K train.zero3_leaf_blocks=true train.fused_adam=true env.NCCL_PROTO=Simple" \
        --case "name=7b-32k-ckpt1-fusedadam $K train.fused_adam=true"
fi
left=$(( DEADLINE - $(date +%s) ))
echo "left for the daemon phases: $left s"
$PY bench/gpu_daemon.py --out "$OUT/daemon" --preset "${DPRESET:-gpt-1b}" --seq $((16384/S)) --device "${DEVICE:-cuda}" \
    --dtype "${DTYPE:-bf16}" --overhead-steps "${OSTEPS:-25}" --phase-timeout 100 \
    --fault-timeout 300 --deadline "$DEADLINE" --fault-steps 30 --interval 10 --kill-at 13 --hang-at 24 > "$OUT/daemon.log" 2>&1
tail -c 5000 "$OUT/daemon.log"
collect_logs
tar czf "$OUT/daemon.tgz" -C "$OUT" daemon && rm -rf "$OUT/daemon"
echo "elapsed $(( $(date +%s) - T0 )) s"
