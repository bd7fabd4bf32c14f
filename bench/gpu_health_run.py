"""GPU health on a lent GPU through a whole real run (issue 33, "the NVML checks ran on the lent GPU through a
whole run with no false incident").

Runs a shipped config under `ulyssesd run` (its own GPU health checks on, every `--every` s, plus the check
before the launch), saves every `--ckpt-every` steps (the load of saves included), and meanwhile reads every GPU
through the same NVML reader every `--sample` s from this process and judges each reading with the same code
(daemon/host/gpu_health.py). Writes raw material under --out:

- readings.jsonl  every reading (index, UUID, temperatures and thresholds, clocks, throttle reasons, ECC counts,
                  remap/retirement state, Xids), one JSON object per GPU per sample, with the sample time
- problems.json   what the judge found on those readings (faults and warnings), each with its reading
- store.json / telemetry.jsonl / daemon.log  the run's own record (its incidents: gpu_failure must be absent)
- summary.json    samples, GPUs, faults, warnings, gpu_failure incidents, max temperature, throttle reasons
                  seen, SM clock range, the run's end state; "no_false_incident": true when no fault and no
                  gpu_failure incident was recorded on a GPU that trained to the end

    python bench/gpu_health_run.py --out $OUT/gpu_health [--config configs/gpt-1b-1xh200.toml --steps 400
                                   --seq 16384 --ckpt-every 50 --every 5 --sample 2 --time-limit 540]

Needs nvidia-ml-py (`pip install 'ulyssesd[gpu]'` or `pip install nvidia-ml-py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_run import dump_store, end_daemon, new_socket_path, run_dir_of, start_daemon  # noqa: E402

from ulyssesd.daemon.host.gpu_health import GpuHealth, GpuHealthConfig, NvmlReader, Problem  # noqa: E402
from ulyssesd.training.spec import read_toml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def to_toml(d: dict[str, Any], prefix: str = "") -> str:
    scalars, tables = [], []
    for k, v in d.items():
        (tables if isinstance(v, dict) else scalars).append((k, v))
    out = f"[{prefix}]\n" if prefix and scalars else ""
    out += "".join(f"{k} = {json.dumps(v)}\n" for k, v in scalars)
    for k, v in tables:
        out += to_toml(v, f"{prefix}.{k}" if prefix else k)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "gpt-1b-1xh200.toml")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seq", type=int, default=16384, help="train.seq_len (the issue's runs: 16K)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="save interval (17 GB tags, keep_last 3: mind the disk)")
    ap.add_argument("--every", type=float, default=5.0, help="the daemon's [gpu_health] every_s")
    ap.add_argument("--sample", type=float, default=2.0, help="seconds between this script's own readings")
    ap.add_argument("--time-limit", type=float, default=540.0)
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = out / "state"
    spec = read_toml(a.config)
    spec.setdefault("run", {})["name"] = "gpu-health"
    spec.setdefault("train", {}).update(steps=a.steps, seq_len=a.seq)
    spec.setdefault("checkpoint", {})["interval_steps"] = a.ckpt_every
    spec.setdefault("daemon", {}).update(state_dir=str(state), socket_path=str(new_socket_path()))
    spec["gpu_health"] = {"enabled": True, "every_s": a.every}
    spec_path = out / "run.toml"
    spec_path.write_text(to_toml(spec))

    problems: list[Problem] = []
    reader = NvmlReader()
    health = GpuHealth(GpuHealthConfig(), reader, report=lambda faults: None,
                       say=lambda msg: print(f"[gpu_health] {msg}", flush=True))
    samples = 0
    t0 = time.time()
    proc = start_daemon(spec_path, out / "daemon.log")
    with open(out / "readings.jsonl", "w") as fh:
        while True:
            now = time.time()
            found = health.check(now)
            if health.off is not None:
                print(f"NVML is not usable here: {health.off}", file=sys.stderr)
                break
            problems += found
            samples += 1
            for r in health.last:
                fh.write(json.dumps({"t": round(now - t0, 2), **r.as_dict()}) + "\n")
            if proc.poll() is not None or now - t0 > a.time_limit:
                break
            time.sleep(a.sample)
    if proc.poll() is None:
        end_daemon(proc, state)
    rd = run_dir_of(state)
    store = dump_store(state / "ulyssesd.db") if (state / "ulyssesd.db").exists() else {}
    (out / "store.json").write_text(json.dumps(store, indent=1, default=str))
    if rd is not None and (rd / "telemetry.jsonl").exists():
        (out / "telemetry.jsonl").write_text((rd / "telemetry.jsonl").read_text())
    (out / "problems.json").write_text(json.dumps([p.__dict__ for p in problems], indent=1))
    summarize(out, store, problems, samples, health)
    return 0


def summarize(out: Path, store: dict, problems: list[Problem], samples: int, health: GpuHealth) -> None:
    readings = [json.loads(x) for x in (out / "readings.jsonl").read_text().splitlines() if x.strip()]
    def rows(table: str) -> list[dict]:
        got = store.get(table, [])
        return got if isinstance(got, list) else []   # a table that could not be read: its error stays in store.json

    incidents = [i for i in rows("incidents") if i.get("symptom") == "gpu_failure"]
    runs = rows("runs")
    throttles = sorted({r.get("throttle", 0) for r in readings})
    clocks = [r["sm_clock_mhz"] for r in readings if r.get("sm_clock_mhz") is not None]
    temps = [r["temperature_c"] for r in readings if r.get("temperature_c") is not None]
    faults = [p for p in problems if p.severity == "fault"]
    steps = [json.loads(x) for x in (out / "telemetry.jsonl").read_text().splitlines()
             if x.strip() and '"kind": "step"' in x] if (out / "telemetry.jsonl").exists() else []
    summary = {
        "samples": samples, "readings": len(readings), "gpus": sorted({r["uuid"] for r in readings}),
        "faults": [p.message for p in faults], "warnings": [p.message for p in problems if p.severity == "warning"],
        "gpu_failure_incidents": [i.get("summary") for i in incidents],
        "max_temperature_c": max(temps) if temps else None,
        "throttle_reasons_seen": [hex(t) for t in throttles],
        "sm_clock_mhz_range": [min(clocks), max(clocks)] if clocks else None,
        "run_state": runs[0].get("state") if runs else None, "steps_recorded": len(steps),
        "nvml_off": health.off,
        "no_false_incident": health.off is None and not faults and not incidents and bool(steps),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
