"""The run record at the scale of a long run: how long `ulyssesctl status`, `incidents`, `report` and the
daemon's telemetry ingest take on a store of 10^5 incidents, 10^7 step records and 10^3 attempts.

    .venv/bin/python bench/store_scale.py [--dir DIR] [--incidents 100000] [--steps 10000000] [--attempts 1000]
                                          [--backlog 5000000] [--out results.json]

Builds (or reuses, when DIR already holds one of the same size) a state dir: the store at Alembic head with one
run, its attempts, incidents (one action each), state transitions and checkpoints, bulk-inserted; the run's
telemetry.jsonl with `--steps` step lines spread over the attempts (each resuming 100 steps back). Then times
each command as an operator runs it (a fresh `ulyssesctl` process, imports included) and the daemon's ingest of
a `--backlog`-record telemetry file (`ingest_bench.ingest`: reader + engine + cursor, as the daemon's tick
does it). Prints one JSON object with the command, machine and date, and writes it to `--out` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_ID = "scale-20261207-000000"
T0 = 1796600000.0  # the run's first second (epoch)
STEP_S = 0.5       # simulated seconds per step
SYMPTOMS = ("loss_spike", "slow_step", "throughput_drop", "hang", "crash", "memory_spike", "nan_loss")
STATUSES = ("resolved",) * 8 + ("escalated", "failed")


def _ts(t: float) -> str:
    """SQLAlchemy's DateTime text on SQLite: naive UTC."""
    return datetime.fromtimestamp(t, UTC).replace(tzinfo=None).isoformat(sep=" ")


