#!/bin/bash
# Device call 8 (nvidia-h200, one GPU; issue 21): asynchronous checkpoints of gpt-1b at 16K (17 GB per tag) on one
# rank: the disk's own write speed and the snapshot/write probe, a synchronous save (bare job) against the
# asynchronous saves of the supervised job, a SIGKILL while a save is written in the background (the previous tag
# must be the one the next attempt loads), MTTR split, then a hang of the rank (detection after the last step).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="CALL_BUDGET_S=560 bash bench/gpu_call8.sh")
# CPU dry run (tiny model): BENCH_CPU=1 DPRESET=tiny DEVICE=cpu SEQ=64 DTYPE=fp32 DD_GIB=1 bash bench/gpu_call8.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
df -h /tmp > "$OUT/df.txt" 2>&1; free -g >> "$OUT/df.txt"
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" --preset "${DPRESET:-gpt-1b}" --seq "${SEQ:-16384}" --device "${DEVICE:-cuda}" \
    --dtype "${DTYPE:-bf16}" --dd-gib "${DD_GIB:-6}" --probe-gib "${DD_GIB:-6}" ${CKPT_ARGS:-} --deadline "$DEADLINE" \
    > "$OUT/ckpt.log" 2>&1
tail -c 7000 "$OUT/ckpt.log"
tar czf "$OUT/ckpt.tgz" -C "$OUT" ckpt && rm -rf "$OUT/ckpt"
echo "elapsed $(( $(date +%s) - T0 )) s"
