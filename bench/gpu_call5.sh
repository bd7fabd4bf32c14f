#!/bin/bash
# Device call 5 (nvidia-h200-x2, session 2): supervision on the real GPUs with the stable build (ZeRO-3 leaf
# blocks: steps within ±0.5 %, call 4). Overhead: gpt-7b 32K SP=2 (selective recompute 8, the fastest build),
# bare then supervised, 20 steps each. Faults (gpt-1b 16K, a 17 GB checkpoint): SIGKILL of rank 1 after step 13
# -> MTTR split; on attempt 2 rank 1 hangs before step 24 so rank 0 waits inside an NCCL collective -> detection
# with the calibrated timeout, stacks, kill, resume; the incident's diagnosis.
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
$PY bench/gpu_daemon.py --out "$OUT/daemon" --preset "${DPRESET:-gpt-1b}" --seq $((16384/${SEQ_SCALE:-1})) \
    --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" \
    --overhead-preset "${OPRESET:-gpt-7b}" --overhead-seq $((32768/${SEQ_SCALE:-1})) \
    --overhead-ckpt "${OCKPT:-activation_checkpoint_layers = 8}" --overhead-rounds "${OROUNDS:-1}" \
    --overhead-steps "${OSTEPS:-20}" --phase-timeout 150 \
    --fault-timeout 330 --deadline "$DEADLINE" --fault-steps 30 --interval 10 --kill-at 13 --hang-at 24 \
    > "$OUT/daemon.log" 2>&1
tail -c 6000 "$OUT/daemon.log"
tar czf "$OUT/daemon.tgz" -C "$OUT" daemon && rm -rf "$OUT/daemon"
echo "elapsed $(( $(date +%s) - T0 )) s"
