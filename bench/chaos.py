"""Chaos benchmark: a supervised CPU run (the real 2-rank job under `ulyssesd run`) with a fault every
N seconds for M minutes. Prints faults survived, lost checkpoints, detection latency and recovery time
per fault class, and ETTR (productive training time / wall time).

    .venv/bin/python bench/chaos.py --every 40 --minutes 5 [--results bench/RESULTS.md]

Fault classes, injected from outside (round robin, each once the job is training again):
  rank_sigkill   SIGKILL one training rank (rank 1)              -> crash -> restart from latest
  rank_hang      SIGSTOP one training rank (a stuck process)     -> hang -> dump, TERM, KILL -> restart
  ckpt_corrupt   flip bytes in the newest checkpoint, then SIGKILL a rank -> previous valid tag used
  daemon_kill    SIGKILL the daemon, start a new one             -> re-adoption, job never stops
  garbage_line   append a garbage line to telemetry.jsonl         -> counted, ignored
Detection = injection -> the incident's detected_at (daemon_kill: -> the new daemon re-adopted);
recovery = injection -> the first step record of the next attempt (daemon_kill, garbage_line: next step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from bench_common import rank_pids as ranks_of
from bench_common import read_records

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["rank_sigkill", "rank_hang", "ckpt_corrupt", "daemon_kill", "garbage_line"]

SPEC = """
[run]
name = "chaos"
[launcher]
kind = "torchrun"
nproc_per_node = 2
[model]
preset = "tiny"
[parallel]
sequence_parallel_size = 2
[precision]
dtype = "fp32"
[train]
steps = 100000
seq_len = 64
micro_batch_size = 1
lr = 3e-4
warmup_steps = 10
device = "cpu"
[deepspeed.config.zero_optimization]
stage = 3
overlap_comm = false
[data]
kind = "synthetic"
[checkpoint]
interval_steps = 10
keep_last = 4
[detectors]
warmup_steps = 5
window = 20
hang_timeout_floor_s = 15.0
hang_startup_timeout_s = 180.0
[remediation]
max_restarts_per_hour = 60
no_progress_restarts = 6
max_crash_restarts = 50
[daemon]
state_dir = "{state}"
socket_path = "{sock}"
tick_s = 0.25
stop_grace_s = 60.0
hang_grace_s = 5.0
stack_dump_wait_s = 2.0
preflight = false
"""


def records(run_dir: Path) -> list[dict]:
    return read_records(run_dir / "telemetry.jsonl")


def valid_tags(run_dir: Path) -> list[str]:
    from ulyssesd.training.checkpoint import list_valid_tags

    return list_valid_tags(run_dir / "checkpoints")


def rank_pids(run_dir: Path) -> list[int]:
    return sorted(pid for _, pid in ranks_of(run_dir))


class Chaos:
    def __init__(self, work: Path, every: float, minutes: float):
        self.work, self.every, self.minutes = work, every, minutes
        self.state = work / "state"
        self.sock = Path(tempfile.mkdtemp(prefix="uls-chaos-", dir="/tmp")) / "d.sock"
        self.spec = work / "run.toml"
        self.spec.write_text(SPEC.format(state=self.state, sock=self.sock))
        self.log = work / "daemon.log"
        self.daemon: subprocess.Popen | None = None
        self.injections: list[dict] = []
        self.corrupted: set[str] = set()
        self.stopped: list[int] = []

    def start_daemon(self) -> None:
        self.daemon = subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(self.spec)],
                                       stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)

    def store(self):
        from ulyssesd.daemon.store import open_store

        return open_store(self.state / "ulyssesd.db", readonly=True)

    def run_dir(self) -> Path | None:
        runs = self.state / "runs"
        return next(runs.iterdir()) if runs.exists() and any(runs.iterdir()) else None

    def current_attempt_training(self, run_dir: Path) -> tuple[int, int] | None:
        """(attempt, last step) if the live ranks' attempt (from their environment) has written a step
        record: faults go into a job that is training, never into one still starting up."""
        ranks = rank_pids(run_dir)
        if not ranks:
            return None
        try:
            att = int(psutil.Process(ranks[-1]).environ().get("ULYSSESD_ATTEMPT", "-1"))
        except (psutil.Error, ValueError):
            return None
        steps = [r["step"] for r in records(run_dir) if r.get("kind") == "step" and r.get("attempt") == att]
        return (att, steps[-1]) if len(steps) >= 3 else None

    def inject(self, kind: str, run_dir: Path, attempt: int) -> None:
        now = time.time()
        ranks = rank_pids(run_dir)
        if ranks:
            try:  # the attempt the ranks belong to (telemetry may lag behind a fresh launch)
                attempt = int(psutil.Process(ranks[-1]).environ().get("ULYSSESD_ATTEMPT", attempt))
            except (psutil.Error, ValueError):
                pass
        entry = {"kind": kind, "time": now, "attempt": attempt}
        if kind == "rank_hang" and ranks:
            self.stopped.extend(ranks[-1:])
        if kind == "rank_sigkill" and ranks:
            os.kill(ranks[-1], signal.SIGKILL)
        elif kind == "rank_hang" and ranks:
            os.kill(ranks[-1], signal.SIGSTOP)
        elif kind == "ckpt_corrupt":
            ck = run_dir / "checkpoints"
            tags = sorted(p for p in ck.iterdir() if p.is_dir() and p.name.startswith("step-") and "." not in p.name)
            if tags:
                shard = max((f for f in tags[-1].rglob("*.pt")), key=lambda f: f.stat().st_size, default=None)
                if shard is not None:
                    with open(shard, "r+b") as fh:
                        fh.seek(shard.stat().st_size // 2)
                        b = fh.read(16)
                        fh.seek(shard.stat().st_size // 2)
                        fh.write(bytes(x ^ 0xFF for x in b))
                    self.corrupted.add(tags[-1].name)
                    entry["tag"] = tags[-1].name
            if ranks:
                os.kill(ranks[-1], signal.SIGKILL)
        elif kind == "daemon_kill":
            assert self.daemon is not None
            self.daemon.send_signal(signal.SIGKILL)
            self.daemon.wait(10)
            time.sleep(2.0)
            self.start_daemon()
        elif kind == "garbage_line":
            with open(run_dir / "telemetry.jsonl", "a") as fh:
                fh.write("}}} chaos: not json {{{\n")
        self.injections.append(entry)
        print(f"[{time.strftime('%H:%M:%S')}] injected {kind} (attempt {attempt})", flush=True)

    def run(self) -> dict:
        t0 = time.time()
        self.start_daemon()
        end = t0 + self.minutes * 60
        last_injection = end - min(self.every, 90.0)  # leave the last fault time to be detected and recovered
        nxt = t0 + self.every
        i = 0
        while time.time() < end:
            time.sleep(1.0)
            if self.daemon is not None and self.daemon.poll() is not None:
                print(f"daemon exited {self.daemon.returncode}; see {self.log}")
                break
            rd = self.run_dir()
            if rd is None or time.time() < nxt or time.time() > last_injection:
                continue
            cur = self.current_attempt_training(rd)
            if cur is None:
                continue  # wait until the job trains again (faults are injected into a training job)
            if self.injections and cur[0] == self.injections[-1]["attempt"] and \
                    self.injections[-1]["kind"] not in ("daemon_kill", "garbage_line") and \
                    time.time() - self.injections[-1]["time"] < 120:
                continue  # the previous fault's restart has not happened yet
            kind = CLASSES[i % len(CLASSES)]
            if kind == "ckpt_corrupt" and len(valid_tags(rd)) < 2:
                continue  # corrupt the newest only when a previous valid tag exists to fall back to
            self.inject(kind, rd, cur[0])
            i += 1
            nxt = time.time() + self.every
        # Let the last fault's recovery finish (bounded) so every injected fault is judged.
        rd = self.run_dir()
        if rd is not None and self.injections:
            last = self.injections[-1]
            restarts = last["kind"] not in ("daemon_kill", "garbage_line")
            min_attempt = last["attempt"] + 1 if restarts else last["attempt"]
            deadline = time.time() + 300
            while time.time() < deadline and self.daemon is not None and self.daemon.poll() is None:
                if any(r.get("kind") == "step" and r.get("time", 0) > last["time"]
                       and (r.get("attempt") or 0) >= min_attempt for r in records(rd)[-50:]):
                    break
                time.sleep(1.0)
        # stop cleanly and collect (a rank still SIGSTOPped could not act on the stop)
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        from ulyssesd.daemon.control.client import send_request

        try:
            send_request(self.sock, {"cmd": "stop"}, timeout_s=10)
        except Exception as exc:  # noqa: BLE001
            print(f"stop request failed: {exc}")
        try:
            self.daemon.wait(180)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
        wall = time.time() - t0
        return self.report(wall)

    def report(self, wall: float) -> dict:
        rd = self.run_dir()
        recs = records(rd)
        st = self.store()
        run = st.latest_run()
        incs = st.list_incidents(run.id)
        atts = st.list_attempts(run.id)
        first_step_of = {}
        for r in recs:
            if r.get("kind") == "step":
                first_step_of.setdefault(r.get("attempt"), r.get("time"))
        per: dict[str, dict[str, list[float]]] = {k: {"detect": [], "recover": []} for k in CLASSES}
        survived = 0
        for inj in self.injections:
            k, t, att = inj["kind"], inj["time"], inj["attempt"]
            if k in ("rank_sigkill", "rank_hang", "ckpt_corrupt"):
                want = {"rank_sigkill": ("crash",), "rank_hang": ("hang",), "ckpt_corrupt": ("crash",)}[k]
                hit = [i for i in incs if i.attempt == att and i.symptom.value in want]
                if hit:
                    per[k]["detect"].append(hit[0].detected_at.timestamp() - t)
                nxt = first_step_of.get(att + 1)
                if nxt is not None:
                    per[k]["recover"].append(nxt - t)
                    survived += 1
            else:
                later = [r["time"] for r in recs if r.get("kind") == "step" and r.get("time", 0) > t]
                if later:
                    per[k]["recover"].append(later[0] - t)
                    survived += 1
                if k == "daemon_kill":
                    per[k]["detect"].append(float("nan"))
        last: dict[int, float] = {}
        for r in recs:
            if r.get("kind") == "step" and isinstance(r.get("step_time_s"), int | float):
                last[r["step"]] = r["step_time_s"]
        productive = sum(last.values())
        ck = rd / "checkpoints"
        quarantined = [p.name.split(".corrupt-")[0] for p in ck.iterdir() if ".corrupt-" in p.name] if ck.exists() else []
        lost = [q for q in quarantined if q not in self.corrupted]
        corrupt_incs = [i for i in incs if i.symptom.value == "checkpoint_corrupt"]
        res = {
            "wall_s": wall, "faults": len(self.injections), "survived": survived,
            "final_state": run.state.value, "final_step": max(last) if last else None, "attempts": len(atts),
            "incidents": len(incs), "lost_checkpoints": len(lost), "deliberately_corrupted": len(self.corrupted),
            "corrupt_fallbacks_recorded": len(corrupt_incs), "ettr": productive / wall if wall else 0.0,
            "load_avg_end": [round(x, 1) for x in os.getloadavg()],
            "per_class": {k: {"n": sum(1 for i in self.injections if i["kind"] == k),
                              "detect_median_s": _med(v["detect"]), "recover_median_s": _med(v["recover"])}
                          for k, v in per.items()},
        }
        return res


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]
    return round(statistics.median(xs), 1) if xs else None


def render(res: dict, cmd: str) -> str:
    lines = [f"Command: `{cmd}` — {res['wall_s'] / 60:.1f} min wall, 2 CPU cores, real 2-rank job "
             f"(torchrun, gloo, ZeRO-3, Ulysses SP=2); load average at the end {res['load_avg_end']} "
             f"(machine shared with other work, so launches and wall times are inflated).", "",
             f"- faults injected: {res['faults']}, survived (training resumed afterwards): {res['survived']}",
             f"- final state: {res['final_state']} at step {res['final_step']} after {res['attempts']} attempts, "
             f"{res['incidents']} incidents",
             f"- lost checkpoints (quarantined without being deliberately corrupted): {res['lost_checkpoints']}; "
             f"deliberately corrupted: {res['deliberately_corrupted']}, fallbacks recorded: "
             f"{res['corrupt_fallbacks_recorded']}",
             f"- ETTR (productive step time / wall): {res['ettr']:.1%}", "",
             "| fault class | n | detection (median s) | recovery to next step (median s) |", "|---|---|---|---|"]
    for k, v in res["per_class"].items():
        det = "n/a" if v["detect_median_s"] is None else f"{v['detect_median_s']}"
        if k in ("daemon_kill", "garbage_line"):
            det = "— (no incident by design)"
        lines.append(f"| {k} | {v['n']} | {det} | {v['recover_median_s']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=40.0, help="seconds between faults")
    ap.add_argument("--minutes", type=float, default=5.0, help="duration of the chaos phase")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--results", default=None, help="append a 'Chaos (CPU)' section to this markdown file")
    ap.add_argument("--scenarios", choices=["store", "storage", "daemon"], default=None,
                    help="store: second daemon, store deleted, store corruption on one run (see main_store); "
                         "storage: disk full and read-only filesystem, one run each (see main_storage); "
                         "daemon: poison telemetry lines, unauthorized peer, daemon SIGSTOP (see main_daemon)")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ulyssesd-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.scenarios == "store":
        return main_store(work, args.results)
    if args.scenarios == "storage":
        return main_storage(work, args.results)
    if args.scenarios == "daemon":
        return main_daemon(work, args.results)
    res = Chaos(work, args.every, args.minutes).run()
    cmd = f"python bench/chaos.py --every {args.every:g} --minutes {args.minutes:g}"
    text = render(res, cmd)
    print(text)
    print(json.dumps(res, indent=1))
    if args.results:
        with open(args.results, "a") as fh:
            fh.write("\n## Chaos (CPU)\n\n" + text)
    return 0 if res["survived"] == res["faults"] else 1



# ------------------------------------------------------------------ store & single-instance scenarios (#13)
# Run with `--scenarios store` (one supervised run of the real 2-rank job, not the round-robin above):
#   second_daemon     while the daemon trains: remove its socket file and start a second daemon on the same
#                     state dir; then one with another state dir + socket path, the same database and
#                     `--run-id` of the live run. Each must exit 12 at once naming the holder; the job untouched.
#   store_deleted     delete ulyssesd.db (+ -wal/-shm) under the running daemon -> re-created from the open
#                     connection within a tick, `store_damaged` incident, nothing lost.
#   store_corruption  SIGKILL the daemon, overwrite the database with random bytes, start a new daemon ->
#                     newest backup restored, the run re-derived from its directory, the same job re-adopted.
# The run must then COMPLETE with every checkpoint still valid.
STORE_STEPS = 400


def _wait_for(pred, timeout: float, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return None


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - the store may be mid-recovery; try again
        return None


def run_store_scenarios(work: Path) -> dict:
    c = Chaos(work, every=0, minutes=0)
    # The tiny model's own loss noise sets off the loss ladder on long runs (a separate problem): a spike here
    # must double the loss for 5 steps, so the run measures store faults only.
    c.spec.write_text(SPEC.format(state=c.state, sock=c.sock).replace("steps = 100000", f"steps = {STORE_STEPS}")
                      .replace("[detectors]\n", "[detectors]\nloss_spike_min_rel = 1.0\nloss_spike_persist_steps = 5\n")
                      + "backup_every_s = 5.0\n")
    db = c.state / "ulyssesd.db"
    t0 = time.time()
    c.start_daemon()
    rd = _wait_for(c.run_dir, 120)
    assert rd is not None, f"no run dir; see {c.log}"
    cur = _wait_for(lambda: c.current_attempt_training(rd), 300)
    assert cur is not None, f"job never trained; see {c.log}"
    _wait_for(lambda: list((c.state / "backups").glob("ulyssesd-*.db")) and valid_tags(rd), 120)
    run_id = rd.name
    rows: dict[str, dict] = {}

    def step_after(t: float) -> float | None:
        later = [r["time"] for r in records(rd) if r.get("kind") == "step" and r.get("time", 0) > t]
        return later[0] - t if later else None

    # second daemon, same state dir, socket file removed
    attempts_before = len(c.store().list_attempts(run_id))
    os.unlink(c.sock)
    t = time.time()
    r1 = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(c.spec)],
                        capture_output=True, text=True, timeout=120)
    exit1 = time.time() - t
    # second daemon, another state dir and socket, the same database, --run-id of the live run
    other = work / "other"
    other.mkdir(exist_ok=True)
    spec2 = other / "run.toml"
    sock2 = Path(tempfile.mkdtemp(prefix="uls-chaos2-", dir="/tmp")) / "d.sock"
    spec2.write_text(SPEC.format(state=other / "state", sock=sock2) + f'db_path = "{db}"\n')
    t = time.time()
    r2 = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec2), "--run-id", run_id],
                        capture_output=True, text=True, timeout=120)
    exit2 = time.time() - t
    st = c.store()
    untouched = (len(st.list_attempts(run_id)) == attempts_before and st.get_run(run_id).state.value == "RUNNING"
                 and c.daemon is not None and c.daemon.poll() is None)
    rows["second_daemon"] = {
        "n": 2, "ok": r1.returncode == 12 and r2.returncode == 12 and untouched,
        "detect_s": round(max(exit1, exit2), 1), "recover_s": None,  # the job never stopped
        "detail": f"rc {r1.returncode} / {r2.returncode} in {exit1:.1f} s / {exit2:.1f} s; "
                  f"named pid {c.daemon.pid}: {str(c.daemon.pid) in r1.stderr and str(c.daemon.pid) in r2.stderr}; "
                  f"job untouched: {untouched}"}
    print(f"[{time.strftime('%H:%M:%S')}] second daemon: {rows['second_daemon']['detail']}", flush=True)
    print("   ", r1.stderr.strip().splitlines()[-1][:300], flush=True)

    # the database deleted under the running daemon
    t = time.time()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    inc = _wait_for(lambda: _try(lambda: [i for i in c.store().list_incidents(run_id, symptom="store_damaged")]), 60)
    rows["store_deleted"] = {"n": 1, "ok": bool(inc), "detect_s": round(inc[0].detected_at.timestamp() - t, 1) if inc else None,
                             "recover_s": _wait_for(lambda: step_after(t), 60),
                             "detail": "re-created from the open connection, no history lost" if inc else "no incident"}
    print(f"[{time.strftime('%H:%M:%S')}] store deleted: {rows['store_deleted']['detail']}", flush=True)

    # random bytes over the database's first 4 KiB under the running daemon: salvaged within a tick
    t = time.time()
    with open(db, "r+b") as fh:
        fh.write(os.urandom(4096))
    inc = _wait_for(lambda: _try(lambda: [i for i in c.store().list_incidents(run_id, symptom="store_damaged")
                                          if i.detected_at.timestamp() > t]), 60)
    rows["store_corruption_live"] = {
        "n": 1, "ok": bool(inc) and c.daemon.poll() is None,
        "detect_s": round(inc[0].detected_at.timestamp() - t, 1) if inc else None,
        "recover_s": _wait_for(lambda: step_after(t), 60),
        "detail": (inc[0].summary.split("; ", 1)[-1][:120] if inc else "no incident")}
    print(f"[{time.strftime('%H:%M:%S')}] store corruption (live): {rows['store_corruption_live']['detail']}", flush=True)

    # random bytes in the database while no daemon runs; the new daemon restores and re-adopts
    time.sleep(6.0)  # a backup that includes the deletion incident
    job_pid = c.store().list_attempts(run_id)[-1].pid
    assert c.daemon is not None
    c.daemon.send_signal(signal.SIGKILL)
    c.daemon.wait(10)
    size = db.stat().st_size
    with open(db, "r+b") as fh:
        fh.write(os.urandom(min(size, 64 * 1024)))
    t = time.time()
    c.start_daemon()
    inc2 = _wait_for(lambda: _try(lambda: [i for i in c.store().list_incidents(run_id, symptom="store_damaged")
                                           if i.detected_at.timestamp() > t]), 120)
    same_job = _try(lambda: c.store().list_attempts(run_id)[-1].pid == job_pid)
    rows["store_corruption"] = {"n": 1, "ok": bool(inc2) and bool(same_job),
                                "detect_s": round(inc2[0].detected_at.timestamp() - t, 1) if inc2 else None,
                                "recover_s": _wait_for(lambda: step_after(t), 120),
                                "detail": _recovery_detail(inc2[0].evidence if inc2 else None)
                                + f"; same job re-adopted: {same_job}"}
    print(f"[{time.strftime('%H:%M:%S')}] store corruption: {rows['store_corruption']['detail']}", flush=True)

    rc = c.daemon.wait(1200)
    st = c.store()
    run = st.get_run(run_id)
    ck = rd / "checkpoints"
    quarantined = [p.name for p in ck.iterdir() if ".corrupt-" in p.name] if ck.exists() else []
    return {"wall_s": time.time() - t0, "daemon_rc": rc, "final_state": run.state.value,
            "final_step": max((r["step"] for r in records(rd) if r.get("kind") == "step"), default=None),
            "attempts": len(st.list_attempts(run_id)), "lost_checkpoints": len(quarantined),
            "store_damaged_incidents": len(st.list_incidents(run_id, symptom="store_damaged")),
            "damaged_files_kept": sorted(p.name for p in c.state.glob("ulyssesd.db.damaged-*")),
            "load_avg_end": [round(x, 1) for x in os.getloadavg()], "rows": rows}


def _recovery_detail(ev: dict | None) -> str:
    if not ev:
        return "no store_damaged incident"
    cur = ev.get("telemetry_cursor") or {}
    return (f"restored {Path(ev.get('backup') or '?').name}; re-derived {len(ev.get('config_versions', []))} config "
            f"version(s), {len(ev.get('checkpoints', []))} checkpoint(s), {len(ev.get('attempts', []))} attempt(s), "
            f"telemetry cursor -> step {cur.get('last_step')}; damaged file kept")


def render_store_scenarios(res: dict, cmd: str) -> str:
    lines = [f"Command: `{cmd}` — {res['wall_s'] / 60:.1f} min wall, 2 CPU cores, real 2-rank job (torchrun, gloo, "
             f"ZeRO-3, Ulysses SP=2), {STORE_STEPS} steps; load average at the end {res['load_avg_end']}.", "",
             f"- final state: {res['final_state']} at step {res['final_step']} (daemon exit {res['daemon_rc']}) after "
             f"{res['attempts']} attempt(s); lost checkpoints: {res['lost_checkpoints']}; `store_damaged` incidents: "
             f"{res['store_damaged_incidents']}; damaged file kept as {res['damaged_files_kept']}", "",
             "| fault class | n | survived | detection (s) | recovery to next step (s) | what happened |",
             "|---|---|---|---|---|---|"]
    for k, v in res["rows"].items():
        rec = v["recover_s"]
        lines.append(f"| {k} | {v['n']} | {'yes' if v['ok'] else 'NO'} | {v['detect_s']} | "
                     f"{'—' if rec is None else round(rec, 1)} | {v['detail']} |")
    return "\n".join(lines) + "\n"


def main_store(work: Path, results: str | None) -> int:
    res = run_store_scenarios(work)
    text = render_store_scenarios(res, "python bench/chaos.py --scenarios store")
    print(text)
    print(json.dumps(res, indent=1, default=str))
    if results:
        with open(results, "a") as fh:
            fh.write("\n## Chaos (CPU): second daemon, store deleted, store corruption\n\n" + text)
    ok = res["final_state"] == "COMPLETED" and all(v["ok"] for v in res["rows"].values())
    return 0 if ok and res["lost_checkpoints"] == 0 else 1


# ------------------------------------------------------------------------ storage scenarios (#13)
# Run with `--scenarios storage`: two supervised runs of the real 2-rank job, one per fault.
#   disk_full     ENOSPC mid-save -> the daemon removes the half-written tag and makes room in the budget's order
#                 (docs/CHECKPOINT_DISK.md), resumes from the newest valid tag, the run COMPLETES.
#   read_only_fs  EROFS at a save -> a clear incident and a clean stop (FAILED "run directory is read-only"),
#                 nothing deleted.
# A real ENOSPC/EROFS needs a small or read-only mount (root; this box has ~80 GB free), so both use the job's
# own faults, which act inside the real save path: `disk_full` writes each file of the first save at or after
# `at_step` half-way, then raises OSError(ENOSPC), on every rank; `read_only_fs` raises OSError(EROFS) first.
STORAGE_STEPS, STORAGE_FAULT_STEP = 60, 35  # the save at step 40 fails; steps 10..30 were saved before it


def _storage_run(work: Path, fault: str) -> dict:
    """One supervised run with the storage fault; what the store and the run directory say afterwards."""
    from ulyssesd.daemon.store import open_store
    from ulyssesd.training.checkpoint import list_tags, validate_tag

    work.mkdir(parents=True, exist_ok=True)
    sock = Path(tempfile.mkdtemp(prefix="uls-chaos-", dir="/tmp")) / "d.sock"
    spec = work / "run.toml"
    spec.write_text(SPEC.format(state=work / "state", sock=sock).replace("steps = 100000", f"steps = {STORAGE_STEPS}")
                    + f'\n[[faults]]\nkind = "{fault}"\nat_step = {STORAGE_FAULT_STEP}\n')
    t0 = time.time()
    with open(work / "daemon.log", "ab") as log:
        proc = subprocess.run([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=900)
    st = open_store(work / "state" / "ulyssesd.db", readonly=True)
    run = st.latest_run()
    rd = Path(run.run_dir)
    recs = records(rd)
    failed = next((r for r in recs if r.get("event") == "checkpoint_save_failed"), None)
    incs = st.list_incidents(run.id)
    acts = [a for i in incs for a in st.list_actions(incident_id=i.id)]
    prune = next((a for a in acts if a.kind.value == "prune"), None)
    after = [r["time"] for r in recs if r.get("kind") == "step" and (r.get("attempt") or 0) >= 2]
    atts = st.list_attempts(run.id)
    ck = rd / "checkpoints"
    tags = list_tags(ck)
    return {"fault": fault, "daemon_rc": proc.returncode, "wall_s": round(time.time() - t0, 1),
            "final_state": run.state.value, "state_reason": run.state_reason,
            "final_step": max((r["step"] for r in recs if r.get("kind") == "step"), default=None),
            "attempts": len(atts), "resumed_from": [a.resumed_from for a in atts][1:],
            "errno": failed.get("errno") if failed else None,
            "incidents": [(i.symptom.value, i.status.value, i.summary[:200]) for i in incs],
            "detect_s": round(incs[0].detected_at.timestamp() - failed["time"], 1) if failed and incs else None,
            "recover_s": round(after[0] - failed["time"], 1) if failed and after else None,
            "pruned": prune.parameters.get("removed") if prune else [],
            "bytes_freed": prune.parameters.get("bytes_freed") if prune else 0,
            "tags_left": tags, "tags_left_valid": [t for t in tags if validate_tag(ck / t, True)[0]],
            "quarantined": sorted(p.name for p in ck.iterdir() if ".corrupt-" in p.name) if ck.exists() else [],
            "load_avg_end": [round(x, 1) for x in os.getloadavg()]}


def scenario_disk_full(work: Path) -> dict:
    res = _storage_run(work, "disk_full")
    res["ok"] = (res["final_state"] == "COMPLETED" and res["resumed_from"][:1] == ["step-00000030"]
                 and res["errno"] == "ENOSPC" and not res["quarantined"])
    return res


def scenario_read_only_fs(work: Path) -> dict:
    res = _storage_run(work, "read_only_fs")
    res["ok"] = (res["final_state"] == "FAILED" and "read-only" in (res["state_reason"] or "")
                 and res["errno"] == "EROFS" and res["attempts"] == 1 and not res["pruned"]
                 and res["tags_left_valid"] == ["step-00000010", "step-00000020", "step-00000030"])
    return res


def render_storage(rows: list[dict], cmd: str) -> str:
    lines = [f"Command: `{cmd}` — real 2-rank job (torchrun, gloo, ZeRO-3, Ulysses SP=2), {STORAGE_STEPS} steps, "
             f"a checkpoint every 10, the fault at the first save at or after step {STORAGE_FAULT_STEP}; "
             f"faults from the job's own `[[faults]]` (no root for a real full/read-only mount).", "",
             "| fault class | n | survived | detection (s) | recovery to next step (s) | what happened |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        rec = r["recover_s"] if r["fault"] == "disk_full" else "— (clean stop by design)"
        what = (f"{r['errno']}; pruned {', '.join(r['pruned']) or 'nothing'} ({r['bytes_freed']} bytes); "
                f"resumed from {', '.join(str(x) for x in r['resumed_from']) or '—'}; {r['final_state']} at step "
                f"{r['final_step']} after {r['attempts']} attempt(s); valid tags left {', '.join(r['tags_left_valid'])}")
        if r["fault"] == "read_only_fs":
            what += f"; reason: {(r['state_reason'] or '')[:90]}"
        lines.append(f"| {r['fault']} | 1 | {'yes' if r['ok'] else 'NO'} | {r['detect_s']} | {rec} | {what} |")
    lines.append(f"\nwall {sum(r['wall_s'] for r in rows) / 60:.1f} min for both; load average at the end "
                 f"{rows[-1]['load_avg_end']}; {time.strftime('%Y-%m-%d', time.gmtime())}.")
    return "\n".join(lines) + "\n"


def main_storage(work: Path, results: str | None) -> int:
    rows = [scenario_disk_full(work / "disk_full"), scenario_read_only_fs(work / "read_only_fs")]
    text = render_storage(rows, "python bench/chaos.py --scenarios storage")
    print(text)
    print(json.dumps(rows, indent=1, default=str))
    if results:
        with open(results, "a") as fh:
            fh.write("\n## Chaos (CPU): disk full, read-only file system\n\n" + text)
    return 0 if all(r["ok"] for r in rows) else 1


# ------------------------------------------------------------------ daemon-side hostile inputs (#13)
# Run with `--scenarios daemon`: one supervised run of the real 2-rank job.
#   poison_lines       append a step over 64 bits, 50,000-deep JSON and a 5 MiB line to telemetry.jsonl ->
#                      counted and skipped; the cursor moves past them; no incident, the daemon lives.
#   unauthorized_peer  a deep, oversized request from uid 65534 (socket mode opened up, so only the daemon's
#                      peer check stands in the way) -> permission_denied before parsing; the daemon lives.
#   daemon_sigstop     SIGSTOP the daemon for longer than the hang floor; meanwhile `ulyssesctl status` and
#                      `pause` -> exit 7 "not responding", the pause "not applied"; SIGCONT -> the daemon catches
#                      up on the telemetry, the pause is never carried out, no false hang.
DAEMON_STEPS, SIGSTOP_S = 400, 20.0


def _cursor(c: Chaos, run_id: str) -> tuple[int, int]:
    cur = _try(lambda: c.store().get_telemetry_cursor(run_id))
    return (cur.last_step or -1, cur.offset) if cur else (-1, -1)


def _job_step(rd: Path) -> int:
    """The job's newest step (the poison line's step over 64 bits is not the job's)."""
    return max((r["step"] for r in records(rd) if r.get("kind") == "step" and isinstance(r.get("step"), int)
                and r["step"] < 1 << 40), default=-1)


