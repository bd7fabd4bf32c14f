"""Issue 38 on one GPU: the checkpoint disk under the daemon. configs/gpt-1b-1xh200.toml at 8K tokens (a 17 GB
tag, async saves, warm standby), three supervised runs as the issue ran them:

- `r1`: keep_last 3, default known_good_steps, a save every 50 steps, retention on its default 60 s timer;
- `r2`: keep_last 1, known_good_steps = 100000, retention_every_s = 10, a save every 100 steps, rank 0 SIGKILLed
  while a save is being written (its partial tag is quarantined as `*.corrupt-*` on the restart);
- `r3`: the same settings with NaN losses on the first attempts: every rollback (no known-good tag: back to the
  start) sets the lineage aside as `*.rolledback-*`.

With `--free-gib N` a ballast file first fills the disk under --work so that N GiB stay free (the issue's
machine had 64 GB free). For each run: the disk preflight's verdict on its settings (the runs then start with
the preflight off, so the runtime discipline is what is measured), and at every save (`checkpoint_saving`,
`checkpoint_saved`, `checkpoint_skipped`, `checkpoint_save_failed`, each seen within 0.5 s) and every 5 s a
sample of the checkpoint directory by category (bytes, counts), the free space and the budget. Raw files under
--out: `{run}_samples.json`, `{run}_events.json`, `{run}_store.json`, `{run}_telemetry.jsonl`, logs;
`summary.json` (also `--analyze` offline).

    python bench/gpu_ckpt_disk.py --out $OUT/ckdisk --free-gib 64          # ~9 min: r1 150 s, r2 180 s, r3 180 s
    python bench/gpu_ckpt_disk.py --out $OUT/ckdisk --runs r2,r3 --seconds 180,180   # a part of it per call
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import read_records as records  # noqa: E402
from daemon_run import (  # noqa: E402
    end_daemon,
    new_socket_path,
    run_dir_of,
    save_logs,
    save_store_and_events,
    save_telemetry,
    start_daemon,
)
from gpu_ckpt21 import training_rank_pids  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt-1b-1xh200.toml"
SAVE_EVENTS = ("checkpoint_saving", "checkpoint_saved", "checkpoint_skipped", "checkpoint_save_failed")

RUNS: dict[str, dict[str, Any]] = {
    "r1": {"keep_last": 3, "interval": 50, "daemon": {}, "remediation": {}},
    "r2": {"keep_last": 1, "interval": 100, "daemon": {"retention_every_s": 10.0},
           "remediation": {"known_good_steps": 100000}, "kill": True},
    "r3": {"keep_last": 1, "interval": 100, "daemon": {"retention_every_s": 10.0},
           "remediation": {"known_good_steps": 100000}, "nan_at": True},
}


# ------------------------------------------------------------------------------------------- the spec
def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {type(v).__name__}")


def toml_dump(doc: dict[str, Any]) -> str:
    """Tables for the dicts (recursively), inline values for the rest; `faults` as an array of tables."""
    out: list[str] = []

    def table(prefix: str, body: dict[str, Any]) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict) or k == "env"}
        if scalars:
            out.append(f"[{prefix}]")
            out.extend(f"{k} = {toml_value(v)}" for k, v in scalars.items())
            out.append("")
        for k, v in body.items():
            if isinstance(v, dict) and k != "env":
                table(f"{prefix}.{k}", v)

    for name, body in doc.items():
        if name == "faults":
            for f in body:
                out.append("[[faults]]")
                out.extend(f"{k} = {toml_value(v)}" for k, v in f.items())
                out.append("")
        else:
            table(name, body)
    return "\n".join(out)


def spec_for(a: argparse.Namespace, name: str, state: Path) -> dict[str, Any]:
    r = RUNS[name]
    from ulyssesd.training.spec import read_toml

    doc = read_toml(Path(a.config))
    doc["run"] = {"name": f"ckdisk-{name}"}
    doc["train"].update(seq_len=a.seq, steps=100000, warmup_steps=100)
    if "model" in doc and not a.compile:
        doc["model"]["compile_blocks"] = False  # a cold inductor cache would eat a run's minutes: not the point
    doc["checkpoint"].update(interval_steps=r["interval"] // a.interval_div, keep_last=r["keep_last"],
                             save_at_end=False)
    doc["detectors"] = {"hang_timeout_floor_s": 120.0}
    doc["remediation"] = {"max_restarts_per_hour": 30, **r["remediation"]}
    doc["daemon"] = {"state_dir": str(state), "socket_path": str(new_socket_path()), "tick_s": 0.5,
                     "stop_grace_s": 60.0, "hang_grace_s": 10.0, "preflight": False, **r["daemon"]}
    if r.get("nan_at"):
        doc["faults"] = [{"kind": "nan_loss", "at_step": s, "attempts": [i + 1]}
                         for i, s in enumerate(a.nan_steps)]
    return doc


# ------------------------------------------------------------------------------------------- sampling
def known_good_tags(db: Path) -> list[str]:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            return [r[0] for r in con.execute("SELECT tag FROM checkpoints WHERE known_good = 1 AND pruned_at IS NULL")]
        finally:
            con.close()
    except sqlite3.Error:
        return []


def sample(ckpt_dir: Path, policy: Any, db: Path, why: str, rec: dict | None) -> dict[str, Any]:
    from ulyssesd.training.checkpoint import budget as bd

    t0 = time.time()
    b = bd.classify(ckpt_dir, policy, known_good_tags(db))
    d = b.to_dict()
    d.pop("policy", None)
    in_dir = b.total_bytes - d["categories"]["other"]["bytes"]
    return {"time": t0, "why": why, "event": (rec or {}).get("event"), "step": (rec or {}).get("step"),
            "attempt": (rec or {}).get("attempt"), "tag": (rec or {}).get("tag"), **d, "dir_bytes": in_dir,
            "within_budget": b.tag_bytes == 0 or in_dir - d["categories"]["deleting"]["bytes"]
            <= policy.budget_bytes(b.tag_bytes) - policy.margin_bytes,
            "sample_s": round(time.time() - t0, 3)}


# ------------------------------------------------------------------------------------------------ a run
def run_one(a: argparse.Namespace, name: str, work: Path, out: Path, seconds: float) -> dict[str, Any]:
    from ulyssesd.daemon.host import disk_budget
    from ulyssesd.daemon.spec import load_run_spec

    state = work / f"state-{name}"
    shutil.rmtree(state, ignore_errors=True)
    spec_path = work / f"{name}.toml"
    spec_path.write_text(toml_dump(spec_for(a, name, state)))
    spec = load_run_spec(spec_path)   # the preflight reads the filesystem of the state dir (under --work)
    ev: dict[str, Any] = {"spec": spec_path.read_text(), "preflight_disk": disk_budget.preflight_disk(spec),
                          "predicted_tag_bytes": disk_budget.predicted_tag_bytes(spec.job)}
    policy = disk_budget.policy_of(spec.daemon, spec.job.model_dump())
    samples: list[dict[str, Any]] = []
    t0 = time.time()
    proc = start_daemon(spec_path, out / f"{name}_daemon.log")
    ev["daemon_started"] = t0
    seen = 0
    last_periodic = 0.0
    try:
        while time.time() - t0 < seconds and proc.poll() is None:
            time.sleep(0.5)
            rd = run_dir_of(state)
            if rd is None:
                continue
            ckpt_dir, db = rd / "checkpoints", state / "ulyssesd.db"
            recs = records(rd / "telemetry.jsonl")
            for rec in recs[seen:]:
                if rec.get("event") in SAVE_EVENTS:
                    samples.append(sample(ckpt_dir, policy, db, "event", rec))
            seen = len(recs)
            if time.time() - last_periodic >= 5.0:
                samples.append(sample(ckpt_dir, policy, db, "periodic", None))
                last_periodic = time.time()
            if RUNS[name].get("kill") and "sigkill_time" not in ev:
                maybe_kill(a, rd, recs, ev)
    finally:
        if proc.poll() is None:
            ev["ended_by_bench"] = True
            end_daemon(proc, state)
    ev["daemon_exit"], ev["wall_s"] = proc.returncode, time.time() - t0
    rd = run_dir_of(state)
    if rd is not None:
        samples.append(sample(rd / "checkpoints", policy, state / "ulyssesd.db", "final", None))
        save_telemetry(rd, out, name)
        save_logs(rd, out, name, tail=10000, head=20000)
    (out / f"{name}_samples.json").write_text(json.dumps(samples, indent=1))
    save_store_and_events(state, out, name, ev)
    shutil.rmtree(state, ignore_errors=True)
    return summarize(out, name)


def maybe_kill(a: argparse.Namespace, rd: Path, recs: list[dict], ev: dict[str, Any]) -> None:
    """r2: SIGKILL rank 0 while a save at or after --kill-at is being written (its manifest not yet there); a save
    that was committed before the bench saw it is noted and the next one is tried."""
    missed = ev.setdefault("kill_missed", [])
    saving = [r for r in recs if r.get("event") == "checkpoint_saving" and r.get("attempt") == 1
              and r.get("step", 0) >= a.kill_at and r["step"] not in missed]
    if not saving:
        return
    s = saving[0]["step"]
    if not any(r.get("kind") == "step" and r.get("attempt") == 1 and r["step"] > s for r in recs):
        return  # still snapshotting
    tag_dir = rd / "checkpoints" / f"step-{s:08d}"
    if (tag_dir / "manifest.json").exists():
        missed.append(s)
        return
    ranks = dict(training_rank_pids(rd))
    if 0 in ranks:
        os.kill(ranks[0], signal.SIGKILL)
        ev.update(sigkill_time=time.time(), killed_during_save_of=s,
                  tag_dir_at_kill={p.name: p.stat().st_size for p in tag_dir.iterdir()} if tag_dir.is_dir() else {})


# ------------------------------------------------------------------------------------------- analysis
def summarize(out: Path, name: str) -> dict[str, Any]:
    samples = json.loads((out / f"{name}_samples.json").read_text())
    ev = json.loads((out / f"{name}_events.json").read_text())
    store = json.loads((out / f"{name}_store.json").read_text()) if (out / f"{name}_store.json").exists() else {}
    tele = out / f"{name}_telemetry.jsonl"
    recs = records(tele) if tele.exists() else []
    runs = store.get("runs") or [{}]
    incidents = store.get("incidents") if isinstance(store.get("incidents"), list) else []
    failed = [r for r in recs if r.get("event") == "checkpoint_save_failed"]
    final = samples[-1] if samples else {}
    return {
        "run": name, "wall_s": round(ev.get("wall_s", 0), 1), "daemon_exit": ev.get("daemon_exit"),
        "state": runs[0].get("state"), "state_reason": runs[0].get("state_reason"),
        "preflight_disk": ev.get("preflight_disk"), "predicted_tag_bytes": ev.get("predicted_tag_bytes"),
        "saves": sum(1 for r in recs if r.get("event") == "checkpoint_saved"),
        "skipped": sum(1 for r in recs if r.get("event") == "checkpoint_skipped"),
        "save_failures": [{k: f.get(k) for k in ("step", "errno", "bytes_free")} for f in failed],
        "enospc": any(f.get("errno") in ("ENOSPC", "EDQUOT") for f in failed),
        "samples": len(samples), "within_budget_every_sample": all(s.get("within_budget", True) for s in samples),
        "max_dir_bytes": max((s.get("dir_bytes", 0) for s in samples), default=None),
        "min_free_bytes": min((s["free_bytes"] for s in samples if s.get("free_bytes") is not None), default=None),
        "tag_bytes": max((s.get("tag_bytes", 0) for s in samples), default=None),
        "final_categories": final.get("categories"), "final_set_aside": final.get("set_aside"),
        "incidents": [(i.get("symptom"), i.get("status"), (i.get("summary") or "")[:160]) for i in incidents],
        "killed_during_save_of": ev.get("killed_during_save_of"), "kill_missed": ev.get("kill_missed"),
    }


def fill_disk(work: Path, free_gib: float) -> dict[str, Any]:
    """A ballast file so that `free_gib` GiB stay free on the filesystem of `work` (nothing when already less)."""
    st = shutil.disk_usage(work)
    extra = st.free - int(free_gib * (1 << 30))
    info: dict[str, Any] = {"free_before": st.free, "total": st.total}
    if extra > (1 << 30):
        ballast = work / "ballast.bin"
        with open(ballast, "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, extra)
        info["ballast_bytes"] = extra
    info["free_after"] = shutil.disk_usage(work).free
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ulysses-ckdisk", help="state dirs and checkpoints (the disk measured)")
    ap.add_argument("--runs", default="r1,r2,r3")
    ap.add_argument("--seconds", default="150,180,180", help="wall budget of each run, in --runs order")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--config", default=str(CONFIG), help="the run's job config (a CPU smoke: configs/tiny-cpu.toml)")
    ap.add_argument("--compile", action="store_true", help="keep the config's model.compile_blocks (off: no cold "
                    "inductor compile in a run's time)")
    ap.add_argument("--free-gib", type=float, default=None, help="fill the disk to leave this much free first")
    ap.add_argument("--kill-at", type=int, default=200, help="r2: SIGKILL rank 0 during the save at/after this step")
    ap.add_argument("--nan-steps", type=lambda s: [int(x) for x in s.split(",")], default=[120, 120, 120, 120],
                    help="r3: a NaN loss at this step of attempts 1, 2, ... (each rolls back to the start)")
    ap.add_argument("--interval-div", type=int, default=1, help="divide each run's save interval (CPU smoke)")
    ap.add_argument("--analyze", action="store_true", help="recompute summary.json from the raw files in --out")
    a = ap.parse_args()
    out = Path(a.out)
    names = a.runs.split(",")
    if a.analyze:
        summary = {"runs": [summarize(out, n) for n in names]}
    else:
        out.mkdir(parents=True, exist_ok=True)
        work = Path(a.work)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        summary: dict[str, Any] = {"disk": fill_disk(work, a.free_gib) if a.free_gib else
                                   {"free_before": shutil.disk_usage(work).free}, "runs": []}
        try:
            for n, secs in zip(names, [float(s) for s in a.seconds.split(",")], strict=False):
                summary["runs"].append(run_one(a, n, work, out, secs))
                (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
