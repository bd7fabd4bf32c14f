#!/bin/bash
# Issue 9 on one 8×H200 node (`nvidia-h200-x8`): the seed's 8-way Ulysses topology, ZeRO-3 bf16.
#
#   bench  : gpt-7b at 32K with SP=8 and with DP=2×SP=4, the largest GPT the planner fits at 32K (custom
#            52.4B: h 8192, L 64, 64 heads, SP=8), gpt-1b SP=8 -> tokens/s, TF/s, MFU, peak GiB vs planner
#   faults : gpt-1b SP=8 under the daemon (`ulyssesd run --spec`): SIGKILL of rank 3, rank 5 hung in a
#            collective, a loss spike - each detected and recovered; detection time and MTTR at 8 ranks
#   long   : gpt-7b SP=8 at 256K and 512K
#   longest: gpt-7b SP=8 at 1M tokens (the planner's longest fitting sequence, 5.3 GiB margin)
#   plan   : here, on the CPU - the planner's prediction for every case (also printed before each phase)
#   dry-run: here, on the CPU - every case's spec validated + planned, and the fault driver end to end on
#            the tiny CPU model (2 gloo ranks, same code path, same report)
#
# One device call per phase (each stops starting work at CALL_BUDGET_S=540 s, under the 600 s limit):
#   run(kind="nvidia-h200-x8", carry=[".whl"], timeout_s=600, command="bash bench/gpu_x8.sh bench")
#   then "... faults", and with device time left "... long", "... longest" (priority order).
# Results come back under $OUT: bench.jsonl (one line per case, bench/gpu_bench.py), x8_plan.json,
# x8_faults.json + x8_faults.md, cases/*/ (log tails, telemetry). docs/EIGHT_GPU.md explains the numbers.
PHASE=${1:-bench}
cd "$(dirname "$0")/.." || exit 1
case "$PHASE" in bench|long|longest|faults) ;; plan|dry-run) export BENCH_CPU=1 ;; *)
  echo "usage: bench/gpu_x8.sh bench|faults|long|longest|plan|dry-run" >&2; exit 2 ;; esac
if [ -z "${BENCH_CPU:-}" ] && [ ! -d .whl ]; then
  echo "no .whl/ in the checkout: put deepspeed 0.19.8 and its pure-Python deps as wheels in .whl/ (carry=[\".whl\"])" >&2; exit 2
fi
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh   # wheels -> /tmp/site, NVLS variables, $OUT, $PY, $DEADLINE, bench(), collect_logs()

# The package maps ulyssesd.* onto top-level folders (pyproject package-dir); without an install, a shim of
# symlinks makes `import ulyssesd.training` / `python -m ulyssesd.daemon.cli` work from this checkout.
if ! $PY -c "import ulyssesd.training" 2>/dev/null; then
  SHIM=/tmp/ulyssesd-shim; rm -rf "$SHIM"; mkdir -p "$SHIM/ulyssesd"
  ln -s "$PWD/ulyssesd_pkg/__init__.py" "$SHIM/ulyssesd/__init__.py"
  for p in daemon remediation training migrations; do ln -s "$PWD/$p" "$SHIM/ulyssesd/$p"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  $PY -c "import ulyssesd.training, ulyssesd.daemon.cli" || { echo "ulyssesd not importable" >&2; exit 1; }
fi
export BASE=configs/gpt-7b-8xh200.toml NPROC=8

# --------------------------------------------------------------------------- the cases (one place)
C7="train.device=cuda"
C1="model.preset=gpt-1b model.max_seq_len=1048576 train.device=cuda"
# The largest GPT the planner fits at 32K with SP=8 and a safe margin: h 8192, L 64, 64 heads = 52.4B
# (predicted 106.9 GiB, margin 23 GiB; L 72 = 58.8B would leave 9.9 GiB, L 80 does not fit).
C52="model.preset=null model.hidden_size=8192 model.num_layers=64 model.num_attention_heads=64 model.vocab_size=50304 model.max_seq_len=1048576 train.device=cuda"
BENCH_CASES=(   # in priority order: gpu_bench.py skips what cannot start before the call's deadline
  "name=x8-7b-sp8-32k $C7 train.seq_len=32768 steps=8 timeout=180"
  "name=x8-7b-dp2sp4-32k $C7 parallel.sequence_parallel_size=4 train.seq_len=32768 steps=8 timeout=180"
  "name=x8-52b-sp8-32k $C52 train.seq_len=32768 steps=4 timeout=240"
  "name=x8-1b-sp8-32k $C1 train.seq_len=32768 steps=8 timeout=120"
)
LONG_CASES=(    # attention is quadratic: ~60 s per step at 512K on 8 GPUs (estimate)
  "name=x8-7b-sp8-256k $C7 train.seq_len=262144 steps=3 timeout=200"
  "name=x8-7b-sp8-512k $C7 train.seq_len=524288 steps=3 timeout=330"
)
LONGEST_CASES=( # the planner's longest fitting sequence (5.3 GiB margin); ~4 min per step: the peak of
                # step 1 is the measurement, step 2 the timing if the call lasts
  "name=x8-7b-sp8-1m $C7 train.seq_len=1048576 steps=2 timeout=530"
)

