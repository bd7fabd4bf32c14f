#!/bin/bash
# Device call 11 (nvidia-h200, one GPU; issue 21): where a cold start-up of the job goes. gpt-1b at 16K, bare job
# (torchrun, one rank): 2 steps and a save of the 17 GB tag, then a fresh process resuming from it with every
# start-up phase timed, then the same with a cProfile per phase (bench/gpu_startup21.py). Then, if time is left,
# the pinned probe at 17 GiB: cudaHostRegister of pageable memory in chunks of 256 MiB / 1 GiB / 4 GiB while a GPU
# loop runs (the stall per chunk: how a registered snapshot pool can be built at attempt start).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=360, command="CALL_BUDGET_S=320 bash bench/gpu_call11.sh")
# CPU dry run: BENCH_CPU=1 SKIP_PROBE=1 DPRESET=tiny DEVICE=cpu SEQ=64 DTYPE=fp32 bash bench/gpu_call11.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
free -g > "$OUT/host.txt" 2>&1; df -h /tmp >> "$OUT/host.txt" 2>&1; nproc >> "$OUT/host.txt"
$PY bench/gpu_startup21.py --out "$OUT/startup" --preset "${DPRESET:-gpt-1b}" --seq "${SEQ:-16384}" \
    --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" ${DROP:---drop-caches} --run-timeout 130 \
    --deadline $((DEADLINE - ${PROBE_RESERVE_S:-50})) > "$OUT/startup.log" 2>&1
grep -v '^ *"' "$OUT/startup.log" | tail -c 6000
LEFT=$((DEADLINE - $(date +%s)))
if [ -z "${SKIP_PROBE:-}" ] && [ "$LEFT" -gt 35 ]; then
  timeout $((LEFT - 5)) $PY bench/gpu_pinned_probe.py --gib "${PROBE_GIB:-17}" --register-chunks-mib 4096,1024,256 \
      --out "$OUT/startup/register_chunks.json" > "$OUT/probe.log" 2>&1
  tail -c 2500 "$OUT/probe.log"
else
  echo "probe skipped (${LEFT} s left)"
fi
tar czf "$OUT/startup.tgz" -C "$OUT" startup && rm -rf "$OUT/startup"
echo "elapsed $(( $(date +%s) - T0 )) s"
