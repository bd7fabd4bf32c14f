"""End to end with the REAL training job (torchrun, 2 ranks, gloo, ZeRO-3 + Ulysses) on the CPU.

Slow (each launch costs DeepSpeed start-up), so faults are combined in as few supervised runs as possible.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from uls_daemon_helpers import write_spec

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState

REPO = Path(__file__).resolve().parents[2]


def real_spec(tmp: Path, *, steps: int, faults=None, interval: int = 4, name="real", sock: Path | None = None,
              detectors: dict | None = None, daemon: dict | None = None, file_name: str = "run.toml") -> Path:
    """The real 2-rank tiny job under the daemon; `detectors`/`daemon` replace or add keys of those sections."""
    sock = sock or Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    sections = {
        "run": {"name": name},
        "launcher": {"kind": "torchrun", "nproc_per_node": 2},
        "model": {"preset": "tiny"},
        "parallel": {"sequence_parallel_size": 2},
        "precision": {"dtype": "fp32"},
        "train": {"steps": steps, "seq_len": 64, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 2,
                  "device": "cpu"},
        "deepspeed.config.zero_optimization": {"stage": 3, "overlap_comm": False},
        "data": {"kind": "synthetic"},
        "checkpoint": {"interval_steps": interval, "keep_last": 10},
        "detectors": detectors if detectors is not None else {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 12.0},
        "remediation": {"max_restarts_per_hour": 10},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.25, "stop_grace_s": 60.0,
                   "hang_grace_s": 5.0, "stack_dump_wait_s": 2.0, "early_death_s": 5.0, "preflight": False,
                   **(daemon or {})},
    }
    return write_spec(tmp / file_name, sections, faults)


def final_loss(run_dir: Path) -> tuple[int, float]:
    last = {}
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d.get("kind") == "step":
            last[d["step"]] = d["loss"]
    s = max(last)
    return s, last[s]


def _daemon(spec: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _try_store(db):
    """The store once the daemon has created its schema (the file appears a moment before)."""
    from ulyssesd.daemon.store.errors import StoreError

    try:
        return open_store(db, readonly=True) if db.exists() else None
    except StoreError:
        return None


def _wait(pred, timeout, what, proc=None, log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"daemon exited {proc.returncode} while waiting for {what}: "
                                 f"{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}" + (f": {log.read_text()[-3000:]}" if log else ""))


def _max_step(run_dir: Path, attempt: int | None = None) -> int:
    p = run_dir / "telemetry.jsonl"
    best = -1
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("kind") == "step" and (attempt is None or d.get("attempt") == attempt):
                best = max(best, d["step"])
    return best


@pytest.mark.slow
def test_real_sigkill_rank_hang_and_daemon_sigkill_match_uninterrupted_run(tmp_path):
    steps = 20
    # Uninterrupted reference, same spec without faults, under the same daemon.
    base = tmp_path / "base"
    base.mkdir()
    log0 = base / "daemon.log"
    d0 = _daemon(real_spec(base, steps=steps, name="base"), log0)
    assert d0.wait(300) == 0, log0.read_text()[-3000:]
    ref_run = next((base / "state" / "runs").iterdir())
    ref_step, ref_loss = final_loss(ref_run)
    assert ref_step == steps

    work = tmp_path / "faulty"
    work.mkdir()
    spec = real_spec(work, steps=steps, faults=[
        {"kind": "sigkill", "at_step": 7, "rank": 1, "attempts": [1]},   # SIGKILL of a non-zero rank
        {"kind": "hang", "at_step": 15, "rank": 0, "attempts": [2]},     # rank 0 stops making progress
    ])
    log = work / "daemon.log"
    d1 = _daemon(spec, log)
    db = work / "state" / "ulyssesd.db"
    store = _wait(lambda: _try_store(db), 60, "database", d1, log)
    run = _wait(lambda: store.latest_run(), 60, "run", d1, log)
    run_dir = Path(run.run_dir)
    # attempt 2 is training: kill the daemon with SIGKILL
    _wait(lambda: _max_step(run_dir, attempt=2) >= 10, 300, "attempt 2 past step 10", d1, log)
    job2 = store.get_attempt(run.id, 2)
    d1.send_signal(signal.SIGKILL)
    d1.wait(10)
    s0 = _max_step(run_dir, 2)
    _wait(lambda: _max_step(run_dir, 2) > s0, 60, "training continues without a daemon")
    assert os.path.exists(f"/proc/{job2.pid}")
    d2 = _daemon(spec, log)
    try:
        assert d2.wait(400) == 0, log.read_text()[-4000:]
    finally:
        if d2.poll() is None:
            d2.kill()
    store = open_store(db, readonly=True)
    run = store.get_run(run.id)
    assert run.state == RunState.COMPLETED
    atts = store.list_attempts(run.id)
    assert [a.number for a in atts] == [1, 2, 3]
    assert atts[1].pid == job2.pid  # re-adopted, not relaunched
    assert atts[1].diagnosis == "nccl_timeout"  # from the stack dumps of the hung attempt
    incs = store.list_incidents(run.id)
    kinds = [(i.attempt, i.symptom.value) for i in incs]
    assert kinds.count((1, "crash")) == 1 and kinds.count((2, "hang")) == 1, kinds
    hang = store.get_incident(next(i.id for i in incs if i.symptom.value == "hang"))
    assert hang.evidence["stacks"].count("most recent call first") >= 2  # both ranks dumped
    # Per-rank dumps: rank 1 waits inside a collective, rank 0 (the injected hang) is the one it waits for.
    assert "=== rank 0 stack dump" in hang.evidence["stacks"] and "=== rank 1 stack dump" in hang.evidence["stacks"]
    assert hang.evidence["diagnosis"] == "nccl_timeout" and hang.evidence["waited_for_ranks"] == [0], hang.summary
    assert "faults.py" in hang.summary, hang.summary
    # resumed from the right checkpoints (interval 4): crash at 7 -> step-4; hang at 15 -> step-12
    assert atts[1].resumed_from == "step-00000004" and atts[2].resumed_from == "step-00000012"
    step, loss = final_loss(run_dir)
    assert step == steps and math.isclose(loss, ref_loss, rel_tol=0, abs_tol=1e-6), (loss, ref_loss)
    # no orphans: nothing of any attempt is left
    import psutil
    # (attrs= makes psutil skip processes that vanish or turn zombie mid-scan instead of raising)
    live = [p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE]
    left = [p.pid for p in live if "ulyssesd.training" in " ".join(p.info["cmdline"] or [])
            and str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert left == []


@pytest.mark.slow
def test_demo_every_fault_class_detected_acted_on_and_completed(tmp_path):
    from ulyssesd.daemon.demo import run_demo

    assert run_demo(work_dir=str(tmp_path / "demo")) == 0
    store = open_store(tmp_path / "demo" / "state" / "ulyssesd.db", readonly=True)
    run = store.latest_run()
    assert run.state == RunState.COMPLETED
    assert (tmp_path / "demo" / f"report-{run.id}.html").is_file()  # the demo ends by writing the postmortem
    by = {}
    for i in store.list_incidents(run.id):
        by.setdefault(i.symptom.value, []).append(store.get_incident(i.id))
    assert {"loss_spike", "slow_step", "memory_spike", "hang", "nan_loss"} <= set(by), sorted(by)
    assert "crash" in by or "cuda_oom" in by
    acts = {k: [a for inc in v for a in inc.actions] for k, v in by.items()}
    hot = [a for a in acts["loss_spike"] if a.mode.value == "hot"]
    assert hot and hot[0].config_diff["train.gradient_clipping"] == [1.0, 0.5]
    mem = [a for a in acts["memory_spike"] if a.mode.value == "restart"]
    assert mem and mem[0].config_diff and mem[0].to_config_version > mem[0].from_config_version
    rb = [a for a in acts["nan_loss"] if a.kind.value == "rollback_skip"]
    assert rb and "data.skip_ranges" in rb[0].config_diff
    assert "most recent call first" in by["hang"][0].evidence["stacks"]
    atts = store.list_attempts(run.id)
    rollback_to = rb[0].parameters["rollback_to_step"]
    nan_attempt = by["nan_loss"][0].attempt
    resumed = next(a for a in atts if a.number == nan_attempt + 1).resumed_from
    assert resumed is None or int(resumed.split("-")[1]) <= rollback_to
