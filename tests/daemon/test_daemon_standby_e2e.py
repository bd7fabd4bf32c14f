"""A warm standby with the REAL job (torchrun, 2 ranks, gloo, ZeRO-3 + Ulysses) on the CPU: a rank is
SIGKILLed, the daemon promotes the standby, the run completes with every step's loss equal to an
uninterrupted run's, and the time from the kill to the next productive step is lower than a cold relaunch's
in the same test session (both measured; the figures are printed for bench/RESULTS.md)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from test_daemon_e2e_real import _daemon, _try_store, _wait, real_spec

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState

STEPS = 60
# Attempt 1's steps are slowed (rank 0 sleeps 1 s before each; numerics untouched) so that it trains long
# enough for the standby to get warm on a loaded 2-core box; the steps after the restart run at full speed.
SLOW = {"kind": "slow_rank", "at_step": 1, "steps": 1000, "rank": 0, "magnitude": 1.0, "attempts": [1]}


def _records(run_dir: Path) -> list[dict]:
    out = []
    p = run_dir / "telemetry.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _steps(run_dir: Path, attempt: int) -> dict[int, dict]:
    return {r["step"]: r for r in _records(run_dir) if r.get("kind") == "step" and r.get("attempt") == attempt}


def _rank_pid(run_dir: Path, attempt: int, rank: int) -> int | None:
    """The training rank `rank` of cold-started or promoted attempt `attempt` (not a standby)."""
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] == psutil.STATUS_ZOMBIE or "ulyssesd.training" not in cmd or str(run_dir) not in cmd:
            continue
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == str(rank) and env.get("ULYSSESD_ATTEMPT") == str(attempt):
            return p.pid
    return None


def _run(tmp: Path, name: str, *, faults, standby: bool | None, kill: bool) -> dict:
    """One supervised run; with `kill`, SIGKILL rank 1 of attempt 1 once it trains past a checkpoint (and,
    with a standby, once both standby ranks say they are warm). Returns its run dir, per-step losses, MTTR."""
    work = tmp / name
    work.mkdir()
    spec = real_spec(work, steps=STEPS, faults=faults, name=name, interval=4,
                     daemon={"rank_exit_grace_s": 1.0})
    if standby is not None:
        spec.write_text(spec.read_text() + f"\n[restart]\nstandby = {'true' if standby else 'false'}\n")
    log = work / "daemon.log"
    d = _daemon(spec, log)
    try:
        store = _wait(lambda: _try_store(work / "state" / "ulyssesd.db"), 120, "database", d, log)
        run = _wait(lambda: store.latest_run(), 120, "run", d, log)
        run_dir = Path(run.run_dir)
        killed_at = None
        if kill:
            def ready() -> bool:
                if max(_steps(run_dir, 1), default=0) < 6:
                    return False
                return not standby or len(list((run_dir / "standby").glob("attempt-2-rank-*.ready"))) == 2
            _wait(ready, 300, "attempt 1 past step 6" + (" and a warm standby" if standby else ""), d, log)
            pid = _wait(lambda: _rank_pid(run_dir, 1, 1), 30, "rank 1 of attempt 1", d, log)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            assert max(_steps(run_dir, 1)) < STEPS - 5, "attempt 1 finished too early for a restart"
        assert d.wait(600) == 0, log.read_text()[-4000:]
    finally:
        if d.poll() is None:
            d.kill()
    losses: dict[int, float] = {}
    for r in _records(run_dir):  # the final timeline: a later attempt's record of a step wins
        if r.get("kind") == "step":
            losses[r["step"]] = r["loss"]
    out = {"run_dir": run_dir, "losses": losses, "db": work / "state" / "ulyssesd.db"}
    if kill:
        first = min(_steps(run_dir, 2).values(), key=lambda r: r["step"])
        out["mttr_s"] = first["time"] - killed_at
        out["phases"] = _phases(log, run_dir, killed_at, first["time"])
        out["redo_overlap"] = {s: (r["loss"], _steps(run_dir, 2)[s]["loss"]) for s, r in _steps(run_dir, 1).items()
                               if s in _steps(run_dir, 2)}
    return out


def _phases(log: Path, run_dir: Path, killed_at: float, first_step_at: float) -> str:
    """Kill -> the attempt's exit handled -> attempt 2 launched (or promoted) -> its `started` event (process
    group, model build, checkpoint load) -> its first step, in seconds, from the daemon's log and telemetry."""
    from datetime import datetime

    at: dict[str, float] = {}
    for line in log.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        ev, ts = d.get("event"), d.get("timestamp")
        if ts and ((ev == "attempt ended" and d.get("attempt") == 1) or (ev == "launched" and d.get("attempt") == 2)):
            at.setdefault(ev, datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp())
    ev = next(r for r in _records(run_dir) if r.get("event") == "started" and r.get("attempt") == 2)
    started, startup = ev["time"], ev.get("startup") or {}
    loaded = next((r.get("seconds") for r in _records(run_dir)
                   if r.get("event") == "checkpoint_loaded" and r.get("attempt") == 2), None)
    return (f"exit handled {at['attempt ended'] - killed_at:.1f} s, relaunch {at['launched'] - at['attempt ended']:.1f} s, "
            f"launch -> started {started - at['launched']:.1f} s (checkpoint load {loaded} s), "
            f"first step {first_step_at - started:.1f} s; the job's start-up phases (s since its process "
            f"started): {', '.join(f'{k} {v}' for k, v in startup.items() if k != 'process_started_at')}")


