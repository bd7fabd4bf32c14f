"""What the GPU benches that run `ulyssesd run` share (gpu_daemon.py, gpu_ckpt21.py, gpu_oom21.py): the daemon
section of their specs, starting and ending the daemon with its ranks, and the raw files a run leaves for
`--analyze` (the store dumped to JSON, the attempt logs cut to size)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_common import rank_pids

#: The spec's run/launcher/detectors/remediation/daemon sections of a supervised bench run (torchrun on one node).
DAEMON_TOML = """
[run]
name = "{name}"
[launcher]
kind = "torchrun"
nproc_per_node = {nproc}
[detectors]
hang_timeout_floor_s = {hang_floor}
[remediation]
max_restarts_per_hour = 20
[daemon]
state_dir = "{state}"
socket_path = "{sock}"
tick_s = 0.5
stop_grace_s = 60.0
hang_grace_s = 10.0
stack_dump_wait_s = 3.0
preflight = false
"""

#: The built-in job's sections the supervised benches share, [model] to [data]: `{sp}` (the sequence-parallel size)
#: and `{ckpt}` (the [train] line that sets activation checkpointing) are each bench's, filled by `job_toml_head`;
#: the other fields stay placeholders for the bench's own `.format()` (its [telemetry]/[checkpoint] follow).
JOB_TOML_HEAD = """
[model]
preset = "{preset}"
[parallel]
sequence_parallel_size = {sp}
[precision]
dtype = "{dtype}"
[attention]
backend = "auto"
[train]
steps = {steps}
seq_len = {seq}
micro_batch_size = 1
lr = 1.5e-4
min_lr = 1.5e-5
warmup_steps = 10
{ckpt}
zero3_leaf_blocks = true
device = "{device}"
[deepspeed.config.zero_optimization]
stage = 3
stage3_param_persistence_threshold = 1e6
reduce_bucket_size = 1e8
overlap_comm = true
[data]
kind = "synthetic"
"""

#: The store's tables a bench keeps (`dump_store`).
STORE_TABLES = ("runs", "attempts", "incidents", "actions", "state_transitions", "checkpoints")


def new_socket_path() -> Path:
    """A control socket path of its own under /tmp (a socket path must stay short: 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"


def run_dir_of(state: Path) -> Path | None:
    """The run directory of a bench's state dir (each bench run has its own state dir, so one run)."""
    runs = state / "runs"
    if not runs.exists():
        return None
    dirs = [d for d in runs.iterdir() if d.is_dir()]
    return dirs[0] if dirs else None


def dump_store(db: Path) -> dict:
    """The store's tables as lists of rows, read-only; a table that cannot be read says why."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    out = {}
    for table in STORE_TABLES:
        try:
            out[table] = [dict(r) for r in con.execute(f"SELECT * FROM {table}")]  # noqa: S608 - fixed names
        except sqlite3.Error as exc:
            out[table] = f"error: {exc}"
    con.close()
    return out


def start_daemon(spec: Path, log: Path) -> subprocess.Popen:
    """`ulyssesd run --spec SPEC` in a session of its own, its output appended to `log`."""
    return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.cli", "run", "--spec", str(spec)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end_daemon(proc: subprocess.Popen, state: Path) -> None:
    """A run past its time: SIGTERM the daemon (it detaches), then SIGKILL its group and the run's ranks (the
    job survives a detaching daemon on purpose, a bench must not leave it on the GPU)."""
    proc.send_signal(signal.SIGTERM)
    time.sleep(2)
    kill_group(proc)
    rd = run_dir_of(state)
    for _, pid in (rank_pids(rd) if rd is not None else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def job_toml_head(sp: int | str, ckpt: str) -> str:
    """JOB_TOML_HEAD with the bench's sequence-parallel size and checkpointing line (still a format template)."""
    return JOB_TOML_HEAD.replace("{sp}", str(sp)).replace("{ckpt}", ckpt)


def save_telemetry(rd: Path, out: Path, name: str, empty_if_missing: bool = False) -> None:
    """The run's telemetry.jsonl as `{name}_telemetry.jsonl` (an empty file when the run has none and
    `empty_if_missing`)."""
    src = rd / "telemetry.jsonl"
    if src.exists():
        shutil.copy(src, out / f"{name}_telemetry.jsonl")
    elif empty_if_missing:
        (out / f"{name}_telemetry.jsonl").write_text("")


def save_logs(rd: Path, out: Path, name: str, tail: int, head: int = 0) -> None:
    """Each attempt log as `{name}_{log}_tail.txt` (its last `tail` characters) or, with `head`, as
    `{name}_{log}_headtail.txt` (the first `head` and the last `tail`)."""
    for lg in sorted((rd / "logs").glob("*.log")) if (rd / "logs").exists() else []:
        text = lg.read_text(errors="replace")
        if head:
            (out / f"{name}_{lg.name}_headtail.txt").write_text(text[:head] + "\n...\n" + text[-tail:])
        else:
            (out / f"{name}_{lg.name}_tail.txt").write_text(text[-tail:])


def save_store_and_events(state: Path, out: Path, name: str, events: dict) -> None:
    """`{name}_store.json` (when the run got a store) and `{name}_events.json`."""
    db = state / "ulyssesd.db"
    if db.exists():
        (out / f"{name}_store.json").write_text(json.dumps(dump_store(db), indent=1, default=str))
    (out / f"{name}_events.json").write_text(json.dumps(events, indent=1))


def epoch_of(value) -> float | None:
    """Epoch seconds of a store timestamp (a number, or ISO 8601 text; naive means UTC)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).replace("Z", "+00:00")
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()
