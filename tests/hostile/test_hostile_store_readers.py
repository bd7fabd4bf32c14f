"""Concurrent `ulyssesctl` readers while a writer hammers the store (an outside check of the store after its
split): real SQLite in WAL mode, a real writer process committing as fast as it can (the daemon's own
write path: telemetry cursor, incidents, state transitions), real `ulyssesctl` processes reading at the same
time. No reader may print "database is locked" as a traceback; every --json answer parses; an exclusive lock
held past the busy timeout is exit 23 with one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CTL = Path(sys.executable).parent / "ulyssesctl"

WRITER = textwrap.dedent("""
    import sys, time
    from ulyssesd.daemon.store import open_store
    store = open_store(sys.argv[1])
    end = time.monotonic() + float(sys.argv[2])
    n = 0
    print("writing", flush=True)
    while time.monotonic() < end:
        n += 1
        store.set_telemetry_cursor("r1", path="t.jsonl", inode=1, offset=n, last_step=n)
        if n % 10 == 0:
            store.record_incident("r1", attempt=1, symptom="loss_spike", step=n, summary="x" * 200)
        if n % 25 == 0:
            store.set_run_state("r1", "RUNNING" if n % 50 else "REMEDIATING", reason=f"write {n}")
    store.close()
    print(n, flush=True)
""")

LOCKER = textwrap.dedent("""
    import sqlite3, sys, time
    c = sqlite3.connect(sys.argv[1], isolation_level=None)
    c.execute("PRAGMA locking_mode=EXCLUSIVE")  # a writer that keeps the file to itself (no WAL sharing)
    c.execute("BEGIN EXCLUSIVE")
    c.execute("UPDATE runs SET state_reason = 'held'")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


@pytest.fixture
def state_dir(tmp_path) -> Path:
    from ulyssesd.daemon.store import open_store

    sd = tmp_path / "state"
    run_dir = sd / "runs" / "r1"
    (run_dir / "logs").mkdir(parents=True)
    with open_store(sd / "ulyssesd.db") as store:
        store.create_run("r1", run_dir=run_dir, spec={"train": {"steps": 10**6}}, state="RUNNING")
        store.add_attempt("r1", command=["train"])
    (run_dir / "logs" / "attempt-1.log").write_text("[rank0]:hello\n")
    return sd


def _ctl(sd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CTL), "--state-dir", str(sd), *args], capture_output=True, text=True, timeout=120)


def test_readers_during_a_write_storm_get_answers_never_tracebacks(state_dir):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(state_dir / "ulyssesd.db"), "6"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        commands = [("status", "--json"), ("runs", "--json"), ("incidents", "--json")] * 3
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(pool.map(lambda c: (c, _ctl(state_dir, *c)), commands))
        writes = int(writer.communicate(timeout=60)[0].strip())
    finally:
        writer.kill()
    assert writer.returncode == 0 and writes > 50  # the writer really wrote throughout
    ok = 0
    for cmd, proc in results:
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, (cmd, proc.stderr)
        doc = json.loads(proc.stdout)  # every answer parses, an error too
        if proc.returncode == 0:
            ok += 1
        else:
            assert proc.returncode == 23 and doc["exit_code"] == 23 and "locked" in doc["error"], (cmd, proc)
    assert ok == len(commands), f"{len(commands) - ok} reader(s) answered busy under WAL"  # WAL: readers never wait


@pytest.mark.slow  # waits out the readers' busy timeout three times (~18 s on the 2-core box)
def test_a_store_locked_past_the_busy_timeout_is_exit_23_in_one_line(state_dir):
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(state_dir / "ulyssesd.db"), "60"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        table = _ctl(state_dir, "runs")
        as_json = _ctl(state_dir, "status", "--json")
        logs = _ctl(state_dir, "logs", "r1")  # the log is a plain file: a locked store does not hide it
    finally:
        locker.kill()
        locker.wait()
    assert table.returncode == 23 and table.stdout == ""
    assert table.stderr.count("\n") == 1 and "is locked by another process" in table.stderr
    assert "Traceback" not in table.stderr
    assert as_json.returncode == 23 and json.loads(as_json.stdout)["exit_code"] == 23
    assert logs.returncode == 0 and logs.stdout == "[rank0]:hello\n" and "Traceback" not in logs.stderr
    healthy = _ctl(state_dir, "runs", "--json")  # the lock gone: the same store answers again
    assert healthy.returncode == 0 and [r["run_id"] for r in json.loads(healthy.stdout)] == ["r1"]