plan_cases() {  # validate every case's spec and record the planner's prediction (pure arithmetic, no GPU)
  $PY - "$OUT/x8_plan.json" "${BENCH_CASES[@]}" "${LONG_CASES[@]}" "${LONGEST_CASES[@]}" <<'EOF'
import json, shlex, sys, tomllib
sys.path.insert(0, "bench")
from gpu_bench import parse_value, set_dotted
from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.planner import Cluster, plan
from ulyssesd.training.spec import SpecError, job_spec_from_dict

base = tomllib.load(open("configs/gpt-7b-8xh200.toml", "rb"))
cluster = Cluster.preset("h200-141g", gpus_per_node=8, host_mem_gib=512.0)
rows, bad = [], 0
for case in sys.argv[2:]:
    spec, name = json.loads(json.dumps(base)), "case"
    for item in shlex.split(case):
        key, _, raw = item.partition("=")
        if key == "name":
            name = raw
        elif key not in ("steps", "timeout") and not key.startswith("env."):
            set_dotted(spec, key, parse_value(raw))
    try:
        job = job_spec_from_dict(spec, name)
    except SpecError as exc:
        print(f"{name}: INVALID\n{exc}"); bad += 1; continue
    ds, _ = build_ds_config(job, 8)
    p = plan(job, cluster, ds, search=False)
    m = job.resolved_model()
    rows.append(dict(name=name, params_b=round(m.num_params() / 1e9, 2), sp=job.parallel.sequence_parallel_size,
                     dp=8 // job.parallel.sequence_parallel_size, seq_len=job.train.seq_len, fits=p.fits,
                     predicted_peak_gib=round(p.gpu_peak_allocated / 2**30, 1), margin_gib=round(p.gpu_margin_gib, 1)))
    r = rows[-1]
    print(f"{name:22s} {r['params_b']:6.2f}B SP={r['sp']} DP={r['dp']} seq={r['seq_len']:>8d} "
          f"peak {r['predicted_peak_gib']:6.1f} GiB  margin {r['margin_gib']:6.1f}  fits={r['fits']}")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
sys.exit(1 if bad or not all(r["fits"] for r in rows) else 0)
EOF
}

# ------------------------------------------------------------------------------ the fault driver
# Usage: fault_run WORKDIR DRY(0|1). One supervised run with three scripted faults (the job's own
# [[faults]], each on its own attempt so the restarted job recovers), then detection time and MTTR from
# the incident store and the telemetry: crash/hang MTTR = injection -> first step of the next attempt;
# loss-spike MTTR = injection -> first later step whose loss is back under 1.5x the pre-spike median.
fault_run() {
  $PY - "$1" "$2" "$DEADLINE" <<'EOF'
import json, os, statistics, subprocess, sys, tempfile, time, tomllib
from pathlib import Path

work, dry, deadline = Path(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3])
work.mkdir(parents=True, exist_ok=True)
spec = tomllib.load(open("configs/gpt-1b-8xh200-sp8.toml", "rb"))
sock = Path(tempfile.mkdtemp(prefix="uls-x8-", dir="/tmp")) / "d.sock"
# Faults: rank 3 SIGKILLs itself; rank 5 sleeps forever before its step (the other 7 block in the next
# collective, NCCL's 10-min watchdog far away); the loss is multiplied by 8 for 4 steps.
if dry:  # the tiny CPU model on 2 gloo ranks: same driver, same daemon, same report
    kill_rank, hang_rank, steps, interval, at = 1, 1, 40, 4, (9, 19, 30)
    spec["launcher"] = {"kind": "torchrun", "nproc_per_node": 2}
    spec["model"] = {"preset": "tiny"}
    spec["parallel"] = {"sequence_parallel_size": 2}
    spec["precision"] = {"dtype": "fp32"}
    spec["train"].update(seq_len=64, device="cpu", activation_checkpoint_every=0, warmup_steps=2, lr=1e-3, min_lr=1e-4)
    spec["deepspeed"]["config"]["zero_optimization"]["overlap_comm"] = False
    hang_floor = 12.0
