#!/bin/bash
# Device call 25 (issue 38): the three checkpoint-disk runs of bench/gpu_ckpt_disk.py on the machine's own 64 GB
# disk; the raw files come back as one tarball, summary.json beside it.
#   run(carry=[".whl"], timeout_s=600, command="bash bench/gpu_call25.sh")
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
df -h / /tmp > "$OUT/df.txt" 2>&1
timeout 560 python3 bench/gpu_ckpt_disk.py --out "$OUT/ckdisk" --free-gib 64 --seconds "${SECONDS_PER_RUN:-140,160,160}" \
  > "$OUT/ckdisk.log" 2>&1
echo "rc $?" >> "$OUT/ckdisk.log"
tail -c 4000 "$OUT/ckdisk.log"
cp "$OUT/ckdisk/summary.json" "$OUT/summary.json" 2>/dev/null
tar czf "$OUT/raw.tgz" -C "$OUT" ckdisk && rm -rf "$OUT/ckdisk"
