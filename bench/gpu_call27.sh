#!/bin/bash
# Device call 27 (issue 38, on the final tree): bench/gpu_ckpt_disk.py's r3 (NaN on attempts 1-4: every rollback sets
# a 17 GB lineage aside) and, budget allowing, r1/r2 again, on the machine's own disk filled to 64 GiB free.
#   run(carry=[".whl"], timeout_s=600, command="RUNS=r3 SECS=240 bash bench/gpu_call27.sh")
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
df -h / /tmp > "$OUT/df.txt" 2>&1
timeout $((DEADLINE - $(date +%s))) python3 bench/gpu_ckpt_disk.py --out "$OUT/ckdisk" --free-gib 64 \
  --runs "${RUNS:-r3}" --seconds "${SECS:-240}" > "$OUT/ckdisk.log" 2>&1
echo "rc $?" >> "$OUT/ckdisk.log"
tail -c 4000 "$OUT/ckdisk.log"
cp "$OUT/ckdisk/summary.json" "$OUT/summary.json" 2>/dev/null
tar czf "$OUT/raw.tgz" -C "$OUT" ckdisk && rm -rf "$OUT/ckdisk"
