#!/bin/bash
# Device call 28 (issue 39): bench/gpu_loss_judgment.py at 8K on the shipped gpt-1b config (warm-up 5, LR 3e-4,
# observe mode): 2,050 healthy steps, then the LR x30 for 50 steps; stopped at 550 s whatever happens.
#   run(carry=[".whl"], timeout_s=600, command="bash bench/gpu_call28.sh")
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
python3 bench/gpu_loss_judgment.py --out "$OUT/lj" --seq "${SEQ:-8192}" --deadline-s "${LJ_DEADLINE_S:-550}" \
  > "$OUT/lj.log" 2>&1
echo "rc $?" >> "$OUT/lj.log"
tail -c 5000 "$OUT/lj.log"
cp "$OUT/lj/summary.json" "$OUT/summary.json" 2>/dev/null
tar czf "$OUT/raw.tgz" -C "$OUT" lj && rm -rf "$OUT/lj"
