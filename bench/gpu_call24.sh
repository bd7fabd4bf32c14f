#!/bin/bash
# Device call 24 (issue 30): the real OOM spec (gpt-1b, 32K, micro-batch 4, no recompute, preflight off) under the
# daemon: on an 80 GB card (an H100, or an H200 whose jobs' allocator is capped at 79.1 GiB by
# ULYSSESD_GPU_MEMORY_CAP_GIB, the daemon's planner planning for the same cap) and, on an H200, uncapped too.
# Ends: COMPLETED? restarts? the chosen combination and its predicted cost (incidents --json in the raw files).
#   run(carry=[".whl"], timeout_s=600, command="CALL_BUDGET_S=570 bash bench/gpu_call24.sh")
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "gpu memory ${total_mib} MiB" | tee "$OUT/card.txt"
if [ "${total_mib:-0}" -gt 100000 ]; then
  ULYSSESD_GPU_MEMORY_CAP_GIB=79.1 python3 bench/gpu_oom21.py --out "$OUT/oom80" --work /tmp/oom80 --runs oom \
    --timeout 260 --deadline $((DEADLINE - 150)) > "$OUT/oom80.log" 2>&1
  python3 bench/gpu_oom21.py --out "$OUT/oom141" --work /tmp/oom141 --runs oom --timeout 240 --deadline "$DEADLINE" \
    > "$OUT/oom141.log" 2>&1
else
  python3 bench/gpu_oom21.py --out "$OUT/oom80" --work /tmp/oom80 --runs oom --timeout 400 --deadline "$DEADLINE" \
    > "$OUT/oom80.log" 2>&1
fi
tail -c 3000 "$OUT"/oom*.log
tar czf "$OUT/raw.tgz" -C "$OUT" $(cd "$OUT" && ls -d oom80 oom141 2>/dev/null) && rm -rf "$OUT/oom80" "$OUT/oom141"