@pytest.mark.slow
def test_sigkill_with_a_warm_standby_resumes_bit_exact_and_faster_than_a_cold_relaunch(tmp_path):
    ref = _run(tmp_path, "ref", faults=None, standby=None, kill=False)
    assert sorted(ref["losses"]) == list(range(1, STEPS + 1))
    cold = _run(tmp_path, "cold", faults=[SLOW], standby=False, kill=True)
    warm = _run(tmp_path, "warm", faults=[SLOW], standby=True, kill=True)
    for res in (cold, warm):
        store = open_store(res["db"], readonly=True)
        run = store.latest_run()
        assert run.state == RunState.COMPLETED
        atts = store.list_attempts(run.id)
        assert [a.number for a in atts] == [1, 2]
        # Every step's loss equals the uninterrupted run's, bit for bit, and so do the steps redone after
        # the resume (the same steps computed again from the checkpoint).
        assert res["losses"] == ref["losses"]
        assert all(a == b for a, b in res["redo_overlap"].values()), res["redo_overlap"]
        promoted = "--standby-gate" in atts[1].command
        assert promoted == (res is warm), atts[1].command
    # The standby's preloaded shards were what the resume loaded (rank 0's own shards, from memory).
    used = [r for r in _records(warm["run_dir"]) if r.get("event") == "standby_preload_used"]
    assert len(used) == 1 and used[0]["from_memory"] >= 2 and used[0]["from_disk"] == 0, used
    assert used[0]["checksums_verified_in_standby"] is True, used  # no second sha256 pass after the gate
    # Nothing of either run is left: not a rank, not a standby.
    live = [p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE]
    for res in (cold, warm):
        assert not [p.pid for p in live if str(res["run_dir"]) in " ".join(p.info["cmdline"] or [])]
    print(f"\nMTTR (SIGKILL of rank 1 -> first step of the next attempt): cold {cold['mttr_s']:.1f} s, "
          f"warm standby {warm['mttr_s']:.1f} s; load average {os.getloadavg()[0]:.1f}\n"
          f"  cold: {cold['phases']}\n  warm: {warm['phases']}")
    assert warm["mttr_s"] < cold["mttr_s"], (warm["mttr_s"], cold["mttr_s"])
