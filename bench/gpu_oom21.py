"""Issue 21's real CUDA OOM under the daemon, on one GPU: gpt-1b at 32K, micro-batch 4, no recompute, preflight
off (with preflight on the daemon refuses the launch). The evidence-driven memory ladder must read the OOM and
the planner, change the config once to what is predicted to fit, and end COMPLETED. Optional second run: a real
memory spike mid-run (`[[faults]] kind = "memory_spike"`: the rank holds N GiB more from step K, on attempt 1
only) on the shipped config, to see what the same ladder does with an OOM the config itself does not explain.

Raw files per run under --out: store dump, telemetry, attempt logs (head and tail), daemon log,
`ulyssesctl incidents --json`; `--analyze` prints the states, incidents and actions from them.

    python bench/gpu_oom21.py --out $OUT/oom [--runs oom,spike] [--base configs/gpt-1b-1xh200.toml]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tomllib
from bench_common import read_records as records
from daemon_run import (
    end_daemon,
    new_socket_path,
    run_dir_of,
    save_logs,
    save_store_and_events,
    save_telemetry,
    start_daemon,
)
from gpu_bench import set_dotted, to_toml

DAEMON_SECTION = {"tick_s": 0.5, "stop_grace_s": 30.0, "hang_grace_s": 10.0, "stack_dump_wait_s": 3.0,
                  "preflight": False}


def build_spec(base: Path, name: str, state: Path, sock: Path, overrides: dict, faults: list[dict]) -> str:
    spec = tomllib.loads(base.read_text())
    spec["run"] = {"name": name}
    spec.setdefault("daemon", {}).update(DAEMON_SECTION, state_dir=str(state), socket_path=str(sock))
    spec.setdefault("remediation", {})["max_restarts_per_hour"] = 20
    for k, v in overrides.items():
        set_dotted(spec, k, v)
    text = to_toml(spec)
    for f in faults:
        text += "\n[[faults]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in f.items())
    return text


def supervise(a, name: str, overrides: dict, faults: list[dict], timeout: float, out: Path) -> dict:
    work = Path(a.work)
    state = work / f"state-{name}"
    shutil.rmtree(state, ignore_errors=True)
    sock = new_socket_path()
    spec = work / f"{name}.toml"
    spec.write_text(build_spec(Path(a.base), name, state, sock, overrides, faults))
    shutil.copy(spec, out / f"{name}_spec.toml")
    t0 = time.time()
    proc = start_daemon(spec, out / f"{name}_daemon.log")
    ev: dict = {"daemon_started": t0}
    try:
        proc.wait(timeout=max(30.0, timeout))
    except subprocess.TimeoutExpired:
        ev["daemon_timeout"] = True
        end_daemon(proc, state)
    ev["daemon_exit"], ev["wall_s"] = proc.returncode, round(time.time() - t0, 1)
    ctl = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.operator.ctl", "--state-dir", str(state), "incidents",
                          "--json", "--all-runs"], capture_output=True, text=True, timeout=60)
    (out / f"{name}_incidents.json").write_text(ctl.stdout or ctl.stderr)
    rd = run_dir_of(state)
    if rd is not None:
        save_telemetry(rd, out, name)
        save_logs(rd, out, name, tail=12000, head=12000)
        for cfg in sorted((rd / "configs").glob("*")) if (rd / "configs").exists() else []:
            shutil.copy(cfg, out / f"{name}_config_{cfg.name}")
    save_store_and_events(state, out, name, ev)
    shutil.rmtree(state, ignore_errors=True)
    return ev


def summarize(out: Path, name: str) -> dict | None:
    p = out / f"{name}_store.json"
    if not p.exists():
        return None
    store = json.loads(p.read_text())
    ev = json.loads((out / f"{name}_events.json").read_text())
    recs = records(out / f"{name}_telemetry.jsonl")
    steps = [r for r in recs if r.get("kind") == "step"]
    by_att: dict = {}
    for r in steps:
        by_att.setdefault(r["attempt"], []).append(r)

    def dec(x):
        return json.loads(x) if isinstance(x, str) and x[:1] in "{[" else x
    return {
        "run_state": [(r.get("state"), r.get("state_reason")) for r in store.get("runs", [])
                      if isinstance(r, dict)],
        "daemon_exit": ev.get("daemon_exit"), "wall_s": ev.get("wall_s"), "timeout": ev.get("daemon_timeout", False),
        "attempts": [{k: x.get(k) for k in ("number", "returncode", "signal", "diagnosis", "config_version",
                                            "resumed_from")} for x in store.get("attempts", []) if isinstance(x, dict)],
        "steps_per_attempt": {k: [v[0]["step"], v[-1]["step"], round(sorted(r.get("step_time_s", 0) for r in v)[len(v) // 2], 3),
                                  max((r.get("mem_max_allocated_gib") or 0) for r in v)] for k, v in by_att.items()},
        "incidents": [{k: dec(i.get(k)) for k in ("id", "attempt", "symptom", "status", "summary")}
                      for i in store.get("incidents", []) if isinstance(i, dict)],
        "actions": [{k: dec(x.get(k)) for k in ("incident_id", "kind", "parameters", "config_diff", "mode", "from_config_version", "to_config_version")}
                    for x in store.get("actions", []) if isinstance(x, dict)],
        "transitions": [(t.get("from_state"), t.get("to_state"), (t.get("reason") or "")[:160])
                        for t in store.get("state_transitions", []) if isinstance(t, dict)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ulysses-oom21")
    ap.add_argument("--base", default="configs/gpt-1b-1xh200.toml")
    ap.add_argument("--runs", default="oom")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--extra", default="", help="more dotted overrides k=v,k=v (CPU dry runs: model.preset=tiny)")
    ap.add_argument("--spike-gib", type=float, default=70.0)
    ap.add_argument("--spike-at", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=240.0, help="per run")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds: a run ends 10 s before")
    ap.add_argument("--analyze", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    extra = {}
    for kv in filter(None, a.extra.split(",")):
        k, v = kv.split("=", 1)
        try:
            extra[k] = json.loads(v)
        except json.JSONDecodeError:
            extra[k] = v
    runs = a.runs.split(",")
    common = {"train.seq_len": a.seq, "train.steps": a.steps, "train.device": a.device,
              "checkpoint.interval_steps": 1000, "checkpoint.save_at_end": False, **extra}
    plan = {"oom": ({**common, "train.micro_batch_size": a.micro_batch, "train.activation_checkpoint_every": 0}, []),
            "spike": ({**common, "train.micro_batch_size": 1}, [
                {"kind": "memory_spike", "at_step": a.spike_at, "magnitude": a.spike_gib, "steps": 2, "rank": 0,
                 "attempts": [1]}])}
    if not a.analyze:
        for name in runs:
            left = a.timeout if a.deadline is None else min(a.timeout, a.deadline - time.time() - 10)
            if left < 60:
                print(f"{name}: skipped, {left:.0f} s left", flush=True)
                continue
            supervise(a, name, *plan[name], left, out)
            print(json.dumps({name: summarize(out, name)}, indent=1, default=str), flush=True)
    res = {n: summarize(out, n) for n in plan if (out / f"{n}_store.json").exists()}
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    if a.analyze:
        print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