def write_telemetry(path: Path, steps: int, attempts: int) -> None:
    """`steps` step lines over `attempts` attempts, written with a format string (json.dumps per line would take
    minutes for 10^7 lines); each attempt resumes 100 steps before where the previous one stopped."""
    per = max(1, steps // attempts)
    line = ('{"v": 1, "kind": "step", "step": %d, "loss": %.6f, "time": %.3f, "attempt": %d, "step_time_s": 0.45,'
            ' "step_time_max_s": 0.5, "tokens_per_s": 52000.0, "mem_allocated_gib": 61.5,'
            ' "mem_max_allocated_gib": 70.25, "config_version": 1}\n')
    t, step, written = T0, 0, 0
    with path.open("w", buffering=8 << 20) as fh:
        for a in range(1, attempts + 1):
            step = max(0, step - 100)
            n = per if a < attempts else steps - written
            fh.write("".join(line % (step + i + 1, 2.0 + 8.0 / (step + i + 10) + (i % 7) * 0.001,
                                     t + i * STEP_S, a) for i in range(n)))
            step += n
            t += n * STEP_S + 60.0
            written += n


def build_store(state: Path, incidents: int, steps: int, attempts: int) -> dict[str, float]:
    """The state dir and its store; returns seconds spent per part."""
    from ulyssesd.daemon.store import open_store

    took: dict[str, float] = {}
    run_dir = state / "runs" / RUN_ID
    run_dir.mkdir(parents=True, exist_ok=True)
    db = state / "ulyssesd.db"
    start = time.perf_counter()
    store = open_store(db)
    spec = {"run": {"name": "scale"}, "train": {"steps": steps + 1000}, "launcher": {"kind": "local"}}
    store.create_run(RUN_ID, run_dir=str(run_dir), spec_path=str(run_dir / "spec.toml"), spec=spec,
                     state="RUNNING", reason="bench", at=T0)
    store.add_config_version(RUN_ID, {"train": {"steps": steps + 1000}, "launcher": {"env": {}}},
                             reason="initial spec", parent_version=None, version=1, at=T0)
    store.close()
    rnd = random.Random(20261207)
    per_attempt = steps / attempts
    span = steps * STEP_S + attempts * 60.0
    con = sqlite3.connect(db)
    with con:
        con.executemany(
            "INSERT INTO attempts (run_id, number, command, config_version, host, pid, started_at, ended_at, "
            "returncode, diagnosis) VALUES (?, ?, '[\"python\", \"train.py\"]', 1, 'node-1', ?, ?, ?, ?, ?)",
            [(RUN_ID, a, 1000 + a, _ts(T0 + (a - 1) * span / attempts),
              _ts(T0 + a * span / attempts - 30) if a < attempts else None, 1 if a < attempts else None,
              "crash" if a < attempts else None) for a in range(1, attempts + 1)])
        con.executemany(
            "INSERT INTO state_transitions (run_id, from_state, to_state, reason, attempt, at) VALUES (?, ?, ?, ?, ?, ?)",
            [(RUN_ID, f, to, why, a, _ts(T0 + (a - 1) * span / attempts + k))
             for a in range(1, attempts + 1)
             for k, (f, to, why) in enumerate((("BACKOFF", "STARTING", "relaunch after a crash"),
                                                ("STARTING", "RUNNING", "training"),
                                                ("RUNNING", "BACKOFF", "the job crashed")))])
        rows = []
        for i in range(incidents):
            t = T0 + span * i / incidents
            a = min(attempts, 1 + int(i * attempts / incidents))
            status = STATUSES[rnd.randrange(len(STATUSES))] if i < incidents - 5 else "open"
            rows.append((RUN_ID, a, int(a * per_attempt) + i, SYMPTOMS[i % len(SYMPTOMS)], "warning",
                         f"synthetic incident {i} for the scale bench", json.dumps({"z": i % 13, "window": 100}),
                         status, _ts(t), _ts(t + 5), None if status == "open" else _ts(t + 60)))
        con.executemany(
            "INSERT INTO incidents (run_id, attempt, step, symptom, severity, summary, evidence, status, "
            "detected_at, updated_at, closed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        con.execute(
            "INSERT INTO actions (run_id, incident_id, kind, parameters, config_diff, mode, observe_only, applied_at, "
            "outcome) SELECT run_id, id, 'restart', '{}', '{}', 'restart', 0, updated_at, 'effective' FROM incidents")
        con.executemany(
            "INSERT INTO checkpoints (run_id, tag, step, valid, known_good, attempt, saved_at, updated_at, pruned_at) "
            "VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?)",
            [(RUN_ID, f"global_step{s}", s, s % 5000 == 0, 1 + s * attempts // max(1, steps), _ts(T0 + s * STEP_S),
              _ts(T0 + s * STEP_S), None if s > steps - 3000 else _ts(T0 + s * STEP_S + 600))
             for s in range(500, steps + 1, 500)])
        con.execute("UPDATE runs SET state = 'RUNNING'")
    con.close()
    took["store_s"] = time.perf_counter() - start
    start = time.perf_counter()
    write_telemetry(run_dir / "telemetry.jsonl", steps, attempts)
    took["telemetry_s"] = time.perf_counter() - start
    (state / "scale.json").write_text(json.dumps({"incidents": incidents, "steps": steps, "attempts": attempts}))
    return took


def time_command(args: list[str], state: Path, repeat: int = 1) -> dict[str, object]:
    """Best of `repeat` wall-clock runs of `ulyssesctl --state-dir STATE ARGS` (a fresh process each time)."""
    # `python -c` rather than the ulyssesctl script: PYTHONPATH can then point at another checkout to compare.
    ctl = [sys.executable, "-c", "import sys; from ulyssesd.daemon.operator.ctl import main; sys.exit(main())"]
    best = None
    rc = None
    out = b""
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run([*ctl, "--state-dir", str(state), *args], capture_output=True, cwd=state,
                              env={**os.environ, "COLUMNS": "200"})
        took = time.perf_counter() - start
        rc, out = proc.returncode, proc.stdout
        best = took if best is None else min(best, took)
        if rc not in (0,):
            sys.stderr.write(proc.stderr.decode(errors="replace")[-2000:])
    return {"command": "ulyssesctl " + " ".join(args), "seconds": round(best or 0.0, 2), "rc": rc,
            "output_bytes": len(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ulyssesd-store-scale"))
    ap.add_argument("--incidents", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=10_000_000)
    ap.add_argument("--attempts", type=int, default=1_000)
    ap.add_argument("--backlog", type=int, default=5_000_000, help="records of the ingest measurement (0: skip)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    state = args.dir / "state"
    want = {"incidents": args.incidents, "steps": args.steps, "attempts": args.attempts}
    marker = state / "scale.json"
    built: dict[str, float] = {}
    if not marker.exists() or json.loads(marker.read_text()) != want:
        if state.exists():
            subprocess.run(["rm", "-rf", str(state)], check=True)
        built = build_store(state, **want)
    res: dict[str, object] = {
        "bench": "bench/store_scale.py", "argv": sys.argv[1:], "machine": f"{platform.node()} "
        f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "python": platform.python_version(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "store": want, "build_s": {k: round(v, 1) for k, v in built.items()},
        "db_mb": round((state / "ulyssesd.db").stat().st_size / 1e6, 1),
        "telemetry_mb": round((state / "runs" / RUN_ID / "telemetry.jsonl").stat().st_size / 1e6, 1),
        "commands": [],
    }
    cmds = [["status", "--json"], ["status"], ["incidents"], ["incidents", "--json"], ["incidents", "--status", "open"],
            ["report", "-o", str(args.dir / "report.html")]]
    for c in cmds:
        r = time_command(c, state, repeat=1 if c[0] == "report" else args.repeat)
        res["commands"].append(r)  # type: ignore[attr-defined]
        print(json.dumps(r), file=sys.stderr)
    if args.backlog:
        sys.path.insert(0, str(HERE))
        from ingest_bench import ingest_backlog

        res["ingest"] = ingest_backlog(args.dir / "backlog", args.backlog, args.incidents)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