else:
    kill_rank, hang_rank, steps, interval, at = 3, 5, 110, 25, (30, 55, 95)
    hang_floor = 30.0
spec["train"].update(steps=steps)
spec["checkpoint"] = {"interval_steps": interval, "keep_last": 2}
spec["run"] = {"name": "x8-faults"}
# One sample per step makes the loss noisy (a hard sample reads ~1.4x the median): only a spike of 1.5x
# or more counts here, so a natural one cannot open the episode the injected x8 spike then merges into.
spec["detectors"] = {**spec.get("detectors", {}), "warmup_steps": 5, "window": 20, "hang_timeout_floor_s": hang_floor,
                     "loss_spike_min_rel": 0.5}
spec["remediation"] = {"mode": "act", "grace_steps": 2, "verify_steps": 10, "max_restarts_per_hour": 20,
                       "no_progress_restarts": 4, "max_crash_restarts": 5}
spec["daemon"] = {"state_dir": str(work / "state"), "socket_path": str(sock), "tick_s": 0.25,
                  "stop_grace_s": 120.0, "hang_grace_s": 10.0, "stack_dump_wait_s": 3.0,
                  "early_death_s": 10.0, "preflight": not dry}
spec["faults"] = [
    {"kind": "sigkill", "at_step": at[0], "rank": kill_rank, "attempts": [1]},
    {"kind": "hang", "at_step": at[1], "rank": hang_rank, "attempts": [2]},
    {"kind": "loss_spike", "at_step": at[2], "steps": 4, "magnitude": 8.0, "attempts": [3]},
]


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


def to_toml(d, prefix=""):
    inline = lambda k, v: not isinstance(v, dict) or (prefix == "launcher" and k == "env")  # noqa: E731
    out = [f"{k} = {toml_value(v)}" for k, v in d.items() if inline(k, v) and k != "faults"]
    text = (f"[{prefix}]\n" if prefix and out else "") + "".join(line + "\n" for line in out)
    for k, v in d.items():
        if not inline(k, v):
            text += to_toml(v, f"{prefix}.{k}" if prefix else k)
    for f in d.get("faults", []):
        text += "[[faults]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in f.items())
    return text


spec_path = work / "run.toml"
spec_path.write_text(to_toml(spec))
log = open(work / "daemon.log", "ab")
t0 = time.time()
daemon = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec_path)],
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
try:
    rc = daemon.wait(timeout=max(60.0, deadline - time.time() - 20))
except subprocess.TimeoutExpired:  # out of call time: stop the run gracefully, then report what happened
    rc = "timeout"
    subprocess.run([sys.executable, "-m", "ulyssesd.daemon.operator.ctl", "--state-dir", str(work / "state"),
                    "--socket", str(sock), "stop"],
                   timeout=30, capture_output=True)
    try:
        daemon.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(daemon.pid, 9)
wall = time.time() - t0

from ulyssesd.daemon.store import open_store  # noqa: E402

store = open_store(work / "state" / "ulyssesd.db", readonly=True)
run = store.latest_run()
run_dir = work / "state" / "runs" / run.id
recs = []
for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
    try:
        recs.append(json.loads(line))
    except ValueError:
        pass
step_recs = [r for r in recs if r.get("kind") == "step"]
incs = store.list_incidents(run.id)
want = {"sigkill": "crash", "hang": "hang", "loss_spike": "loss_spike"}
faults = []
for ev in (r for r in recs if r.get("event") == "fault_injected"):
    kind, att, t, step = ev["fault"], ev["attempt"], ev["time"], ev["step"]
    hit = sorted((i for i in incs if i.attempt == att and i.symptom.value == want.get(kind)
                  and (kind != "loss_spike" or i.step >= step)), key=lambda i: i.detected_at)
    row = {"fault": kind, "attempt": att, "step": step, "detected": bool(hit),
           "detect_s": round(hit[0].detected_at.timestamp() - t, 1) if hit else None,
           "actions": [a.kind.value for i in hit[:1] for a in store.get_incident(i.id).actions]}
    if kind in ("sigkill", "hang"):
        nxt = [r["time"] for r in step_recs if r.get("attempt") == att + 1]
        resumed = next((r.get("resumed_from") for r in recs if r.get("event") == "started" and r.get("attempt") == att + 1), None)
        row.update(mttr_s=round(nxt[0] - t, 1) if nxt else None, resumed_from=resumed)
    else:
        before = [r["loss"] for r in step_recs if r.get("attempt") == att and step - 10 <= r["step"] < step]
        base = statistics.median(before) if before else None
        ok = [r for r in step_recs if r["time"] > t and r["step"] > step and base and r["loss"] <= 1.5 * base]
        row.update(baseline_loss=base, mttr_s=round(ok[0]["time"] - t, 1) if ok else None,
                   recovered_at_step=ok[0]["step"] if ok else None)
    faults.append(row)
