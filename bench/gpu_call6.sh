#!/bin/bash
# Device call 6 (nvidia-h200-x2, session 2): (1) the fault run of call 5 again with the daemon's rank watch
# (call 5: torchrun's 30 s SIGTERM wait was 32 s of a 79 s MTTR) and per-rank stack dumps (call 5's dumps
# interleaved mid-line on one stderr; the hang attempt had no diagnosis); (2) 256K tokens with the tiled loss
# (untiled it cannot fit: planner 175.9 GiB); (3) one MFU lever at 32K: tiled loss frees memory for fewer
# recomputed blocks.
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
$PY bench/gpu_daemon.py --out "$OUT/daemon" --preset "${DPRESET:-gpt-1b}" --seq $((16384/${SEQ_SCALE:-1})) \
    --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" --phases faults \
    --fault-timeout 280 --deadline $((T0 + 300)) --fault-steps 30 --interval 10 --kill-at 13 --hang-at 24 \
    > "$OUT/daemon.log" 2>&1
tail -c 3500 "$OUT/daemon.log"
tar czf "$OUT/daemon.tgz" -C "$OUT" daemon && rm -rf "$OUT/daemon"
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-7b} train.device=${DEVICE:-cuda} train.zero3_leaf_blocks=true"
EXP=env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
bench --case "name=7b-32k-sel5-tiled4k-normbf16 $C $EXP train.seq_len=$((32768/S)) train.activation_checkpoint_layers=5 train.loss_chunk_tokens=$((4096/S)) model.norm_fp32_copy=false steps=10 timeout=80" \
      --case "name=7b-256k-ckpt1-tiled8k $C $EXP train.seq_len=$((262144/S)) train.activation_checkpoint_every=1 train.loss_chunk_tokens=$((8192/S)) steps=1 timeout=240"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
