#!/bin/bash
# Device call 13 (nvidia-h200, one GPU; issue 21), the session's last: gpt-1b at 16K, one rank, under the daemon,
# async saves every INTERVAL steps (17 GB tags), bytecode caches built first (production-like; call 11 found
# ~12 s of every start-up compiling .py files, the lent image has no .pyc). In order of value, each with a
# deadline guard:
#  (a+b) warm standby with preload: the first save (registered snapshot pool) blocked, its background write vs
#        `dd oflag=direct` of this call; SIGKILL of the rank once the step-KILL_AT tag is durable AND the standby's
#        ready file shows it preloaded (the next save, pool reused, may be in flight then: the previous tag must be
#        what attempt 2 loads); MTTR with each start-up phase (the job's `startup` marks), 4 steps, then ended;
#  (b+c) cold relaunch, killed at the same point; its attempt 2 hangs (detection after the last step), ended
#        once the hang incident is recorded;
#  (d)   the real memory spike of call 10 (70 GiB more from step 3, shipped 32K config): COMPLETED, restarts;
#  (e)   tests/training/test_checkpoint_async_cuda.py and test_startup_cuda.py on the H200;
#  (f)   steady-state saves of the bare job, if time is left.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=590, command="CALL_BUDGET_S=560 bash bench/gpu_call13.sh")
# CPU dry run: BENCH_CPU=1 DPRESET=tiny DEVICE=cpu SEQ=64 DTYPE=fp32 STEPS=3000 INTERVAL=1000 KILL_AT=1000 COLD_INTERVAL=100 COLD_KILL_AT=100 HANG_AT=110 \
#   OOM_BASE=configs/tiny-cpu.toml OOM_SEQ=64 bash bench/gpu_call13.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
export PYTHONPYCACHEPREFIX=/tmp/ulysses-pycache; unset PYTHONDONTWRITEBYTECODE
env | grep -E '^PYTHON' | sort > "$OUT/pyenv.txt"
SITE=$($PY -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
if [ -z "${BENCH_CPU:-}" ]; then
  t=$(date +%s); timeout 120 $PY -m compileall -q -j 16 "$SITE" /tmp/site > "$OUT/compileall.txt" 2>&1
  echo "compileall rc $? in $(( $(date +%s) - t )) s ($SITE, /tmp/site)" | tee -a "$OUT/pyenv.txt"
fi
CK="--preset ${DPRESET:-gpt-1b} --seq ${SEQ:-16384} --device ${DEVICE:-cuda} --dtype ${DTYPE:-bf16}"
# Saves every 50 steps (34 s) in the standby run: its preload of a 17 GB tag (read + sha256, ~25 s) must finish
# before the next tag commits, or it chases `latest` (a real limit: tags faster than a preload reads them).
RUNS="--steps ${STEPS:-200} --interval ${INTERVAL:-50} --kill-at ${KILL_AT:-50} --kill-when committed --preload-wait 60"
left() { echo $(( DEADLINE - $(date +%s) )); }
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" $CK --phases disk,standby --dd-gib 4 --probe-gib 0 $RUNS --hang-at 0 \
    --stop-at "2:${STOP_STEPS:-4}" --faults-timeout 200 --deadline "$DEADLINE" > "$OUT/ckpt.log" 2>&1
grep -v '^ ' "$OUT/ckpt.log" | grep -v '^[]}{]' | cut -c1-2500
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" $CK --phases cold --kill-at ${COLD_KILL_AT:-20} --steps ${STEPS:-200} \
    --interval ${COLD_INTERVAL:-20} --kill-when committed --hang-at ${HANG_AT:-26} --stop-at "${COLD_STOP:-hang}" --faults-timeout 230 \
    --deadline $((DEADLINE - ${RESERVE_S:-100})) >> "$OUT/ckpt.log" 2>&1
grep -v '^ ' "$OUT/ckpt.log" | grep '^{"cold' | cut -c1-2500
if [ "$(left)" -gt 75 ]; then
  $PY bench/gpu_oom21.py --out "$OUT/oom" --base "${OOM_BASE:-configs/gpt-1b-1xh200.toml}" --runs spike \
      --seq "${OOM_SEQ:-32768}" --device "${DEVICE:-cuda}" --steps 8 --spike-gib 70 --spike-at 3 --timeout 120 \
      --deadline $((DEADLINE - 20)) > "$OUT/spike.log" 2>&1
  tail -c 2500 "$OUT/spike.log"
else echo "spike skipped ($(left) s left)"; fi
if [ -z "${BENCH_CPU:-}" ] && [ "$(left)" -gt 40 ]; then
  DS_ACCELERATOR=cuda timeout $(( $(left) - 10 )) $PY -m pytest -q -s -x -p no:cacheprovider tests/training/test_checkpoint_async_cuda.py tests/training/test_startup_cuda.py \
      > "$OUT/cuda_test.txt" 2>&1; tail -c 1500 "$OUT/cuda_test.txt"
else echo "cuda test skipped ($(left) s left)"; fi
if [ "$(left)" -gt 90 ]; then
  $PY bench/gpu_ckpt21.py --out "$OUT/ckpt" $CK --phases bare_async --async-steps ${BARE_STEPS:-70} \
      --async-interval ${BARE_INTERVAL:-25} --sync-timeout $(( $(left) - 15 )) >> "$OUT/ckpt.log" 2>&1
  grep -A12 '"bare_async"' "$OUT/ckpt/results.json" | head -40
else echo "bare job skipped ($(left) s left)"; fi
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" --analyze > /dev/null 2>&1
$PY - "$OUT" <<'PYEOF' 2>/dev/null || true
import json, sys; r = json.load(open(sys.argv[1] + "/ckpt/results.json"))
for n in ("standby", "cold"):
    x = r.get(n, {}); m = x.get("mttr_sigkill", {})
    print(n, "saves", [(s.get("tag"), (s.get("by_step_intervals") or {}).get("blocked_s"), s.get("blocked_seconds_job"), s.get("write_vs_dd_direct")) for s in x.get("async_saves", [])])
    print(n, "mttr", m.get("mttr_s"), "detect", m.get("detection_s"), "launch", m.get("attempt2_launched_after_kill_s"), "after kill", m.get("startup_after_kill_s"), "load", m.get("checkpoint_load_s"), "first", m.get("first_step_s"), "loaded", m.get("attempt2_loaded"))
    print(n, "hang", x.get("hang"))
PYEOF
tar czf "$OUT/ckpt.tgz" -C "$OUT" ckpt $( [ -d "$OUT/oom" ] && echo oom ) && rm -rf "$OUT/ckpt" "$OUT/oom"
echo "elapsed $(( $(date +%s) - T0 )) s"
