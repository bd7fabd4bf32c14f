#!/bin/bash
# Device call 23 (issue 30): the planner's fit verdicts and lever costs against 24 real gpt-1b configurations
# around an 80 GB GPU's edge (bench/gpu_plan_grid.py). On an H200 the jobs' allocator is capped at 79.1 GiB
# (ULYSSESD_GPU_MEMORY_CAP_GIB; the planner's usable figure for an H100 80 GB) so that it stands in for one.
#   run(carry=[".whl"], timeout_s=600, command="bash bench/gpu_call23.sh")
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${total_mib:-0}" -gt 100000 ]; then export ULYSSESD_GPU_MEMORY_CAP_GIB=79.1; fi
echo "gpu memory ${total_mib} MiB, cap ${ULYSSESD_GPU_MEMORY_CAP_GIB:-none}" | tee "$OUT/cap.txt"
python3 bench/gpu_plan_grid.py --out "$OUT/grid" --budget-s "${GRID_BUDGET_S:-520}" > "$OUT/grid.log" 2>&1
tail -30 "$OUT/grid.log"
