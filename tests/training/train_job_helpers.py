"""Helpers (imported by test_train_job.py) to launch the real job (torchrun, gloo, DeepSpeed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ulyssesd.training.spec import JobSpec, job_spec_from_dict

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def tiny_spec(**sections: Any) -> JobSpec:
    """Tiny fp32 CPU job: 4 layers, h 64, seq 64, SP=2, checkpoint every 2 steps."""
    base: dict[str, Any] = {
        "model": {"preset": "tiny"},
        "parallel": {"sequence_parallel_size": 2},
        "precision": {"dtype": "fp32"},
        "attention": {"backend": "auto"},
        "train": {"steps": 6, "seq_len": 64, "micro_batch_size": 1, "gradient_accumulation_steps": 1,
                  "warmup_steps": 2, "lr": 1e-3, "min_lr": 1e-4, "device": "cpu", "seed": 7},
        "checkpoint": {"interval_steps": 2, "keep_last": 5},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return job_spec_from_dict(base)


@dataclass
class JobRun:
    run_dir: Path
    returncode: int | None
    output: str

    def records(self, attempt: int | None = None) -> list[dict[str, Any]]:
        path = self.run_dir / "telemetry.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in recs if attempt is None or r.get("attempt") == attempt]

    def steps(self, attempt: int | None = None) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in self.records(attempt) if r["kind"] == "step"}

    def events(self, name: str, attempt: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records(attempt) if r["kind"] == "event" and r["event"] == name]


def _cmd(spec: JobSpec, run_dir: Path, nproc: int, attempt: int, version: int) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "configs" / f"v{version}.json"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(spec.to_json())
    job = ["-m", "ulyssesd.training", "--config", str(cfg), "--run-dir", str(run_dir),
           "--attempt", str(attempt), "--config-version", str(version)]
    if nproc == 1:
        return [PY, *job]  # plain process: the job defaults to a world of one
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *job]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(extra or {})}
    env.pop("ULYSSESD_RUN_DIR", None)
    return env


def launch(spec: JobSpec, run_dir: Path, nproc: int = 2, attempt: int = 1, version: int = 1,
           env: dict[str, str] | None = None, timeout: float = 240) -> JobRun:
    """Run the job to completion (or until `timeout`, then kill it and fail)."""
    proc = subprocess.Popen(_cmd(spec, run_dir, nproc, attempt, version), cwd=REPO, env=_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"job did not finish in {timeout}s:\n{out[-4000:]}")
    return JobRun(run_dir, proc.returncode, out)


def start(spec: JobSpec, run_dir: Path, nproc: int = 2, attempt: int = 1, version: int = 1,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the job in its own process group (the caller signals/waits it)."""
    return subprocess.Popen(_cmd(spec, run_dir, nproc, attempt, version), cwd=REPO, env=_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"job exited ({proc.returncode}) while waiting for {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.1)
    if proc is not None:
        os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")
