#!/bin/bash
# Device call 12 (nvidia-h200, one GPU; issue 20):
# (1) gpt-1b at 512K tokens, steady state (bench/gpu_long_seq.sh: an 8K step saved, then the 512K step resumed
#     with Adam's moments loaded): TiledMLP 16K + checkpointed block inputs offloaded to pinned host memory +
#     tiled loss 8K + keep-attention, every layer recomputed; peak against the planner. First, capped at
#     LONG_CAP_S: it is all or nothing, the 32K cases after it degrade case by case.
# (2) at 32K, both rows of the issue (no recompute / every layer recomputed) in one call: the plain reference,
#     the shipped build (configs/gpt-1b-1xh200.toml: rotary_fused, bf16 norm, qkv view, leaf blocks, tiled loss
#     4K, fused AdamW) and each new lever alone on top of it — model.compile_blocks (the work around attention
#     as two inductor graphs) and a ZeRO-3 persistence threshold that keeps every parameter resident (one GPU:
#     no fetch/release copies) — then both together, and the reference with that threshold too.
# 1M is not in this call: one step ≈ 4× the 512K step, longer than one device command.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=570, command="CALL_BUDGET_S=555 bash bench/gpu_call12.sh")
# CPU dry run (tiny shape, a few minutes on 2 cores):
#   BENCH_CPU=1 PRESET=tiny SEQ_SCALE=256 DEVICE=cpu LS_CPU=1 CALL_BUDGET_S=400 bash bench/gpu_call12.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
# Bytecode once, then reused by every later process of this call (the lent machine has no .pyc for torch:
# ~12 s of each start-up compiled source, device call 11).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
export BASE=configs/gpt-1b-1xh200.toml NPROC=1

# (1) 512K steady state.
if [ -n "${LS_CPU:-}" ]; then
  # The GPU base has leaf blocks; tiny-cpu.toml has not (keep-attention + TiledMLP + offload with per-module
  # ZeRO-3 hooks on one rank fail in recompute: docs/DEEPSPEED_NOTES.md).
  sed '/^\[train\]/a zero3_leaf_blocks = true' configs/tiny-cpu.toml > "$OUT/tiny-leaf.toml"
  export LS_BASE=$OUT/tiny-leaf.toml LS_PRESET=tiny LS_SEQ=256 LS_WARM_SEQ=64 LS_MLP_CHUNK=32 LS_LOSS_CHUNK=32 \
    LS_DEVICE=cpu LS_DTYPE=fp32
fi
LS_SEQ=${LS_SEQ:-524288} LS_KEEP_ATTENTION=1 LS_VERIFY=0 CALL_BUDGET_S=${LONG_CAP_S:-340} \
  bash bench/gpu_long_seq.sh start > "$OUT/longseq.log" 2>&1
grep -v "^  " "$OUT/longseq.log" | tail -c 2000
if grep -q "^state running" "$OUT/longseq.log"; then
  bash bench/gpu_long_seq.sh stop > "$OUT/longseq_stop.log" 2>&1; tail -4 "$OUT/longseq_stop.log"
  # The killed job's GPU and pinned memory go back as its processes exit: the 32K cases start after that.
  for _ in $(seq 30); do pgrep -f "ulysses-longseq/.*toml" > /dev/null || break; sleep 1; done
fi
tar czf "$OUT/longseq.tgz" -C "$OUT" longseq && rm -rf "$OUT/longseq"
echo "512K done at $(( $(date +%s) - T0 )) s"
[ -n "${SKIP_32K:-}" ] && exit 0   # dry runs of the 512K part alone

# (2) 32K, in what is left (a case is not started unless it can end before the deadline).
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-1b} model.max_seq_len=1048576 train.device=${DEVICE:-cuda}"
[ -n "${BENCH_CPU:-}" ] && C="$C train.fused_adam=false"
L32="train.seq_len=$((32768/S))"
R1="train.activation_checkpoint_every=1 model.checkpoint_keep_attention=true"; R0="train.activation_checkpoint_every=0"
CB="model.compile_blocks=true"
P="deepspeed.config.zero_optimization.stage3_param_persistence_threshold=10000000000"
bench --case "name=ref-nockpt program=reference $C $L32 $R0 steps=6 timeout=60" \
      --case "name=p-nockpt $C $L32 $R0 steps=6 timeout=60" \
      --case "name=p-nockpt-compile $C $L32 $R0 $CB steps=6 timeout=90" \
      --case "name=p-nockpt-persist $C $L32 $R0 $P steps=6 timeout=60" \
      --case "name=ref-ckpt1 program=reference $C $L32 train.activation_checkpoint_every=1 steps=6 timeout=60" \
      --case "name=p-ckpt1 $C $L32 $R1 steps=6 timeout=60" \
      --case "name=p-ckpt1-compile-persist $C $L32 $R1 $CB $P steps=6 timeout=90" \
      --case "name=p-nockpt-compile-persist $C $L32 $R0 $CB $P steps=6 timeout=90" \
      --case "name=ref-nockpt-persist program=reference env.REFERENCE_PERSISTENCE_THRESHOLD=1e10 $C $L32 $R0 steps=6 timeout=60"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
