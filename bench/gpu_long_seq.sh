#!/bin/bash
# Issue 20: gpt-1b at 1M tokens per sequence on ONE H200, one optimizer step in steady state, peak measured.
# Levers: every layer recomputed, tiled loss 8K, TiledMLP 16K, checkpointed block inputs offloaded to pinned
# host memory (model.offload_checkpoints), bf16 LayerNorm input; rotary_fused off (not yet run together
# with the offload's saved-tensor hooks) and qkv_copy on (the view costs 8 GiB at 1M).
# LS_KEEP_LAST=N keeps the last N checkpointed block inputs on the GPU (model.offload_keep_last: N·4 GiB less
# pinned host RAM at 1M); async saves and compiled blocks are off (host RAM; the 512K-measured build).
# LS_KEEP_ATTENTION=1 adds model.checkpoint_keep_attention (no attention forward in recompute; the kept outputs
# stay on the GPU); LS_VERIFY=0 skips the warm tag's sha256 check at resume (~12 s for 17 GB). A 1M step takes longer than one device command (10 min), so the job runs in the background and later
# commands collect its telemetry:
#   0. tests/training/test_offload_checkpoints_cuda.py (the offload's stream path on this GPU), then
#   1. warm:  the same model at LS_WARM_SEQ (8K) for 1 step, saved at the end: Adam's m and v exist from then on.
#   2. long:  attempt 2 in the same run dir resumes that checkpoint (moments loaded) and trains step 2 at LS_SEQ.
#   A sampler writes nvidia-smi memory every 5 s (the peak while the long step runs); the step record's
#   mem_max_allocated_gib is torch's peak once it ends.
# On the lent machine (kept warm between the commands; the background job dies with the machine):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="CALL_BUDGET_S=560 bash bench/gpu_long_seq.sh start")
#   run(..., command="CALL_BUDGET_S=570 bash bench/gpu_long_seq.sh poll")      # again until "state done"
#   run(..., command="bash bench/gpu_long_seq.sh stop")                         # only to abandon it
# CPU dry run (syntax and flow, tiny shape; a few seconds):
#   BENCH_CPU=1 LS_BASE=configs/tiny-cpu.toml LS_PRESET=tiny LS_SEQ=256 LS_WARM_SEQ=64 LS_MLP_CHUNK=32 \
#     LS_LOSS_CHUNK=32 LS_NPROC=1 LS_DEVICE=cpu LS_DTYPE=fp32 CALL_BUDGET_S=120 bash bench/gpu_long_seq.sh start
cd "$(dirname "$0")/.." && source bench/gpu_common.sh
ACTION=${1:-start}
LS_DIR=${LS_DIR:-/tmp/ulysses-longseq}            # survives between commands while the machine is warm
RUN_DIR=$LS_DIR/run
POLL_S=${LS_POLL_S:-10}

write_specs() {  # warm.toml + long.toml from the base config and the overrides above
  mkdir -p "$LS_DIR" && $PY - "$LS_DIR" <<'PYEOF'
import json, os, sys, tomllib
sys.path.insert(0, "bench")
from gpu_bench import set_dotted, to_toml
env = os.environ.get
out = sys.argv[1]
base = tomllib.load(open(env("LS_BASE", "configs/gpt-1b-1xh200.toml"), "rb"))
seq, warm = int(env("LS_SEQ", "1048576")), int(env("LS_WARM_SEQ", "8192"))
common = {
    "model.preset": env("LS_PRESET", "gpt-1b"), "model.max_seq_len": seq, "model.offload_checkpoints": True,
    "model.mlp_chunk_tokens": int(env("LS_MLP_CHUNK", "16384")), "model.rotary_fused": False, "model.qkv_copy": True,
    "model.checkpoint_keep_attention": env("LS_KEEP_ATTENTION", "0") == "1",
    "model.offload_keep_last": int(env("LS_KEEP_LAST", "0")), "model.compile_blocks": False,
    "checkpoint.async_save": False,
    "checkpoint.verify_checksums": env("LS_VERIFY", "1") == "1",
    "parallel.sequence_parallel_size": 1, "precision.dtype": env("LS_DTYPE", "bf16"),
    "train.activation_checkpoint_every": 1, "train.activation_checkpoint_layers": None,
    "train.loss_chunk_tokens": int(env("LS_LOSS_CHUNK", "8192")), "train.micro_batch_size": 1,
    "train.gradient_accumulation_steps": 1, "train.device": env("LS_DEVICE", "cuda"), "train.warmup_steps": 1,
    "checkpoint.interval_steps": 10**9, "checkpoint.keep_last": 1, "data.kind": "synthetic",
}
for name, extra in (("warm", {"train.seq_len": warm, "train.steps": 1, "checkpoint.save_at_end": True}),
                    ("long", {"train.seq_len": seq, "train.steps": 2, "checkpoint.save_at_end": False})):
    spec = json.loads(json.dumps(base))
    spec.get("launcher", {})["nproc_per_node"] = int(env("LS_NPROC", "1"))
    for k, v in {**common, **extra}.items():
        if v is None:
            spec.get(k.split(".")[0], {}).pop(k.split(".")[1], None)
        else:
            set_dotted(spec, k, v)
    open(f"{out}/{name}.toml", "w").write(to_toml(spec))
PYEOF
}

job_cmd() {  # job_cmd SPEC ATTEMPT: one rank, as a plain process (the job defaults to a world of one)
  echo "$PY -m ulyssesd.training --spec $LS_DIR/$1.toml --run-dir $RUN_DIR --attempt $2"
}

