#!/bin/bash
# Device call 14 (nvidia-h200, one GPU; issue 21), the session's last: ~380 s of command. In order of value,
# each with a deadline guard so the call always returns its files:
#  (a) the bare job, gpt-1b at 16K, one rank, async saves every BARE_INTERVAL steps (17 GB tags, the registered
#      snapshot pool), 3 saves, with the writer of this tree (ULYSSESD_CKPT_DIGEST, default chunks); `dd
#      oflag=direct` of the same call first; blocked time and background write GB/s per save
#      (`gpu_ckpt21.py --analyze`);
#  (b) bench/ckpt_writer_bench.py (digest mode whole = old / chunks = new x source memory x a GIL-busy thread),
#      when the tree has it;
#  (c) call 13's memory spike case unchanged (shipped 32K config, 70 GiB more from step 3 on attempt 1):
#      COMPLETED? restarts? the action's rung and evidence (`ulyssesctl incidents --json`), attempt 2's step/peak;
#  (d) tests/training/test_checkpoint_async_cuda.py and test_startup_cuda.py on the H200 (no -x).
# Bytecode caches are built first (call 11: ~12 s of every start-up compiled .py files without them).
# $OUT gets at most 8 files back: machine.txt, ckpt.log, writer_bench.txt, spike.log, cuda_test.txt, raw.tgz.
#   run(carry=[".whl", ".devtree"], timeout_s=380,
#       command="ln -sfn ../.whl .devtree/.whl && CALL_BUDGET_S=350 bash .devtree/bench/gpu_call14.sh")
# CPU dry run: BENCH_CPU=1 DPRESET=tiny DEVICE=cpu SEQ=64 DTYPE=fp32 BARE_STEPS=40 BARE_INTERVAL=12 \
#   WRITER_ARGS="--gib 0.25 --sources plain" OOM_BASE=configs/tiny-cpu.toml OOM_SEQ=64 CALL_BUDGET_S=900 bash bench/gpu_call14.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
export PYTHONPYCACHEPREFIX=/tmp/ulysses-pycache; unset PYTHONDONTWRITEBYTECODE
RAW="$OUT/raw"; mkdir -p "$RAW"
env | grep -E '^PYTHON' | sort > "$RAW/pyenv.txt"
SITE=$($PY -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
if [ -z "${BENCH_CPU:-}" ]; then
  t=$(date +%s); timeout 60 $PY -m compileall -q -j 16 "$SITE" /tmp/site > "$RAW/compileall.txt" 2>&1
  echo "compileall rc $? in $(( $(date +%s) - t )) s ($SITE, /tmp/site)" | tee -a "$RAW/pyenv.txt"
fi
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local l; l=$(( $(left) - $2 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }   # cap MAX RESERVE
# The writer's digest mode for (a) (chunks: each byte hashed once, the default; whole: the old serial sha256 too),
# exported so the job's torchrun inherits it and the record names it.
export ULYSSESD_CKPT_DIGEST=${ULYSSESD_CKPT_DIGEST:-chunks}; echo "ULYSSESD_CKPT_DIGEST=$ULYSSESD_CKPT_DIGEST" >> "$RAW/pyenv.txt"
CK="--preset ${DPRESET:-gpt-1b} --seq ${SEQ:-16384} --device ${DEVICE:-cuda} --dtype ${DTYPE:-bf16}"

# (a) 3 saves at 25, 50, 75 (17 s of steps apart: call 13 wrote a tag in 15-16 s, so no back-pressure expected);
# at most 130 s, leaving the rest for (b)-(d).
echo "(a) bare job at $(( $(date +%s) - T0 )) s, $(left) s left"
$PY bench/gpu_ckpt21.py --out "$RAW/ckpt" $CK --phases disk,bare_async --dd-gib 4 --probe-gib 0 \
    --async-steps ${BARE_STEPS:-76} --async-interval ${BARE_INTERVAL:-25} --sync-timeout "$(cap ${BARE_TIMEOUT:-130} 60)" \
    > "$OUT/ckpt.log" 2>&1
grep -v '^ ' "$OUT/ckpt.log" | grep -v '^[]}{]' | cut -c1-3000

# (b) the writer bench, only if it leaves (c) its ~100 s.
WB=bench/ckpt_writer_bench.py
if [ -f "$WB" ] && [ "$(cap 90 110)" -ge 30 ]; then
  echo "(b) writer bench at $(( $(date +%s) - T0 )) s, $(left) s left"
  # 4 GiB per variant (12 writes, ~60 s at the disk's speed); the registered pool first (what the job writes from),
  # so a cut keeps it. Same filesystem as the job's checkpoints (/tmp).
  timeout "$(cap 90 110)" $PY $WB --dir /tmp/ulysses-wbench --out "$RAW/ckpt_writer.json" \
      ${WRITER_ARGS:---gib 4 --sources registered,plain,pinned --modes whole,chunks --busy off,on} \
      > "$OUT/writer_bench.txt" 2>&1; echo "rc $?" >> "$OUT/writer_bench.txt"; rm -rf /tmp/ulysses-wbench
  tail -c 3000 "$OUT/writer_bench.txt"
else echo "(b) writer bench skipped ($( [ -f "$WB" ] || echo "no $WB, ")$(left) s left)" | tee "$OUT/writer_bench.txt"; fi

# (c) the spike, as call 13 ran it: its spec exactly (model.compile_blocks was shipped on after call 13; off here so
# the steady peak and step time compare with calls 10/13).
if [ "$(left)" -gt 75 ]; then
  echo "(c) spike at $(( $(date +%s) - T0 )) s, $(left) s left"
  $PY bench/gpu_oom21.py --out "$RAW/oom" --base "${OOM_BASE:-configs/gpt-1b-1xh200.toml}" --runs spike \
      --seq "${OOM_SEQ:-32768}" --device "${DEVICE:-cuda}" --steps 8 --spike-gib 70 --spike-at 3 --timeout 120 \
      --extra "${OOM_EXTRA:-model.compile_blocks=false}" --deadline $(( DEADLINE - 15 )) > "$OUT/spike.log" 2>&1
  tail -c 2000 "$OUT/spike.log"
else echo "(c) spike skipped ($(left) s left)" | tee "$OUT/spike.log"; fi

# (d) the CUDA tests, no -x: each test's own outcome.
if [ -z "${BENCH_CPU:-}" ] && [ "$(left)" -gt 30 ]; then
  echo "(d) cuda tests at $(( $(date +%s) - T0 )) s, $(left) s left"
  DS_ACCELERATOR=cuda timeout $(( $(left) - 8 )) $PY -m pytest -q -s -p no:cacheprovider \
      tests/training/test_checkpoint_async_cuda.py tests/training/test_startup_cuda.py > "$OUT/cuda_test.txt" 2>&1
  echo "rc $?" >> "$OUT/cuda_test.txt"; tail -c 1500 "$OUT/cuda_test.txt"
else echo "(d) cuda tests skipped ($(left) s left)" | tee "$OUT/cuda_test.txt"; fi

$PY bench/gpu_ckpt21.py --out "$RAW/ckpt" --analyze > /dev/null 2>&1
$PY - "$RAW" <<'PYEOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1] + "/ckpt/results.json"))
print("dd direct", (r.get("disk") or {}).get("dd_direct"))
for s in r.get("bare_async", []):
    e = s.get("saved_event") or {}
    print(s["tag"], "blocked", (s.get("by_step_intervals") or {}).get("blocked_s"), "job", s.get("blocked_seconds_job"),
          "write", s.get("write_seconds"), "s", s.get("write_GBps"), "GB/s", "vs dd", s.get("write_vs_dd_direct"),
          "pool", e.get("snapshot_pool"), "fallback", e.get("snapshot_fallback_bytes"), "waited", e.get("waited_for_previous_seconds"))
PYEOF
cat "$OUT/gpu.txt" "$OUT/versions.txt" "$RAW/pyenv.txt" > "$OUT/machine.txt" 2>/dev/null
mv "$OUT/pip.log" "$OUT/gpu.txt" "$OUT/versions.txt" "$RAW/" 2>/dev/null
tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$RAW"
echo "elapsed $(( $(date +%s) - T0 )) s"
