#!/bin/bash
# Device call 9 (nvidia-h200, one GPU; issue 21), after call 8: (1) the async writer's GPU paths
# (tests/training/test_checkpoint_async_cuda.py); (2) gpt-1b at 16K, one rank, async saves every 20 steps with
# O_DIRECT writes and a first save cloned on the GPU: the disk's dd speed again, then the same supervised run
# twice — cold relaunch and `[restart] standby = true` — each SIGKILLed while the step-40 save is written
# (MTTR with and without the warm standby, same call); (3) issue 21's real CUDA OOM (gpt-1b, 32K, micro-batch
# 4, no recompute, preflight off) under the daemon.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="CALL_BUDGET_S=560 bash bench/gpu_call9.sh")
# CPU dry run: BENCH_CPU=1 DPRESET=tiny DEVICE=cpu SEQ=64 DTYPE=fp32 OOM_BASE=configs/tiny-cpu.toml OOM_SEQ=64 bash bench/gpu_call9.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
$PY -m pytest -q -x -p no:cacheprovider tests/training/test_checkpoint_async_cuda.py > "$OUT/cuda_smoke.txt" 2>&1
tail -3 "$OUT/cuda_smoke.txt"
$PY bench/gpu_ckpt21.py --out "$OUT/ckpt" --preset "${DPRESET:-gpt-1b}" --seq "${SEQ:-16384}" --device "${DEVICE:-cuda}" \
    --dtype "${DTYPE:-bf16}" --phases disk,cold,standby --dd-gib "${DD_GIB:-6}" --probe-gib 0 --steps 50 --interval 20 \
    --kill-at 40 --hang-at 0 --faults-timeout 190 --deadline $((T0 + ${CKPT_BUDGET_S:-400})) > "$OUT/ckpt.log" 2>&1
grep -v '^ ' "$OUT/ckpt.log" | tail -c 2500
$PY bench/gpu_oom21.py --out "$OUT/oom" --base "${OOM_BASE:-configs/gpt-1b-1xh200.toml}" --runs oom \
    --seq "${OOM_SEQ:-32768}" --device "${DEVICE:-cuda}" --steps 6 --timeout 150 --deadline "$DEADLINE" > "$OUT/oom.log" 2>&1
tail -c 4000 "$OUT/oom.log"
python3 - "$OUT" <<'PYEOF' 2>/dev/null || true
import json, sys; r = json.load(open(sys.argv[1] + "/ckpt/results.json"))
for n in ("cold", "standby"):
    x = r.get(n, {}); m = x.get("mttr_sigkill", {})
    print(n, "saves", [(s.get("tag"), (s.get("by_step_intervals") or {}).get("blocked_s"), s.get("write_vs_dd_direct")) for s in x.get("async_saves", [])],
          "mttr", m.get("mttr_s"), "load", m.get("checkpoint_load_s"), "start", m.get("start_to_loaded_s"), "loaded", m.get("attempt2_loaded"))
PYEOF
tar czf "$OUT/ckpt.tgz" -C "$OUT" ckpt oom && rm -rf "$OUT/ckpt" "$OUT/oom"
echo "elapsed $(( $(date +%s) - T0 )) s"
