"""Soak: the real 2-rank tiny job under the real daemon for a long time with random faults and daemon restarts
(bench/chaos.py's round robin: rank SIGKILL, rank hang, corrupt checkpoint, daemon SIGKILL + restart, garbage
telemetry line), sampling what must stay flat: the daemon's RSS, CPU seconds per training step, open files,
the store's and the logs' sizes, the checkpoint directory's size.

    .venv/bin/python bench/soak.py --minutes 120 --every 120 --sample-s 30 [--out soak.json]

Growth per hour is the least-squares slope over the second half of the samples (the first half includes the
warm-up: imports, the store's first pages, the first checkpoints).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import psutil
from chaos import Chaos, records

from ulyssesd.training.checkpoint.retention import tree_bytes


def sample(c: Chaos) -> dict | None:
    if c.daemon is None or c.daemon.poll() is not None:
        return None
    try:
        proc = psutil.Process(c.daemon.pid)
        cpu = proc.cpu_times()
        rss, fds = proc.memory_info().rss, proc.num_fds()
    except psutil.Error:
        return None
    rd = c.run_dir()
    steps = [r for r in records(rd) if r.get("kind") == "step"] if rd else []
    logs = sum(tree_bytes(d) for d in (c.state / "logs",) if d.exists()) + (c.log.stat().st_size if c.log.exists() else 0)
    return {"t": time.time(), "pid": c.daemon.pid, "rss": rss, "fds": fds, "cpu_s": cpu.user + cpu.system,
            "step_records": len(steps), "last_step": steps[-1]["step"] if steps else 0,
            "store_bytes": sum(p.stat().st_size for p in c.state.glob("ulyssesd.db*")),
            "backups_bytes": tree_bytes(c.state / "backups") if (c.state / "backups").exists() else 0,
            "logs_bytes": logs + (tree_bytes(rd / "logs") if rd and (rd / "logs").exists() else 0),
            "telemetry_bytes": sum(p.stat().st_size for p in rd.glob("telemetry.jsonl*")) if rd else 0,
            "checkpoint_bytes": tree_bytes(rd / "checkpoints") if rd and (rd / "checkpoints").exists() else 0}


def slope_per_hour(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return None if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 3600


def summarize(samples: list[dict], res: dict) -> dict:
    half = samples[len(samples) // 2:]
    ts = [s["t"] for s in half]
    out = {"samples": len(samples), "hours": (samples[-1]["t"] - samples[0]["t"]) / 3600 if samples else 0,
           "faults": res.get("faults"), "survived": res.get("survived"), "final_state": res.get("final_state"),
           "final_step": res.get("final_step"), "attempts": res.get("attempts"), "incidents": res.get("incidents"),
           "ettr": res.get("ettr"), "per_class": res.get("per_class")}
    for key in ("rss", "fds", "store_bytes", "backups_bytes", "logs_bytes", "telemetry_bytes", "checkpoint_bytes"):
        vals = [s[key] for s in half]
        out[key] = {"first": samples[0][key], "last": samples[-1][key], "max": max(s[key] for s in samples),
                    "growth_per_hour_2nd_half": slope_per_hour(ts, vals)}
    # The daemon's CPU per training step, per daemon process (each daemon restart starts its counter at 0).
    per_pid: dict[int, list[dict]] = {}
    for s in samples:
        per_pid.setdefault(s["pid"], []).append(s)
    rates = [(v[-1]["cpu_s"] - v[0]["cpu_s"]) / (v[-1]["last_step"] - v[0]["last_step"])
             for v in per_pid.values() if len(v) > 1 and v[-1]["last_step"] > v[0]["last_step"]]
    out["daemon_cpu_s_per_step"] = rates
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--every", type=float, default=120.0, help="seconds between faults")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=None, help="write the samples and the summary here (JSON)")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ulyssesd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    c = Chaos(work, args.every, args.minutes)
    samples: list[dict] = []
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(args.sample_s):
            s = sample(c)
            if s is not None:
                samples.append(s)
                if args.out:
                    Path(args.out).write_text(json.dumps({"samples": samples}, indent=0))

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    res = c.run()
    done.set()
    th.join(5)
    summary = summarize(samples, res) if samples else {"error": "no samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "chaos": res, "samples": samples}, indent=0))
    return 0 if res.get("survived") == res.get("faults") else 1


if __name__ == "__main__":
    raise SystemExit(main())