res = {"dry_run": dry, "ranks": spec["launcher"]["nproc_per_node"], "daemon_rc": rc, "wall_s": round(wall, 1),
       "final_state": run.state.value, "final_step": max((r["step"] for r in step_recs), default=None),
       "attempts": len(store.list_attempts(run.id)), "incidents": [(i.attempt, i.symptom.value) for i in incs],
       "faults": faults}
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(os.environ["OUT"], "x8_faults.json"), "w"), indent=1)
md = [f"| fault | attempt | step | detected after (s) | MTTR (s) | actions |", "|---|---|---|---|---|---|"]
md += [f"| {f['fault']} | {f['attempt']} | {f['step']} | {f['detect_s']} | {f['mttr_s']} | {', '.join(f['actions'])} |"
       for f in faults]
md.append(f"\n{res['ranks']} ranks, final state {res['final_state']} at step {res['final_step']}, "
          f"{res['attempts']} attempts, {res['wall_s']} s wall.")
Path(os.environ["OUT"], "x8_faults.md").write_text("\n".join(md) + "\n")
ok = run.state.value.lower() == "completed" and len(faults) == 3 and all(f["detected"] and f["mttr_s"] is not None for f in faults)
sys.exit(0 if ok else 1)
EOF
}

# ------------------------------------------------------------------------------------- the phases
export OUT
echo "== planner: every case of this script on 8×H200-141GB"
plan_cases; plan_rc=$?
case "$PHASE" in
  plan)   exit $plan_rc ;;
  bench)  bench "${BENCH_CASES[@]/#/--case=}" ; collect_logs ;;
  long)   bench "${LONG_CASES[@]/#/--case=}" ; collect_logs ;;
  longest) bench "${LONGEST_CASES[@]/#/--case=}" ; collect_logs ;;
  faults) rm -rf /tmp/ulysses-x8-faults   # a fresh state dir: never re-adopt an older run of this spec
          fault_run /tmp/ulysses-x8-faults 0; rc=$?
          cp /tmp/ulysses-x8-faults/daemon.log "$OUT/x8_daemon.log" 2>/dev/null
          exit $rc ;;
  dry-run)
    bash -n bench/gpu_x8.sh || exit 1
    for f in configs/gpt-7b-8xh200.toml configs/gpt-1b-8xh200-sp8.toml; do
      $PY -m ulyssesd.daemon.operator.ctl plan --spec "$f" --gpu h200-141g --gpus 8 >/dev/null \
        && echo "ulyssesctl plan $f: fits" || { echo "ulyssesctl plan $f: does NOT fit" >&2; exit 1; }
    done
    [ "$plan_rc" = 0 ] || { echo "a case is invalid or does not fit" >&2; exit 1; }
    # The bench path itself (gpu_bench.py with 8 ranks, the --case expansion, telemetry) on the tiny CPU model.
    bench "--case=name=cpu-x8-smoke model.preset=tiny model.num_attention_heads=8 model.num_layers=2 precision.dtype=fp32 train.device=cpu train.seq_len=64 train.warmup_steps=1 deepspeed.config.zero_optimization.overlap_comm=false steps=3 timeout=300"
    $PY -c "import json,sys; r=json.loads(open('$OUT/bench.jsonl').read().splitlines()[-1]); print('cpu-x8-smoke:', {k: r.get(k) for k in ('rc','steps_done','tokens_per_s','peak_mem_gib','predicted_peak_gib')}); sys.exit(r['rc'] != 0 or r['steps_done'] != 3)" || exit 1
    W=$(mktemp -d /tmp/ulysses-x8-dry.XXXX)
    fault_run "$W" 1; rc=$?; cat "$OUT/x8_faults.md" 2>/dev/null; exit $rc ;;
esac
echo "elapsed $(( $(date +%s) - T0 )) s"
cat "$OUT/bench.jsonl" 2>/dev/null