def _as_nobody(sock: Path, payload: bytes) -> bytes:
    """Send `payload` from a child that dropped to uid/gid 65534; the daemon's answer (b"" if it hung up)."""
    import socket as _socket

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = b""
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(sock))
            try:
                s.sendall(payload)
            except OSError:
                pass
            try:
                out = s.recv(65536)
            except OSError:
                out = b""
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = f"<child error {exc!r}>".encode()
        finally:
            os.write(w, out or b"<closed>")
            os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 65536):
        got += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return b"" if got == b"<closed>" else got


def run_daemon_scenarios(work: Path) -> dict:
    c = Chaos(work, every=0, minutes=0)
    # configs/tiny-cpu.toml's calibration for the tiny model's own loss noise and this shared box's step times
    c.spec.write_text(SPEC.format(state=c.state, sock=c.sock).replace("steps = 100000", f"steps = {DAEMON_STEPS}")
                      .replace("[detectors]\n", "[detectors]\nloss_spike_min_rel = 1.0\nloss_spike_persist_steps = 5\n"
                                                 "slow_step_ratio = 5.0\nslow_step_min_consecutive = 5\n"))
    t0 = time.time()
    c.start_daemon()
    rd = _wait_for(c.run_dir, 120)
    assert rd is not None, f"no run dir; see {c.log}"
    assert _wait_for(lambda: c.current_attempt_training(rd), 300), f"job never trained; see {c.log}"
    run_id = rd.name
    rows: dict[str, dict] = {}
    incidents_before = len(c.store().list_incidents(run_id))

    # poison telemetry lines
    t = time.time()
    with open(rd / "telemetry.jsonl", "ab") as fh:
        fh.write(b'{"v":1,"kind":"step","time":1.0,"attempt":1,"step":%d,"loss":1.0}\n' % (2 ** 64 + 5))
        fh.write(b'{"v":1,"kind":"event","event":"x","step":1,"deep":' + b"[" * 50_000 + b"]" * 50_000 + b"}\n")
        fh.write(b'{"v":1,"kind":"step","pad":"' + b"x" * (5 << 20) + b'"}\n')
        end = fh.tell()
    passed = _wait_for(lambda: _cursor(c, run_id)[1] > end and time.time(), 60, poll=0.2)
    alive = c.daemon is not None and c.daemon.poll() is None
    rows["poison_lines"] = {"n": 3, "ok": bool(passed) and alive, "detect_s": round(passed - t, 1) if passed else None,
                            "recover_s": None, "detail": f"cursor past the 5 MiB line: {bool(passed)}; daemon alive: {alive}"}
    print(f"[{time.strftime('%H:%M:%S')}] poison lines: {rows['poison_lines']['detail']}", flush=True)

    # unauthorized peer with a deep, oversized request
    modes = (c.sock.parent.stat().st_mode & 0o7777, c.sock.stat().st_mode & 0o7777)
    os.chmod(c.sock.parent, 0o755)
    os.chmod(c.sock, 0o666)
    try:
        t = time.time()
        ans = _as_nobody(c.sock, b'{"cmd":"stop","args":' + b"[" * 30_000 + b"]" * 30_000 + b"}\n")
        took = time.time() - t
    finally:
        os.chmod(c.sock.parent, modes[0])
        os.chmod(c.sock, modes[1])
    refused = ans == b"" or b"permission_denied" in ans
    alive = c.daemon.poll() is None
    rows["unauthorized_peer"] = {"n": 1, "ok": refused and alive, "detect_s": round(took, 2), "recover_s": None,
                                 "detail": f"answer {ans[:80]!r}; daemon alive: {alive}"}
    print(f"[{time.strftime('%H:%M:%S')}] unauthorized peer: {rows['unauthorized_peer']['detail']}", flush=True)

    # SIGSTOP of the daemon, longer than the hang floor
    ctl = [sys.executable, "-m", "ulyssesd.daemon.operator.ctl", "--state-dir", str(c.state), "--socket", str(c.sock)]
    c.daemon.send_signal(signal.SIGSTOP)
    t = time.time()
    try:
        st = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=60)
        status_s = time.time() - t
        pz = subprocess.run([*ctl, "pause"], capture_output=True, text=True, timeout=60)
        time.sleep(max(0.0, SIGSTOP_S - (time.time() - t)))
        job_step_at_cont = _job_step(rd)
    finally:
        c.daemon.send_signal(signal.SIGCONT)
    t_cont = time.time()
    caught_up = _wait_for(lambda: _cursor(c, run_id)[0] >= job_step_at_cont and time.time(), 60, poll=0.2)
    time.sleep(3.0)
    st_after = c.store()
    paused = [x for x in st_after.list_transitions(run_id) if x.to_state.value == "PAUSED"]
    hangs = st_after.list_incidents(run_id, symptom="hang")
    ok = (st.returncode == 7 and pz.returncode == 7 and "not applied" in (pz.stdout + pz.stderr) and not paused
          and not hangs and bool(caught_up))
    rows["daemon_sigstop"] = {
        "n": 1, "ok": ok, "detect_s": round(status_s, 1),
        "recover_s": round(caught_up - t_cont, 1) if caught_up else None,
        "detail": f"{SIGSTOP_S:g} s stopped; status rc {st.returncode}, pause rc {pz.returncode} (not applied: "
                  f"{'not applied' in (pz.stdout + pz.stderr)}); after SIGCONT: PAUSED transitions {len(paused)}, "
                  f"hang incidents {len(hangs)}, telemetry caught up: {bool(caught_up)}"}
    print(f"[{time.strftime('%H:%M:%S')}] daemon SIGSTOP: {rows['daemon_sigstop']['detail']}", flush=True)

    rc = c.daemon.wait(1800)
    st = c.store()
    run = st.get_run(run_id)
    ck = rd / "checkpoints"
    quarantined = [p.name for p in ck.iterdir() if ".corrupt-" in p.name] if ck.exists() else []
    new_incidents = [(i.symptom.value, i.summary[:120]) for i in st.list_incidents(run_id)][incidents_before:]
    return {"wall_s": time.time() - t0, "daemon_rc": rc, "final_state": run.state.value,
            "final_step": _job_step(rd), "attempts": len(st.list_attempts(run_id)), "lost_checkpoints": len(quarantined),
            "incidents_after_first_input": new_incidents,
            "load_avg_end": [round(x, 1) for x in os.getloadavg()], "rows": rows}