state() {
  if [ -f "$LS_DIR/rc" ]; then echo "done rc=$(cat "$LS_DIR/rc")"
  elif [ -f "$LS_DIR/pgid" ] && kill -0 "-$(cat "$LS_DIR/pgid")" 2>/dev/null; then echo "running"
  elif [ -f "$LS_DIR/pgid" ]; then echo "gone (no rc: killed, or the machine was replaced)"
  else echo "not started"; fi
}

collect() {  # what one command brings back: telemetry, the sampler's memory trace, log tails, the specs
  mkdir -p "$OUT/longseq"
  cp "$LS_DIR"/*.toml "$OUT/longseq/" 2>/dev/null
  [ -f "$RUN_DIR/telemetry.jsonl" ] && cp "$RUN_DIR/telemetry.jsonl" "$OUT/longseq/"
  [ -f "$LS_DIR/smi.csv" ] && cp "$LS_DIR/smi.csv" "$OUT/longseq/"
  [ -f "$LS_DIR/host.csv" ] && cp "$LS_DIR/host.csv" "$OUT/longseq/"
  for f in warm long; do [ -f "$LS_DIR/$f.log" ] && tail -c 20000 "$LS_DIR/$f.log" > "$OUT/longseq/$f.log.tail"; done
  $PY - "$RUN_DIR/telemetry.jsonl" "$LS_DIR/smi.csv" "$LS_DIR/host.csv" <<'PYEOF' | tee "$OUT/longseq/summary.txt"
import json, sys
recs = []
try:
    recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
except OSError:
    pass
for r in recs:
    if r.get("kind") == "step":
        print("step", r["step"], "attempt", r.get("attempt"), "step_time_s", r.get("step_time_s"), "loss", r.get("loss"),
              "max_allocated_gib", r.get("mem_max_allocated_gib"), "reserved_gib", r.get("mem_reserved_gib"))
try:
    used = [float(x.split(",")[1]) for x in open(sys.argv[2]) if x.count(",") >= 1 and x.split(",")[1].strip()]
    print("nvidia-smi memory.used max MiB", max(used) if used else None, "samples", len(used))
except (OSError, ValueError):
    pass
try:
    avail = [int(x.split(",")[1]) for x in open(sys.argv[3]) if x.count(",") == 1 and x.split(",")[1].strip()]
    print("host MemAvailable min GiB", round(min(avail) / 2**20, 2) if avail else None, "samples", len(avail))
except (OSError, ValueError, IndexError):
    pass
PYEOF
}

case "$ACTION" in
  start)
    [ "$(state)" = "running" ] && { echo "already running"; exit 1; }
    rm -rf "$LS_DIR" && write_specs || exit 1
    # The offload's CUDA stream path on this GPU first (seconds; skipped on the CPU; LS_CUDA_TEST=0 skips it).
    if [ "${LS_CUDA_TEST:-1}" = 1 ]; then
      $PY -m pytest -q -x -p no:cacheprovider tests/training/test_offload_checkpoints_cuda.py > "$OUT/offload_cuda.txt" 2>&1
      tail -3 "$OUT/offload_cuda.txt"
    fi
    $PY - "$LS_DIR/long.toml" "${LS_NPROC:-1}" <<'PYEOF' | tee "$OUT/plan.txt"
import sys
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.planner import Cluster, plan
job = load_run_spec(sys.argv[1]).job
n = int(sys.argv[2])
p = plan(job, Cluster.preset("h200-141g", gpus_per_node=n, nodes=1, host_mem_gib=128.0), build_ds_config(job, n)[0],
         search=False)
print(p.render())
PYEOF
    # The driver: warm step + save, then the long attempt; its own session so `stop` ends all of it.
    # It writes its own pid (= its process group: setsid made it a session leader) before anything else.
    setsid bash -c "echo \$\$ > $LS_DIR/pgid; $(job_cmd warm 1) > $LS_DIR/warm.log 2>&1 && \
                    $(job_cmd long 2) > $LS_DIR/long.log 2>&1; echo \$? > $LS_DIR/rc" < /dev/null > /dev/null 2>&1 &
    for _ in $(seq 50); do [ -s "$LS_DIR/pgid" ] && break; sleep 0.1; done
    if [ -z "${BENCH_CPU:-}" ]; then
      setsid bash -c "while kill -0 -$(cat "$LS_DIR/pgid") 2>/dev/null; do \
        nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits >> $LS_DIR/smi.csv; \
        echo \$(date +%s),\$(awk '/MemAvailable/{print \$2}' /proc/meminfo) >> $LS_DIR/host.csv; sleep 5; done" \
        < /dev/null > /dev/null 2>&1 &
    fi
    ;&
  poll)
    while [ "$(state)" = "running" ] && [ "$(date +%s)" -lt "$DEADLINE" ]; do sleep "$POLL_S"; done
    ;;
  stop)
    [ -f "$LS_DIR/pgid" ] && kill -TERM "-$(cat "$LS_DIR/pgid")" 2>/dev/null && sleep 5
    [ -f "$LS_DIR/pgid" ] && kill -KILL "-$(cat "$LS_DIR/pgid")" 2>/dev/null
    ;;
  *) echo "usage: $0 start|poll|stop" >&2; exit 2 ;;
esac
echo "state $(state)"
collect
# The device tool brings back at most 8 files: the folder as one tarball, the summary beside it.
cp "$OUT/longseq/summary.txt" "$OUT/longseq_summary.txt" 2>/dev/null
tar czf "$OUT/longseq.tgz" -C "$OUT" longseq && rm -rf "$OUT/longseq"
echo "elapsed $(( $(date +%s) - T0 )) s"
