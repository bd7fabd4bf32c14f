"""Issue 21 on one GPU: asynchronous checkpoints, a SIGKILL during a background write, MTTR and a hang.

Phases (each writes raw files under --out; `--analyze` recomputes the figures offline from them):
- `disk`: free space, the disk's sequential write speed (`dd oflag=direct`, the figure the background write is
  held against) and a buffered `dd conv=fsync`, in the directory the checkpoints go to; then a probe in a
  child process: pinned host allocation (first and reused), device->host copy speed, the writer's
  `write_shard` with and without flush-behind, sha256 speed.
- `sync`: the bare job (torchrun, one rank) with one synchronous save: the time a save stops training.
- `faults`: the same job under `ulyssesd run` with `[checkpoint] async_save = true`: saves every K steps;
  the rank is SIGKILLed while the save at KILL_AT is being written in the background (the previous tag must
  be what the next attempt loads), MTTR split from the store, telemetry and the attempt log; on the next
  attempt the rank hangs before HANG_AT (detection after the last step).

    python bench/gpu_ckpt21.py --out $OUT/ckpt [--phases disk,sync,faults] [--preset gpt-1b --seq 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_common import rank_pids
from bench_common import read_records as records
from daemon_run import (
    DAEMON_TOML,
    dump_store,
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

JOB = job_toml_head(sp=1, ckpt="activation_checkpoint_every = 1") + """\
[checkpoint]
interval_steps = {interval}
keep_last = {keep}
save_at_end = false
async_save = {async_save}
"""

PROBE = r"""
import hashlib, json, os, sys, time, torch
from ulyssesd.training.checkpoint import write_shard
d, gib = sys.argv[1], int(sys.argv[2])
n = gib << 30
res = {"gib": gib}
dev = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
torch.cuda.synchronize()
t0 = time.perf_counter(); a = torch.empty(n, dtype=torch.uint8, pin_memory=True); res["pinned_alloc_first_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); a.copy_(dev, non_blocking=True); torch.cuda.synchronize(); res["d2h_pinned_GBps"] = n / 1e9 / (time.perf_counter() - t0)
del a
t0 = time.perf_counter(); a = torch.empty(n, dtype=torch.uint8, pin_memory=True); res["pinned_alloc_reuse_s"] = time.perf_counter() - t0
a.copy_(dev); torch.cuda.synchronize()
t0 = time.perf_counter(); b = torch.empty(n, dtype=torch.uint8); b.copy_(dev); res["d2h_pageable_GBps"] = n / 1e9 / (time.perf_counter() - t0)
del b
t0 = time.perf_counter(); hashlib.sha256(memoryview(a.numpy())).hexdigest(); res["sha256_GBps"] = n / 1e9 / (time.perf_counter() - t0)
for fb in (True, False):
    p = os.path.join(d, f"probe-{fb}.pt")
    t0 = time.perf_counter(); size, _ = write_shard({"x": a}, p, flush_behind=fb); s = time.perf_counter() - t0
    res[f"write_shard_flush_behind_{fb}_GBps"] = size / 1e9 / s
    os.unlink(p)
t0 = time.perf_counter(); torch.save({"x": a}, os.path.join(d, "probe-plain.pt")); fd = os.open(os.path.join(d, "probe-plain.pt"), os.O_RDONLY); os.fsync(fd); os.close(fd)
res["torch_save_path_crc_fsync_GBps"] = n / 1e9 / (time.perf_counter() - t0)
os.unlink(os.path.join(d, "probe-plain.pt"))
print(json.dumps(res))
"""


def sh(cmd: str, timeout: float = 120) -> str:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
    return (p.stdout + p.stderr).strip()


def run_probe(a, work: Path) -> dict:
    try:
        p = subprocess.run([sys.executable, "-c", PROBE, str(work), str(a.probe_gib)], capture_output=True, text=True,
                           timeout=240)
        return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-2000:]}
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"error": repr(exc)}


def phase_disk(a, work: Path, out: Path) -> None:
    res: dict = {"df": sh(f"df -B1 --output=size,avail,target {work} | tail -1"),
                 "mount": sh(f"findmnt -n -T {work} -o SOURCE,FSTYPE,OPTIONS"),
                 "dirty": sh("sysctl vm.dirty_ratio vm.dirty_background_ratio vm.dirty_bytes vm.dirty_background_bytes"),
                 "cpu": sh("lscpu | grep -E 'Model name|^CPU\\(s\\)'"), "mem": sh("free -g | head -2")}
    f = work / "dd.bin"
    for name, flags in (("dd_direct", "oflag=direct"), ("dd_buffered_fsync", "conv=fsync")):
        t0 = time.time()
        txt = sh(f"dd if=/dev/zero of={f} bs=64M count={a.dd_gib * 16} {flags} 2>&1", timeout=300)
        res[name] = {"seconds": round(time.time() - t0, 2), "GBps": round(a.dd_gib * (1 << 30) / 1e9 / (time.time() - t0), 3),
                     "dd": txt.splitlines()[-1] if txt else ""}
        f.unlink(missing_ok=True)
    res["probe"] = run_probe(a, work) if a.device == "cuda" and a.probe_gib > 0 else {"skipped": "no GPU or --probe-gib 0"}
    (out / "disk.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)


def phase_sync(a, work: Path, out: Path, name: str = "sync", async_save: bool = False) -> None:
    """The bare job (no daemon): `sync` saves synchronously; `bare_async` saves asynchronously (steady state:
    the saves after the first reuse the writer's pinned buffers)."""
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    spec = d / "spec.toml"
    steps, interval = (a.async_steps, a.async_interval) if async_save else (a.sync_steps, a.sync_interval)
    spec.write_text(JOB.format(preset=a.preset, dtype=a.dtype, seq=a.seq, device=a.device, steps=steps,
                               interval=interval, keep=1, async_save=str(async_save).lower()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "ulyssesd.training", "--spec", str(spec), "--run-dir", str(d), "--attempt", "1"]
    with open(d / "log.txt", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=a.sync_timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
    shutil.copy(d / "telemetry.jsonl", out / f"{name}_telemetry.jsonl") if (d / "telemetry.jsonl").exists() else None
    text = (d / "log.txt").read_text(errors="replace")
    (out / f"{name}_log.txt").write_text(text[:20000] + "\n...\n" + text[-8000:])
    shutil.rmtree(d / "checkpoints", ignore_errors=True)   # the disk is small: the faults run needs the room


def phase_faults(a, work: Path, out: Path, timeout: float, name: str = "faults", standby: bool = False) -> dict:
    state = work / f"state-{name}"
    shutil.rmtree(state, ignore_errors=True)
    sock = new_socket_path()
    spec = work / f"{name}.toml"
    faults = f'\n[[faults]]\nkind = "hang"\nat_step = {a.hang_at}\nrank = 0\nattempts = [2]\n' if a.hang_at else ""
    restart = "[restart]\nstandby = true\n" if standby else ""
    if standby and "nopreload" in name:   # the warm process alone: the checkpoint is read from disk as cold
        restart += "standby_preload = false\n"
    spec.write_text(DAEMON_TOML.format(name=name, nproc=1, state=state, sock=sock, hang_floor=a.hang_floor) + restart
                    + JOB.format(preset=a.preset, dtype=a.dtype, seq=a.seq, device=a.device, steps=a.steps,
                                 interval=a.interval, keep=2, async_save="true") + faults)
    t0 = time.time()
    proc = start_daemon(spec, out / f"{name}_daemon.log")
    ev: dict = {"daemon_started": t0}
    try:
        while time.time() - t0 < timeout and proc.poll() is None:
            time.sleep(0.1)
            rd = run_dir_of(state)
            if rd is None:
                continue
            if "sigkill_time" in ev:
                if a.stop_at and stop_reached(a.stop_at, rd, ev, state / "ulyssesd.db"):
                    break   # enough measured: the finally below ends the daemon and its ranks (no final save)
                continue
            recs = records(rd / "telemetry.jsonl")
            saving = [r for r in recs if r.get("event") == "checkpoint_saving" and r.get("attempt") == 1
                      and r.get("step", 0) >= a.kill_at]
            if not saving:
                continue
            s = saving[0]["step"]
            after = [r for r in recs if r.get("kind") == "step" and r.get("attempt") == 1 and r["step"] > s]
            if not after:
                continue   # the snapshot is still being taken: training has not resumed yet
            if a.kill_when == "committed" and not kill_ready_committed(a, rd, recs, saving[0], ev, standby):
                continue   # wait for the manifest (and a standby's preload of it): no write in flight at the kill
            if "snapshot_done_seen" not in ev:
                ev["snapshot_done_seen"] = time.time()
            if time.time() - ev["snapshot_done_seen"] < a.kill_delay:
                continue
            tag_dir = rd / "checkpoints" / f"step-{s:08d}"
            listing = {p.name: p.stat().st_size for p in tag_dir.iterdir()} if tag_dir.is_dir() else {}
            ranks = dict(training_rank_pids(rd))
            if 0 in ranks:
                os.kill(ranks[0], signal.SIGKILL)
                ev.update(sigkill_time=time.time(), sigkill_after_step=after[-1]["step"], sigkill_pid=ranks[0],
                          killed_during_save_of=s, tag_dir_at_kill=listing,
                          manifest_at_kill=(tag_dir / "manifest.json").exists())
    finally:
        if proc.poll() is None:
            ev["daemon_timeout" if "stopped_at" not in ev else "daemon_stopped_by_bench"] = True
            end_daemon(proc, state)
    ev["daemon_exit"], ev["wall_s"] = proc.returncode, time.time() - t0
    rd = run_dir_of(state)
    if rd is not None:
        save_telemetry(rd, out, name)
        save_logs(rd, out, name, tail=10000, head=30000)
        ck = rd / "checkpoints"
        ev["checkpoint_dirs"] = {p.name: sorted(q.name for q in p.iterdir()) for p in ck.iterdir() if p.is_dir()} \
            if ck.exists() else {}
    save_store_and_events(state, out, name, ev)
    shutil.rmtree(state, ignore_errors=True)
    return ev


def stop_reached(stop_at: str, rd: Path, ev: dict, db: Path) -> bool:
    """`--stop-at A:N`: attempt A has N step records; `--stop-at hang`: the store holds a hang incident (the
    run is then ended by the bench, not completed)."""
    if stop_at == "hang":
        try:
            incs = dump_store(db).get("incidents")
        except Exception:  # noqa: BLE001 - the store is being written: look again at the next poll
            return False
        if isinstance(incs, list) and any(isinstance(i, dict) and i.get("symptom") == "hang" for i in incs):
            ev["stopped_at"] = {"hang_incident": True, "time": time.time()}
            return True
        return False
    att, n = (int(x) for x in stop_at.split(":"))
    got = sum(1 for r in records(rd / "telemetry.jsonl") if r.get("kind") == "step" and r.get("attempt") == att)
    if got >= n:
        ev["stopped_at"] = {"attempt": att, "steps": got, "time": time.time()}
        return True
    return False


def kill_ready_committed(a, rd: Path, recs: list[dict], saving: dict, ev: dict, standby: bool) -> bool:
    """`--kill-when committed`: `latest` names a durable tag at or after that save's step (a later save may be in
    flight) and, with a warm standby, the standby's ready file shows exactly that tag preloaded, so the restart
    loads what the standby holds (bounded by --preload-wait after the first commit seen; past it, kill anyway)."""
    try:
        latest = (rd / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return False
    if not latest.startswith("step-") or int(latest[5:]) < saving["step"]:
        return False
    ev.setdefault("tag_committed_seen", time.time())
    ev["latest_at_kill"] = latest
    if not standby:
        return True
    ready = rd / "standby" / "attempt-2-rank-0.ready"
    try:
        data = json.loads(ready.read_text())
    except (OSError, ValueError):
        data = {}
    ev["standby_ready_at_kill"] = {k: data.get(k) for k in ("time", "warm_s", "preloaded", "preloaded_bytes",
                                                           "max_rss_kib")}
    if data.get("preloaded") == latest:
        ev.setdefault("standby_preloaded_seen", time.time())
        return True
    if time.time() - ev["tag_committed_seen"] > a.preload_wait:
        ev["standby_preload_wait_expired"] = True
        return True
    return False


def training_rank_pids(run_dir: Path) -> list[tuple[int, int]]:
    """rank_pids without a warm standby's ranks (they wait at a gate: `--standby-gate` in their command)."""
    import psutil

    out = []
    for rank, pid in rank_pids(run_dir):
        try:
            if "--standby-gate" not in " ".join(psutil.Process(pid).cmdline()):
                out.append((rank, pid))
        except psutil.Error:
            continue
    return out


# ------------------------------------------------------------------------------------------- analysis
def _steps(recs: list[dict], attempt: int | None = None) -> list[dict]:
    return [r for r in recs if r.get("kind") == "step" and (attempt is None or r.get("attempt") == attempt)]


def blocked_by_intervals(recs: list[dict], attempt: int | None, saved_step: int) -> dict | None:
    """The save after step s stands between the records of steps s and s+1: that interval minus the median
    step interval is the time training stood still (whatever the job's own counter says)."""
    st = {r["step"]: r["time"] for r in _steps(recs, attempt)}
    iv = [st[k + 1] - st[k] for k in sorted(st) if k + 1 in st and k > min(st) + 2]
    if saved_step not in st or saved_step + 1 not in st or len(iv) < 3:
        return None
    med = statistics.median(iv)
    around = st[saved_step + 1] - st[saved_step]
    return {"interval_s": round(around, 3), "median_step_s": round(med, 4), "blocked_s": round(around - med, 3)}


def log_times(path: Path) -> dict:
    """Timestamps (epoch, UTC) of the attempt log's milestones: the first job log line, DeepSpeed's
    process-group start, DeepSpeed's engine init, the checkpoint load start."""
    pat = re.compile(r"\[?(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3})\]?")
    marks = {"first_line": None, "init_distributed": r"init_distributed|Initializing TorchBackend",
             "deepspeed_info": r"DeepSpeed info", "zero3_ready": r"Stage 3|stage 3|DeepSpeedZeRoOffload",
             "engine_ready": r"DeepSpeedEngine configuration|world_size|\[config\.py", "load": r"[Ll]oading.*checkpoint"}
    found: dict = {}
    if not path.exists():
        return found
    for line in path.read_text(errors="replace").splitlines():
        m = pat.search(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc).timestamp()
        for k, rx in marks.items():
            if k not in found and (rx is None or re.search(rx, line)):
                found[k] = {"t": t, "line": line[:160]}
    return found


def analyze(a, out: Path) -> dict:
    res: dict = {}
    analyze_disk_sync(out, res)
    for name in sorted({p.name[:-len("_events.json")] for p in out.glob("*_events.json")}):   # supervised runs
        res[name] = analyze_run(out, name, res)
    return res


def analyze_run(out: Path, name: str, res: dict) -> dict:
    """One supervised run's figures (files {name}_*); `res` holds the disk figures already read."""
    dd = (res.get("disk") or {}).get("dd_direct", {}).get("GBps")
    run: dict = {}
    recs = records(out / f"{name}_telemetry.jsonl")
    if not recs:
        return run
    ev = json.loads((out / f"{name}_events.json").read_text())
    store = json.loads((out / f"{name}_store.json").read_text()) if (out / f"{name}_store.json").exists() else {}
    return _analyze_faults(out, name, recs, ev, store, dd, run)


def analyze_disk_sync(out: Path, res: dict) -> None:
    if (out / "disk.json").exists():
        res["disk"] = json.loads((out / "disk.json").read_text())
    bare = records(out / "bare_async_telemetry.jsonl")
    if bare:
        dd = (res.get("disk") or {}).get("dd_direct", {}).get("GBps")
        rows = []
        for r in (r for r in bare if r.get("event") == "checkpoint_saved"):
            wb, ws = r.get("write_bytes") or 0, r.get("write_seconds") or 0
            rows.append({"tag": r["tag"], "blocked_seconds_job": r.get("blocked_seconds"),
                         "by_step_intervals": blocked_by_intervals(bare, None, r["step"]), "write_seconds": ws,
                         "write_GBps": round(wb / 1e9 / ws, 3) if ws else None,
                         "write_vs_dd_direct": round(wb / 1e9 / ws / dd, 3) if ws and dd else None,
                         "host_alloc_GB": round((r.get("host_buffer_alloc_bytes") or 0) / 1e9, 2),
                         "device_staged_GB": round((r.get("device_staged_bytes") or 0) / 1e9, 2),
                         "saved_event": {k: v for k, v in r.items() if k not in ("v", "kind", "event", "tag")}})
        res["bare_async"] = rows
        res["bare_async_snapshot_pool_ready"] = [{k: v for k, v in r.items() if k not in ("v", "kind")}
                                                 for r in bare if r.get("event") == "snapshot_pool_ready"]
    sync = records(out / "sync_telemetry.jsonl")
    if sync:
        saves = [r for r in sync if r.get("event") == "checkpoint_saved"]
        res["sync"] = [{"tag": r["tag"], "seconds": r["seconds"], "GB": round(r["bytes"] / 1e9, 2),
                        "GBps": round(r["bytes"] / 1e9 / r["seconds"], 3),
                        "by_step_intervals": blocked_by_intervals(sync, None, r["step"])} for r in saves]


def _analyze_faults(out: Path, name: str, recs: list[dict], ev: dict, store: dict, dd: float | None,
                    res: dict) -> dict:
    atts = {x["number"]: x for x in store.get("attempts", []) if isinstance(x, dict)}
    incs = [i for i in store.get("incidents", []) if isinstance(i, dict)]
    saving = [r for r in recs if r.get("event") == "checkpoint_saving"]
    saved = {(r.get("attempt"), r["tag"]): r for r in recs if r.get("event") == "checkpoint_saved"}
    rows = []
    for s in saving:
        att, step = s.get("attempt"), s["step"]
        r = saved.get((att, s["tag"]))
        row = {"attempt": att, "tag": s["tag"], "by_step_intervals": blocked_by_intervals(recs, att, step)}
        if r:
            wb, ws = r.get("write_bytes") or r.get("bytes"), r.get("write_seconds")
            row.update(blocked_seconds_job=r.get("blocked_seconds"), write_seconds=ws,
                       commit_seconds=r.get("commit_seconds"), GB=round((r.get("bytes") or 0) / 1e9, 2),
                       host_alloc_GB=round((r.get("host_buffer_alloc_bytes") or 0) / 1e9, 2),
                       saved_event={k: v for k, v in r.items() if k not in ("v", "kind", "event", "tag")})
            if ws:
                row["write_GBps"] = round(wb / 1e9 / ws, 3)
                row["write_vs_dd_direct"] = round(wb / 1e9 / ws / dd, 3) if dd else None
                to_commit = ws + (r.get("commit_seconds") or 0)
                row["durable_GBps_incl_commit"] = round(wb / 1e9 / to_commit, 3)
        else:
            row["note"] = "no checkpoint_saved (killed mid-write, or the run ended first)"
        rows.append(row)
    res["async_saves"] = rows
    res["snapshot_pool_ready"] = [{k: v for k, v in r.items() if k not in ("v", "kind")} for r in recs
                                  if r.get("event") == "snapshot_pool_ready"]
    # Step time while a background write runs vs. outside (attempt 1, the saves' windows from the job's events).
    st = _steps(recs, 1)
    if st:
        iv = {b["step"]: b["time"] - a_["time"] for a_, b in zip(st, st[1:], strict=False) if b["step"] == a_["step"] + 1}
        res["step_interval_median_s_attempt1"] = round(statistics.median(list(iv.values())[3:] or [0]), 4)
    loaded = {r["attempt"]: r for r in recs if r.get("event") == "checkpoint_loaded"}
    started = {}
    first = {}
    for r in recs:
        if r.get("event") == "started":
            started.setdefault(r["attempt"], r)
        if r.get("kind") == "step":
            first.setdefault(r["attempt"], r)
    kill = ev.get("sigkill_time")
    if kill and 2 in atts:
        a1, a2 = atts.get(1, {}), atts[2]
        # The incident of the kill (not an earlier one of the same attempt, e.g. a slow step).
        inc = next((i for i in incs if i["attempt"] == 1 and (epoch_of(i["detected_at"]) or 0) >= kill - 0.5), None)
        t_det = epoch_of(inc["detected_at"]) if inc else None
        t_end1, t_launch2 = epoch_of(a1.get("ended_at")), epoch_of(a2.get("started_at"))
        m = {"killed_during_save_of": ev.get("killed_during_save_of"), "killed_after_step": ev.get("sigkill_after_step"),
             "tag_dir_at_kill": ev.get("tag_dir_at_kill"), "manifest_at_kill": ev.get("manifest_at_kill"),
             "attempt2_loaded": loaded.get(2, {}).get("tag"),
             "detection_s": None if t_det is None else round(t_det - kill, 2),
             "teardown_s": None if t_end1 is None else round(t_end1 - (t_det or kill), 2),
             "launch_gap_s": None if t_launch2 is None or t_end1 is None else round(t_launch2 - t_end1, 2)}
        lg = log_times(out / f"{name}_attempt-2.log_headtail.txt")
        m["log_marks"] = {k: {"after_launch_s": round(v["t"] - t_launch2, 2) if t_launch2 else None, "line": v["line"]}
                          for k, v in lg.items()}
        st2, ld2, fs2 = started.get(2), loaded.get(2), first.get(2)
        if st2 and t_launch2:
            load_s = ld2["seconds"] if ld2 else 0.0
            m["start_to_loaded_s"] = round(st2["time"] - load_s - t_launch2, 2)
            m["checkpoint_load_s"] = load_s
        if fs2 and st2:
            m["first_step_s"] = round(fs2["time"] - st2["time"], 2)
        if fs2:
            m["mttr_s"] = round(fs2["time"] - kill, 2)
            m["resumed_at_step"] = fs2["step"]
        m["incident"] = None if inc is None else {"symptom": inc["symptom"], "summary": inc["summary"][:300]}
        su = (st2 or {}).get("startup") or {}
        if su.get("process_started_at"):   # the job's own start-up marks, as seconds after the kill
            m["startup_after_kill_s"] = {k: round(su["process_started_at"] + v - kill, 2) for k, v in su.items()
                                         if k != "process_started_at" and isinstance(v, (int, float))}
            m["startup"] = su
        for k in ("standby_ready_at_kill", "standby_preload_wait_expired", "tag_committed_seen"):
            if k in ev:
                m[k] = ev[k]
        m["attempt2_launched_after_kill_s"] = None if t_launch2 is None else round(t_launch2 - kill, 2)
        preload_used = [r for r in recs if r.get("attempt") == 2 and str(r.get("event", "")).startswith("standby")]
        m["standby_events_attempt2"] = [{k: v for k, v in r.items() if k not in ("v", "kind")} for r in preload_used][:5]
        res["mttr_sigkill"] = m
    hang = [i for i in incs if i["symptom"] == "hang"]
    if hang:
        h = hang[0]
        att = h["attempt"]
        last = _steps(recs, att)[-1] if _steps(recs, att) else None
        t_det = epoch_of(h["detected_at"])
        nxt = first.get(att + 1)
        res["hang"] = {"attempt": att, "last_step": None if last is None else last["step"],
                       "detected_after_last_step_s": None if last is None or t_det is None else round(t_det - last["time"], 2),
                       "summary": h["summary"][:300],
                       "first_step_after_detection_s": None if nxt is None or t_det is None else round(nxt["time"] - t_det, 2),
                       "next_attempt_loaded": loaded.get(att + 1, {}).get("tag")}
    res["final"] = {"run_state": [r.get("state") for r in store.get("runs", []) if isinstance(r, dict)],
                    "daemon_exit": ev.get("daemon_exit"), "wall_s": round(ev.get("wall_s", 0), 1),
                    "checkpoint_dirs": ev.get("checkpoint_dirs"),
                    "attempts": [{k: x.get(k) for k in ("number", "returncode", "signal", "diagnosis", "resumed_from")}
                                 for x in atts.values()],
                    "incidents": [{k: i.get(k) for k in ("attempt", "symptom", "summary")} for i in incs]}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ulysses-ckpt21")
    ap.add_argument("--preset", default="gpt-1b")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--phases", default="disk,sync,faults",
                    help="disk, sync, bare_async, then supervised runs by name (a name containing 'standby' turns it "
                         "on, 'nopreload' turns its checkpoint preload off)")
    ap.add_argument("--dd-gib", type=int, default=6, help="size of each dd run")
    ap.add_argument("--probe-gib", type=int, default=6, help="size of the pinned/write probe")
    ap.add_argument("--sync-steps", type=int, default=26)
    ap.add_argument("--sync-interval", type=int, default=20)
    ap.add_argument("--sync-timeout", type=float, default=150.0)
    ap.add_argument("--async-steps", type=int, default=100, help="bare_async: steps")
    ap.add_argument("--async-interval", type=int, default=30, help="bare_async: save every N steps")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--interval", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=80, help="SIGKILL while the save at this step is written")
    ap.add_argument("--kill-delay", type=float, default=2.0, help="seconds after training resumed from that save")
    ap.add_argument("--kill-when", choices=("mid-write", "committed"), default="mid-write",
                    help="mid-write: during that save's background write; committed: once its manifest is durable "
                         "(and a warm standby preloaded it)")
    ap.add_argument("--stop-at", default="", metavar="A:N", help="end the supervised run once attempt A has N "
                                                                  "step records, or ('hang') once a hang incident "
                                                                  "is recorded (default: let it finish)")
    ap.add_argument("--preload-wait", type=float, default=60.0, help="committed: at most this long for the "
                                                                     "standby's preload before the kill")
    ap.add_argument("--hang-at", type=int, default=60, help="attempt 2 hangs before this step (0: no hang)")
    ap.add_argument("--hang-floor", type=float, default=20.0)
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds: the faults run ends 15 s before")
    ap.add_argument("--faults-timeout", type=float, default=330.0)
    ap.add_argument("--analyze", action="store_true")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if not a.analyze:
        phases = a.phases.split(",")
        if "disk" in phases:
            phase_disk(a, work, out)
        if "sync" in phases:
            phase_sync(a, work, out)
            print(json.dumps(analyze(a, out).get("sync")), flush=True)
        if "bare_async" in phases:
            phase_sync(a, work, out, "bare_async", async_save=True)
            print(json.dumps(analyze(a, out).get("bare_async")), flush=True)
        for name in [p for p in phases if p not in ("disk", "sync", "bare_async")]:   # supervised runs: faults, cold, standby...
            left = a.faults_timeout if a.deadline is None else min(a.faults_timeout, a.deadline - time.time() - 15)
            if left < 60:
                print(f"{name}: skipped, {left:.0f} s left before the deadline", flush=True)
                continue
            phase_faults(a, work, out, left, name=name, standby="standby" in name)
            print(json.dumps({name: analyze(a, out).get(name, {}).get("mttr_sigkill")}), flush=True)
    res = analyze(a, out)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
