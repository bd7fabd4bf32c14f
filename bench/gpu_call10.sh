#!/bin/bash
# Device call 10 (nvidia-h200, one GPU; issue 21), after call 9: (1) what stalls the training stream while a
# snapshot goes to host memory (pinned allocation, cudaHostRegister, pageable / pinned copies on a side stream)
# and the O_DIRECT shard write against dd, same directory (bench/gpu_pinned_probe.py); (2) steady-state async
# saves of gpt-1b at 16K in the bare job (saves after the first reuse the pinned buffers); (3) a real memory
# spike mid-run under the daemon (shipped 32K config, attempt 1 holds 70 GiB more from step 3); (4) the warm
# standby without its checkpoint preload (call 9: the preload of a 17 GB tag held the gate 18 s), as call 9's runs.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=540, command="CALL_BUDGET_S=520 bash bench/gpu_call10.sh")
# CPU dry run of (2)-(4): BENCH_CPU=1 SKIP_PROBE=1 DPRESET=tiny DEVICE=cpu SEQ=64 DTYPE=fp32 OOM_BASE=configs/tiny-cpu.toml OOM_SEQ=64 bash bench/gpu_call10.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
mkdir -p "$OUT/ckpt"
[ -z "${SKIP_PROBE:-}" ] && timeout 120 $PY bench/gpu_pinned_probe.py --gib 4 --dir /tmp/ulysses-probe --out "$OUT/ckpt/probe.json" > "$OUT/probe.log" 2>&1
tail -c 1500 "$OUT/probe.log" 2>/dev/null
CK="--preset ${DPRESET:-gpt-1b} --seq ${SEQ:-16384} --device ${DEVICE:-cuda} --dtype ${DTYPE:-bf16}"
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" $CK --phases bare_async --async-steps 100 --async-interval 30 \
    --sync-timeout 170 > "$OUT/ckpt.log" 2>&1
grep -v '^ ' "$OUT/ckpt.log" | head -3 | cut -c1-1500
$PY bench/gpu_oom21.py --out "$OUT/oom" --base "${OOM_BASE:-configs/gpt-1b-1xh200.toml}" --runs spike \
    --seq "${OOM_SEQ:-32768}" --device "${DEVICE:-cuda}" --steps 8 --spike-gib 70 --spike-at 3 --timeout 150 \
    --deadline $((T0 + 400)) > "$OUT/spike.log" 2>&1
tail -c 3000 "$OUT/spike.log"
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" $CK --phases standby_nopreload --steps 50 --interval 20 --kill-at 40 \
    --hang-at 0 --faults-timeout 190 --deadline "$DEADLINE" >> "$OUT/ckpt.log" 2>&1
grep -v '^ ' "$OUT/ckpt.log" | tail -2 | cut -c1-1500
tar czf "$OUT/ckpt.tgz" -C "$OUT" ckpt oom && rm -rf "$OUT/ckpt" "$OUT/oom"
echo "elapsed $(( $(date +%s) - T0 )) s"