def render_daemon_scenarios(res: dict, cmd: str) -> str:
    lines = [f"Command: `{cmd}` — {res['wall_s'] / 60:.1f} min wall, 2 CPU cores, real 2-rank job (torchrun, gloo, "
             f"ZeRO-3, Ulysses SP=2), {DAEMON_STEPS} steps; load average at the end {res['load_avg_end']}; "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}.", "",
             f"- final state: {res['final_state']} at step {res['final_step']} (daemon exit {res['daemon_rc']}) after "
             f"{res['attempts']} attempt(s); lost checkpoints: {res['lost_checkpoints']}; incidents recorded after "
             f"the first hostile input: {res['incidents_after_first_input'] or 'none'}", "",
             "| fault class | n | survived | detection (s) | recovery (s) | what happened |", "|---|---|---|---|---|---|"]
    for k, v in res["rows"].items():
        rec = v["recover_s"]
        lines.append(f"| {k} | {v['n']} | {'yes' if v['ok'] else 'NO'} | {v['detect_s']} | "
                     f"{'—' if rec is None else rec} | {v['detail']} |")
    lines.append("\ndetection = poison_lines: until the stored cursor passed the last poison line; unauthorized_peer: "
                 "until the refusal; daemon_sigstop: `ulyssesctl status` until it said not responding. recovery = "
                 "daemon_sigstop: SIGCONT until the stored cursor reached the job's step at SIGCONT.")
    return "\n".join(lines) + "\n"


def main_daemon(work: Path, results: str | None) -> int:
    res = run_daemon_scenarios(work)
    text = render_daemon_scenarios(res, "python bench/chaos.py --scenarios daemon")
    print(text)
    print(json.dumps(res, indent=1, default=str))
    if results:
        with open(results, "a") as fh:
            fh.write("\n## Chaos (CPU): poison telemetry, unauthorized peer, daemon SIGSTOP\n\n" + text)
    ok = res["final_state"] == "COMPLETED" and all(v["ok"] for v in res["rows"].values())
    return 0 if ok and res["lost_checkpoints"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
