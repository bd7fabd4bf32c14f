"""Supervision on the real GPUs (issue 7): overhead, MTTR after a SIGKILLed rank, and a real NCCL hang.

Phase 1 (overhead): the same job twice, side by side in one device call: bare (`torchrun ... -m
ulyssesd.training`, per-rank telemetry gather off) and under `ulyssesd run` (gather on, daemon tailing
telemetry). Compared on the median interval between consecutive step records (everything a step costs:
compute, the per-rank gather, the telemetry write, the control poll).

Phase 2 (faults, one supervised run): checkpoints every K steps; rank 1 is SIGKILLed from outside at the
first step >= KILL_AT of attempt 1 (MTTR); on attempt 2 rank 1 hangs before step HANG_AT (spec fault
"hang": rank 0 blocks inside an NCCL all-gather) and the daemon must detect it with its calibrated timeout,
dump stacks, kill and resume. Raw material (telemetry, store tables, log tails) goes to --out; the figures
are computed by `--analyze` (also runnable offline on the copied files).

    python bench/gpu_daemon.py --out $OUT/daemon [--preset gpt-1b --seq 16384 --device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import rank_pids
from bench_common import read_records as records
from daemon_run import (
    DAEMON_TOML,
    end_daemon,
    epoch_of,
    job_toml_head,
    kill_group,
    new_socket_path,
    run_dir_of,
    save_logs,
    save_store_and_events,
    save_telemetry,
    start_daemon,
)

JOB = job_toml_head(sp=2, ckpt="{ckpt}") + """\
[telemetry]
gather_per_rank = {gather}
[checkpoint]
interval_steps = {interval}
keep_last = 3
save_at_end = {save_at_end}
"""


def step_intervals(recs: list[dict], attempt: int | None = None) -> list[float]:
    steps = [r for r in recs if r.get("kind") == "step" and (attempt is None or r.get("attempt") == attempt)]
    return [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1]


def job_toml(a, overhead: bool, **kw) -> str:
    """The job section: the overhead phase runs its own preset/sequence/checkpointing (gpt-7b by default)."""
    preset, seq, ckpt = (a.overhead_preset, a.overhead_seq, a.overhead_ckpt) if overhead else (a.preset, a.seq, a.ckpt)
    return JOB.format(preset=preset, dtype=a.dtype, seq=seq, device=a.device, ckpt=ckpt, **kw)


def phase_bare(a, work: Path, out: Path, round_no: int = 1) -> None:
    d = work / f"bare{round_no}"
    d.mkdir(parents=True, exist_ok=True)
    spec = d / "spec.toml"
    spec.write_text(job_toml(a, True, steps=a.overhead_steps, gather="false", interval=10**9, save_at_end="false"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "ulyssesd.training", "--spec", str(spec), "--run-dir", str(d), "--attempt", "1"]
    with open(d / "log.txt", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=a.phase_timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
    tel = (d / "telemetry.jsonl").read_text() if (d / "telemetry.jsonl").exists() else ""
    (out / f"bare{round_no}_telemetry.jsonl").write_text(tel)
    (out / f"bare{round_no}_log_tail.txt").write_text((d / "log.txt").read_text()[-6000:])


def supervised(a, work: Path, out: Path, name: str, steps: int, interval: int, faults: str, save_at_end: bool,
               kill_at: int | None, timeout: float, overhead: bool = False) -> dict:
    state = work / f"state-{name}"
    sock = new_socket_path()
    spec = work / f"{name}.toml"
    spec.write_text(DAEMON_TOML.format(name=name, nproc=2, state=state, sock=sock, hang_floor=a.hang_floor)
                    + job_toml(a, overhead, steps=steps, gather="true", interval=interval,
                               save_at_end=str(save_at_end).lower()) + faults)
    log = out / f"{name}_daemon.log"
    t0 = time.time()
    proc = start_daemon(spec, log)
    events: dict = {"daemon_started": t0}
    try:
        while time.time() - t0 < timeout and proc.poll() is None:
            time.sleep(0.2)
            rd = run_dir_of(state)
            if rd is None or kill_at is None or "sigkill_time" in events:
                continue
            recs = records(rd / "telemetry.jsonl")
            steps_a1 = [r["step"] for r in recs if r.get("kind") == "step" and r.get("attempt") == 1]
            if steps_a1 and steps_a1[-1] >= kill_at:
                ranks = dict(rank_pids(rd))
                if 1 in ranks:
                    os.kill(ranks[1], signal.SIGKILL)
                    events.update(sigkill_time=time.time(), sigkill_after_step=steps_a1[-1], sigkill_pid=ranks[1])
    finally:
        if proc.poll() is None:
            events["daemon_timeout"] = True
            end_daemon(proc, state)  # detach; then the job goes too
    events["daemon_exit"] = proc.returncode
    events["wall_s"] = time.time() - t0
    rd = run_dir_of(state)
    if rd is not None:
        save_telemetry(rd, out, name, empty_if_missing=True)
        save_logs(rd, out, name, tail=12000)
        ck = rd / "checkpoints"
        events["checkpoint_dirs"] = sorted(p.name for p in ck.iterdir()) if ck.exists() else []
    save_store_and_events(state, out, name, events)
    return events


def analyze(out: Path) -> dict:
    res: dict = {}
    warm = 3  # skip warm-up intervals
    rounds = sorted(int(p.name[len("bare"):-len("_telemetry.jsonl")]) for p in out.glob("bare*_telemetry.jsonl"))
    ib: list[float] = []
    isup: list[float] = []
    per_round = []
    for n in rounds:  # interleaved rounds: bare n, supervised n (the pooled medians are the figure)
        b = step_intervals(records(out / f"bare{n}_telemetry.jsonl"))[warm:]
        u = step_intervals(records(out / f"overhead{n}_telemetry.jsonl"))[warm:]
        ib += b
        isup += u
        if b and u:
            per_round.append({"round": n, "bare_median_s": round(statistics.median(b), 4),
                              "supervised_median_s": round(statistics.median(u), 4), "n": [len(b), len(u)],
                              "overhead_pct": round(100 * (statistics.median(u) / statistics.median(b) - 1), 2)})
    if len(ib) > 1 and len(isup) > 1:
        mb, ms = statistics.median(ib), statistics.median(isup)
        res["overhead"] = {"bare_median_interval_s": round(mb, 4), "supervised_median_interval_s": round(ms, 4),
                           "overhead_pct": round(100 * (ms - mb) / mb, 2), "n_bare": len(ib), "n_supervised": len(isup),
                           "bare_iqr_s": [round(x, 4) for x in statistics.quantiles(ib, n=4)[::2]],
                           "supervised_iqr_s": [round(x, 4) for x in statistics.quantiles(isup, n=4)[::2]],
                           "rounds": per_round}
    ev_path = out / "faults_events.json"
    if ev_path.exists():
        ev = json.loads(ev_path.read_text())
        recs = records(out / "faults_telemetry.jsonl")
        store = json.loads((out / "faults_store.json").read_text()) if (out / "faults_store.json").exists() else {}
        atts = {a["number"]: a for a in store.get("attempts", []) if isinstance(a, dict)}
        incs = [i for i in store.get("incidents", []) if isinstance(i, dict)]
        first_step = {}
        started = {}
        loaded = {}
        for r in recs:
            if r.get("kind") == "step":
                first_step.setdefault(r["attempt"], r)
            elif r.get("event") == "started":
                started.setdefault(r["attempt"], r)
            elif r.get("event") == "checkpoint_loaded":
                loaded.setdefault(r["attempt"], r)
        saves = [r for r in recs if r.get("event") == "checkpoint_saved"]
        res["checkpoint"] = {
            "saves": [{"tag": r["tag"], "seconds": r["seconds"], "GB": round(r["bytes"] / 1e9, 2),
                       "GBps": round(r["bytes"] / 1e9 / max(r["seconds"], 1e-9), 2)} for r in saves],
            "loads": [{"attempt": a, "tag": r["tag"], "seconds": r["seconds"]} for a, r in loaded.items()]}
        kill = ev.get("sigkill_time")
        if kill and 2 in atts:
            a1, a2 = atts.get(1, {}), atts[2]
            inc = next((i for i in incs if i["attempt"] == 1), None)
            t_detect = epoch_of(inc["detected_at"]) if inc else None
            t_end1, t_launch2 = epoch_of(a1.get("ended_at")), epoch_of(a2.get("started_at"))
            st2, ld2, fs2 = started.get(2), loaded.get(2), first_step.get(2)
            m = {"killed_after_step": ev.get("sigkill_after_step"),
                 "detection_s": None if t_detect is None else round(t_detect - kill, 2),
                 "teardown_s": None if t_end1 is None else round(t_end1 - (t_detect or kill), 2),
                 "launch_gap_s": None if t_launch2 is None or t_end1 is None else round(t_launch2 - t_end1, 2)}
            if st2 and t_launch2:
                load_s = ld2["seconds"] if ld2 else 0.0
                m["init_s"] = round(st2["time"] - load_s - t_launch2, 2)  # interpreter+imports+NCCL+DeepSpeed
                m["checkpoint_load_s"] = load_s
            if fs2 and st2:
                m["first_step_s"] = round(fs2["time"] - st2["time"], 2)
            if fs2:
                m["mttr_s"] = round(fs2["time"] - kill, 2)
                m["resumed_at_step"] = fs2["step"]
            m["diagnosis"] = a1.get("diagnosis")
            m["incident"] = None if inc is None else {"symptom": inc["symptom"], "summary": inc["summary"][:300]}
            res["mttr_sigkill"] = m
        hang_incs = [i for i in incs if i["symptom"] == "hang"]
        if hang_incs:
            h = hang_incs[0]
            att = h["attempt"]
            steps = [r for r in recs if r.get("kind") == "step" and r.get("attempt") == att]
            last = steps[-1] if steps else None
            t_det = epoch_of(h["detected_at"])
            nxt = first_step.get(att + 1)
            ev_h = h.get("evidence") or {}
            if isinstance(ev_h, str):
                ev_h = json.loads(ev_h)
            res["nccl_hang"] = {
                "attempt": att, "last_step_before_hang": None if last is None else last["step"],
                "detected_after_last_step_s": None if last is None or t_det is None else round(t_det - last["time"], 2),
                "summary": h["summary"][:400], "diagnosis_of_attempt": atts.get(att, {}).get("diagnosis"),
                "stacks_captured": bool(ev_h.get("stacks")),
                "stack_excerpt": str(ev_h.get("stacks"))[:600],
                "recovered_first_step_s_after_detection": None if nxt is None or t_det is None
                else round(nxt["time"] - t_det, 2),
                "resumed_at_step": None if nxt is None else nxt["step"]}
        res["final"] = {"run_state": [r.get("state") for r in store.get("runs", []) if isinstance(r, dict)],
                        "daemon_exit": ev.get("daemon_exit"), "wall_s": round(ev.get("wall_s", 0), 1),
                        "attempts": [{k: a.get(k) for k in ("number", "returncode", "signal", "diagnosis",
                                                            "resumed_from")} for a in atts.values()]}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ulysses-daemon-bench")
    ap.add_argument("--preset", default="gpt-1b")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--ckpt", default="activation_checkpoint_every = 1", help="[train] line of the fault run")
    ap.add_argument("--overhead-preset", default="gpt-7b")
    ap.add_argument("--overhead-seq", type=int, default=32768)
    ap.add_argument("--overhead-ckpt", default="activation_checkpoint_layers = 8")
    ap.add_argument("--overhead-rounds", type=int, default=1)
    ap.add_argument("--overhead-steps", type=int, default=40)
    ap.add_argument("--fault-steps", type=int, default=34)
    ap.add_argument("--interval", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=16)
    ap.add_argument("--hang-at", type=int, default=28)
    ap.add_argument("--hang-floor", type=float, default=20.0)
    ap.add_argument("--phase-timeout", type=float, default=120.0)
    ap.add_argument("--fault-timeout", type=float, default=300.0)
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds: the fault run is cut to end 20 s before")
    ap.add_argument("--phases", default="overhead,faults")
    ap.add_argument("--analyze", action="store_true", help="only analyze the files already in --out")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    if not a.analyze:
        if "overhead" in phases:
            for n in range(1, a.overhead_rounds + 1):  # bare, supervised, bare, supervised: drift hits both
                phase_bare(a, work, out, n)
                supervised(a, work, out, f"overhead{n}", a.overhead_steps, 10**9, "", False, None, a.phase_timeout,
                           overhead=True)
                print(json.dumps(analyze(out).get("overhead")), flush=True)
        if "faults" in phases:
            faults = (f"\n[[faults]]\nkind = \"hang\"\nat_step = {a.hang_at}\nrank = 1\nattempts = [2]\n")
            timeout = a.fault_timeout if a.deadline is None else min(a.fault_timeout, a.deadline - time.time() - 20)
            supervised(a, work, out, "faults", a.fault_steps, a.interval, faults, True, a.kill_at, max(60.0, timeout))
    res = analyze(out)
    (out / "daemon_results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
