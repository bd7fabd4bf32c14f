#!/bin/bash
# Device call 12b (nvidia-h200, one GPU; issue 20): the 32K every-layer-recomputed row that call 12's deadline
# cut, in one call: the plain reference, the product with keep-attention and without / with model.compile_blocks.
#   run(kind="nvidia-h200", carry=[".whl", ".devtree"], timeout_s=200,
#       command="ln -sfn ../.whl .devtree/.whl && CALL_BUDGET_S=185 bash .devtree/bench/gpu_call12b.sh")
# CPU dry run: BENCH_CPU=1 PRESET=tiny SEQ_SCALE=256 DEVICE=cpu bash bench/gpu_call12b.sh
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
export BASE=configs/gpt-1b-1xh200.toml NPROC=1
S=${SEQ_SCALE:-1}
C="model.preset=${PRESET:-gpt-1b} train.device=${DEVICE:-cuda} train.seq_len=$((32768/S))"
[ -n "${BENCH_CPU:-}" ] && C="$C train.fused_adam=false"
R1="train.activation_checkpoint_every=1 model.checkpoint_keep_attention=true"
bench --case "name=ref-ckpt1 program=reference $C train.activation_checkpoint_every=1 steps=6 timeout=60" \
      --case "name=p-ckpt1 $C $R1 model.compile_blocks=false steps=6 timeout=60" \
      --case "name=p-ckpt1-compile $C $R1 model.compile_blocks=true steps=6 timeout=70"
collect_logs
echo "elapsed $(( $(date +%s) - T0 )) s"
