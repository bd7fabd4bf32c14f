"""Hostile round 6: probes invented from the docs and `--help` only, against a real `ulyssesd run`.

Each probe supervises a small pure-Python command job (tests/hostile/round6/harness.py) and attacks the run
from one side: the job's output, its telemetry file, its process tree, the run directory, the control
socket, the daemon's signals. A probe asserts what must be true in every legal interleaving: the run ends
in the right state (or keeps being supervised), with the step it really reached, and nothing is left
unsaid. A probe the product does not survive is `xfail(strict=True)` with what goes wrong in its reason.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from round6.harness import final_state, job_pids, make_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(300)]

STEP_LINES = """\
import os, sys, time
T = {total}
def step_line(s):
    return f"step {{s}}/{{T}} loss {{3.0 - s * 0.01:.4f}}"
"""


def _job(body: str, total: int = 30) -> str:
    return STEP_LINES.format(total=total) + body


# --------------------------------------------------------------------------------------------------------
# Hostile stdout
# --------------------------------------------------------------------------------------------------------

def test_binary_garbage_nul_bytes_and_unicode_separators_between_step_lines(tmp_path: Path) -> None:
    """NUL bytes, invalid UTF-8, escape sequences, U+2028/U+2029/NEL and form feeds between (not inside)
    step lines: every step is still read and the run completes at its total."""
    job = _job("""\
garbage = [b"\\x00" * 64, bytes(range(256)), b"\\xff\\xfe\\xfd not utf8 \\xc3\\x28", b"\\x1b[2J\\x1b]0;pwn\\x07",
           "a\\u2028b\\u2029c\\x85d\\x0c".encode(), b"\\x00step 99999999 loss 1.0\\x00"]
for s in range(1, T + 1):
    os.write(1, garbage[s % len(garbage)] + b"\\n")
    os.write(1, (step_line(s) + "\\n").encode())
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job)
    try:
        run.start()
        assert final_state(run) == "COMPLETED", run.daemon_output()[-2000:]
        st = run.status()
        assert st["step"] == 30, st
        assert not [i for i in run.incidents() if i.get("symptom") == "hang"]
    finally:
        run.stop()


def test_a_20_mib_line_without_newline_then_steps(tmp_path: Path) -> None:
    """A job that dumps 20 MiB on one line (a tensor printed whole) before and between its step lines."""
    job = _job("""\
chunk = b"x" * (1 << 20)
for s in range(1, T + 1):
    if s in (1, 15):
        for _ in range(20):
            os.write(1, chunk)
        os.write(1, b"\\n")
    os.write(1, (step_line(s) + "\\n").encode())
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job)
    try:
        run.start()
        assert final_state(run, 150) == "COMPLETED", run.daemon_output()[-2000:]
        assert run.status()["step"] == 30
    finally:
        run.stop()


def test_carriage_return_only_progress_is_read_to_the_last_step(tmp_path: Path) -> None:
    """A job that draws its progress with `\\r` only and never prints a newline, then exits 0: the last
    redraw is the final step, not 'final step unknown'."""
    job = _job("""\
for s in range(1, T + 1):
    sys.stdout.write("\\r" + step_line(s))
    sys.stdout.flush()
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job)
    try:
        run.start()
        assert final_state(run) == "COMPLETED", run.daemon_output()[-2000:]
        st = run.status()
        assert st["step"] == 30, st
        assert "unknown" not in str(st.get("state_reason")), st
    finally:
        run.stop()


def test_step_lines_split_by_unicode_line_separators(tmp_path: Path) -> None:
    """Two step records on one newline-terminated line, separated by U+2028 (what a JSON logger that
    escapes nothing emits): neither record blinds the reader for the lines after it."""
    job = _job("""\
for s in range(1, T + 1, 2):
    line = step_line(s) + "\\u2028" + step_line(s + 1) + "\\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    time.sleep(0.1)
""")
    run = make_run(tmp_path, job)
    try:
        run.start()
        assert final_state(run) == "COMPLETED", run.daemon_output()[-2000:]
        st = run.status()
        assert st["step"] == 30, st
    finally:
        run.stop()


def test_two_ranks_interleave_partial_lines(tmp_path: Path) -> None:
    """Two processes share stdout and write each line in three pieces: the lines interleave mid-line. The
    run is neither killed as hung nor blinded by a garbled line; it completes."""
    job = _job("""\
pid = os.fork()
rank = 0 if pid else 1
for s in range(1, T + 1):
    line = f"[rank{rank}]: " + step_line(s) + "\\n"
    a, b = len(line) // 3, 2 * len(line) // 3
    for piece in (line[:a], line[a:b], line[b:]):
        os.write(1, piece.encode())
        time.sleep(0.004)
    time.sleep(0.05)
if pid:
    os.waitpid(pid, 0)
""")
    run = make_run(tmp_path, job, hang_floor_s=8)
    try:
        run.start()
        assert final_state(run) == "COMPLETED", run.daemon_output()[-2000:]
        assert not [i for i in run.incidents() if i.get("symptom") == "hang"], run.incidents()
    finally:
        run.stop()


# --------------------------------------------------------------------------------------------------------
# Hostile telemetry file ({run_dir}/telemetry.jsonl, the default source)
# --------------------------------------------------------------------------------------------------------

JSONL = """\
import json, os, sys, time
T = {total}
PATH = os.path.join(os.environ["ULYSSESD_RUN_DIR"], "telemetry.jsonl")
def rec(s, **kw):
    r = {{"v": 1, "kind": "step", "time": time.time(), "attempt": int(os.environ["ULYSSESD_ATTEMPT"]),
          "step": s, "loss": 3.0 - s * 0.01, "total_steps": T}}
    r.update(kw)
    return json.dumps(r)
def put(line):
    with open(PATH, "a") as fh:
        fh.write(line + "\\n")
"""


def _jsonl_job(body: str, total: int = 30) -> str:
    return JSONL.format(total=total) + body


def test_telemetry_records_with_wrong_types_and_out_of_range_numbers(tmp_path: Path) -> None:
    """Between good records: a string step, a negative step, 2^70, 1e400 (inf), `NaN`/`Infinity` JSON
    tokens, a list loss, a non-finite time, bare JSON values. Each is garbage, counted; the good records
    carry the run to its total."""
    job = _jsonl_job("""\
bad = ['{"kind":"step","step":"5","loss":1.0}', '{"kind":"step","step":-3,"loss":1.0}',
       '{"kind":"step","step":1180591620717411303424,"loss":1.0}', '{"kind":"step","step":1e400,"loss":1.0}',
       '{"kind":"step","step":7,"loss":NaN,"time":Infinity}', '{"kind":"step","step":7,"loss":[1,2]}',
       '{"kind":"step","step":7,"loss":1.0,"time":"inf"}', '[1,2,3]', '42', 'null', '"step"',
       '{"kind":"step","step":true,"loss":1.0}', '{"kind":"event","event":null}',
       '{"kind":"step","step":7,"loss":1.0,"attempt":-99999999999999999999}']
for s in range(1, T + 1):
    put(bad[s % len(bad)])
    put(rec(s))
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job, source=None)
    try:
        run.start()
        assert final_state(run) == "COMPLETED", run.daemon_output()[-2000:]
        st = run.status()
        assert st["step"] == 30, st
    finally:
        run.stop()


def test_one_telemetry_record_with_a_huge_but_valid_step_does_not_blind_the_run(tmp_path: Path) -> None:
    """The file-telemetry twin of round 3's Megatron 10^25 line: one record with step 10^15 (inside
    int64, so not garbage), then the job goes on 11, 12, ... The records after it must still count:
    the run is not killed as hung and completes at step 30."""
    job = _jsonl_job("""\
for s in range(1, T + 1):
    if s == 10:
        put(rec(10 ** 15))
    put(rec(s))
    time.sleep(0.25)
""")
    run = make_run(tmp_path, job, source=None, hang_floor_s=5)
    try:
        run.start()
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        st = run.status()
        assert st["step"] == 30, st
        assert st["attempt"] == 1, st
    finally:
        run.stop()


def test_job_clock_days_behind_does_not_make_a_healthy_job_hung(tmp_path: Path) -> None:
    """A job host whose clock is 3 days behind stamps its records with that `time`. The job is healthy
    (a step every 0.2 s): it must not be killed as hung."""
    job = _jsonl_job("""\
for s in range(1, T + 1):
    put(rec(s, time=time.time() - 3 * 86400))
    time.sleep(0.2)
""", total=60)
    run = make_run(tmp_path, job, source=None, hang_floor_s=5)
    try:
        run.start()
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["attempt"] == 1
        assert not [i for i in run.incidents() if i.get("symptom") == "hang"], run.incidents()
    finally:
        run.stop()


def test_job_clock_hours_ahead_does_not_hide_a_hang(tmp_path: Path) -> None:
    """A job whose clock is 14 h ahead, then hangs (stops writing, stays alive): the hang is still found
    within the hang timeout (plus slack), not 14 h later."""
    job = _jsonl_job("""\
for s in range(1, 16):
    put(rec(s, time=time.time() + 14 * 3600))
    time.sleep(0.2)
if os.environ["ULYSSESD_ATTEMPT"] == "1":
    time.sleep(3600)
for s in range(16, T + 1):
    put(rec(s, time=time.time() + 14 * 3600))
    time.sleep(0.1)
""")
    run = make_run(tmp_path, job, source=None, hang_floor_s=5)
    try:
        run.start()
        run.wait_step(15, 60)
        wait_for(lambda: [i for i in run.incidents() if i.get("symptom") == "hang"], 60,
                 "a hang incident for a job whose clock runs ahead")
    finally:
        run.stop()


def test_stdout_timestamps_in_another_time_zone_do_not_hide_a_hang(tmp_path: Path) -> None:
    """The job logs local wall time with no zone (torchtitan's `2025-06-16 22:30:50,322`), in
    TZ=Pacific/Kiritimati (UTC+14) while the daemon reads in its own zone; then it hangs. The hang is
    found within the hang timeout plus slack."""
    job = _job("""\
import datetime
for s in range(1, 16):
    ts = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    print(f"[rank0]:[titan] {ts} - root - INFO - step: {s}  loss:  {3.0 - s * 0.01:.4f}", flush=True)
    time.sleep(0.2)
if os.environ["ULYSSESD_ATTEMPT"] == "1":
    time.sleep(3600)
""", total=15)
    run = make_run(tmp_path, job, hang_floor_s=5,
                   daemon_extra="", job_extra='total_steps = 15')
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text().replace(
        '[launcher]\nkind = "local"', '[launcher]\nkind = "local"\nenv = { TZ = "Pacific/Kiritimati" }'))
    run.env["TZ"] = "UTC"
    try:
        run.start()
        run.wait_step(15, 60)
        wait_for(lambda: [i for i in run.incidents() if i.get("symptom") == "hang"], 60,
                 "a hang incident for a job logging local time 14 h ahead")
    finally:
        run.stop()


def test_stdout_timestamps_in_a_time_zone_behind_do_not_kill_a_healthy_job(tmp_path: Path) -> None:
    """The same logging in TZ=Pacific/Pago_Pago (UTC-11): a healthy job is not taken for hung."""
    job = _job("""\
import datetime
for s in range(1, T + 1):
    ts = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    print(f"[rank0]:[titan] {ts} - root - INFO - step: {s}  loss:  {3.0 - s * 0.01:.4f}", flush=True)
    time.sleep(0.2)
""", total=60)
    run = make_run(tmp_path, job, hang_floor_s=5, job_extra='total_steps = 60')
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text().replace(
        '[launcher]\nkind = "local"', '[launcher]\nkind = "local"\nenv = { TZ = "Pacific/Pago_Pago" }'))
    run.env["TZ"] = "UTC"
    try:
        run.start()
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["attempt"] == 1
        assert not [i for i in run.incidents() if i.get("symptom") == "hang"], run.incidents()
    finally:
        run.stop()


def test_job_truncates_and_rewrites_its_telemetry_file(tmp_path: Path) -> None:
    """A job that opens telemetry.jsonl with "w" again mid-run (a second logger, a restarted writer):
    the records written after the truncation are read; the healthy job is not taken for hung."""
    job = _jsonl_job("""\
for s in range(1, T + 1):
    if s == 12:
        open(PATH, "w").close()
    put(rec(s))
    time.sleep(0.25)
""")
    run = make_run(tmp_path, job, source=None, hang_floor_s=5)
    try:
        run.start()
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["step"] == 30
        assert run.status()["attempt"] == 1
    finally:
        run.stop()


def test_telemetry_file_replaced_by_a_fifo_does_not_wedge_the_daemon(tmp_path: Path) -> None:
    """The job replaces telemetry.jsonl by a FIFO nobody writes to. The daemon must not block on it:
    `status` keeps answering, and `stop` stops the run."""
    job = _jsonl_job("""\
for s in range(1, 6):
    put(rec(s))
    time.sleep(0.1)
time.sleep(1.0)
os.unlink(PATH)
os.mkfifo(PATH)
while True:
    time.sleep(0.5)
""")
    run = make_run(tmp_path, job, source=None)
    try:
        run.start()
        run.wait_step(5, 60)
        wait_for(lambda: stat.S_ISFIFO(os.stat(run.run_dir() / "telemetry.jsonl").st_mode), 30, "the FIFO")
        time.sleep(3)
        rc, st = run.ctl("status", timeout=20)
        assert rc == 0 and st.get("daemon", "").startswith("running"), st
        rc, ans = run.ctl("stop", timeout=20)
        assert rc == 0, ans
        assert final_state(run, 60) == "STOPPED"
    finally:
        run.stop()


def test_attempt_log_deleted_mid_run_does_not_blind_stdout_telemetry(tmp_path: Path) -> None:
    """logs/attempt-1.log removed while the job prints (a tmp cleaner, an over-eager logrotate): the job
    keeps writing to its open fd. The daemon must keep reading its steps (or say it cannot); a healthy job
    is not killed as hung after the floor."""
    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.25)
""", total=60)
    run = make_run(tmp_path, job, hang_floor_s=5)
    try:
        run.start()
        run.wait_step(5, 60)
        (run.run_dir() / "logs" / "attempt-1.log").unlink()
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        st = run.status()
        assert st["attempt"] == 1 and st["step"] == 60, st
    finally:
        run.stop()


# --------------------------------------------------------------------------------------------------------
# The job's process tree
# --------------------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def test_job_leaves_a_new_session_grandchild_holding_stdout_and_exits_0(tmp_path: Path) -> None:
    """The job double-forks a grandchild into its own session that ignores SIGTERM, keeps the job's
    stdout open and keeps printing; the job itself exits 0 at its total. The run ends COMPLETED, the
    daemon exits, and the grandchild does not outlive the run."""
    job = _job("""\
import signal
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.05)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(os.environ["ULYSSESD_RUN_DIR"], "grandchild.pid"), "w").write(str(os.getpid()))
        while True:
            print("grandchild still here", flush=True)
            time.sleep(0.2)
    os._exit(0)
time.sleep(1.0)
""")
    run = make_run(tmp_path, job)
    try:
        run.start()
        assert final_state(run, 90) == "COMPLETED", run.daemon_output()[-2000:]
        gc = int((run.run_dir() / "grandchild.pid").read_text())
        wait_for(lambda: not _pid_alive(gc), 20, f"the grandchild {gc} to be gone")
    finally:
        for pid in job_pids(run.state):
            os.kill(pid, signal.SIGKILL)
        run.stop()


def test_job_closes_stdout_and_stderr_early_and_keeps_training(tmp_path: Path) -> None:
    """A job that closes fds 1 and 2 (a daemonizing library does) and reports through telemetry.jsonl."""
    job = _jsonl_job("""\
os.close(1)
os.close(2)
for s in range(1, T + 1):
    put(rec(s))
    time.sleep(0.1)
""")
    run = make_run(tmp_path, job, source=None, hang_floor_s=5)
    try:
        run.start()
        assert final_state(run, 90) == "COMPLETED", run.daemon_output()[-2000:]
        assert run.status()["step"] == 30
    finally:
        run.stop()


def test_stop_of_a_job_that_ignores_sigterm_in_a_new_session(tmp_path: Path) -> None:
    """The training runs in a child that left the job's session and process group and ignores SIGTERM;
    the parent waits for it. `ulyssesctl stop` still ends the run STOPPED within the grace, and no
    process of the job survives."""
    job = _job("""\
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for s in range(1, 10 ** 6):
        print(step_line(s), flush=True)
        time.sleep(0.1)
    os._exit(0)
os.waitpid(pid, 0)
""", total=100000)
    run = make_run(tmp_path, job, stop_grace_s=4)
    try:
        run.start()
        run.wait_step(5, 60)
        rc, ans = run.ctl("stop", timeout=20)
        assert rc == 0, ans
        assert final_state(run, 60) == "STOPPED"
        wait_for(lambda: not job_pids(run.state), 20, "no job process left")
    finally:
        run.stop()


def test_operator_stop_of_a_script_that_exits_0_on_sigterm_is_stopped_not_completed(tmp_path: Path) -> None:
    """A plain script's graceful SIGTERM handler exits 0. The operator asked for a stop: the run is
    STOPPED, never COMPLETED (which would claim the training finished)."""
    job = _job("""\
import signal
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.1)
""", total=100000)
    run = make_run(tmp_path, job)
    try:
        run.start()
        run.wait_step(5, 60)
        rc, ans = run.ctl("stop", timeout=20)
        assert rc == 0, ans
        assert final_state(run, 60) == "STOPPED"
    finally:
        run.stop()


# --------------------------------------------------------------------------------------------------------
# The checkpoint directory and the paths
# --------------------------------------------------------------------------------------------------------

def test_checkpoint_dir_with_junk_a_fifo_and_a_symlink_loop(tmp_path: Path) -> None:
    """checkpoint_dir holds 3,000 junk entries (odd names, huge numbers), a FIFO named like a checkpoint
    file, a symlink loop and a directory link to /proc. The daemon's looks must not block on the FIFO nor
    wedge: `status` answers, the run completes, and no junk is taken as the resume point."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for i in range(3000):
        (ckpt / f"junk {i} \u00e9\u2028step_{i * 7919}.tmp").write_bytes(b"x")
    (ckpt / "step_999999999999999999999999").mkdir()
    (ckpt / "step_999999999999999999999999" / "model.pt").write_bytes(b"not a zip")
    os.mkfifo(ckpt / "step_000500.pt")
    (ckpt / "loop_a").symlink_to("loop_b")
    (ckpt / "loop_b").symlink_to("loop_a")
    (ckpt / "step_000400").symlink_to("/proc")
    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.5)          # long enough that `status` is asked while it runs, on a loaded machine
""", total=40)
    run = make_run(tmp_path, job, job_extra='checkpoint_dir = "ckpt"\ncheckpoint_settle_s = 0.5')
    try:
        run.start()
        run.wait_step(3, 60)
        rc, st = run.ctl("status", timeout=20)
        assert rc == 0 and str(st.get("daemon", "")).startswith("running"), st
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        st = run.status()
        assert st["step"] == 40
        assert st.get("latest_checkpoint") in (None, ""), st
    finally:
        run.stop()


def test_state_dir_with_spaces_newline_and_unicode_in_its_path(tmp_path: Path) -> None:
    """A state dir named `a b\\nc \u00e9\u2028d`: the run completes and `ulyssesctl` finds it."""
    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job, state=tmp_path / "a b\nc \u00e9\u2028d" / "st ate")
    try:
        run.start()
        run.wait_step(1, 60)
        assert final_state(run) == "COMPLETED", run.daemon_output()[-2000:]
        assert run.status()["step"] == 30
    finally:
        run.stop()


def test_state_dir_path_longer_than_a_unix_socket_path(tmp_path: Path) -> None:
    """A state dir path of ~200 bytes: the control socket's path exceeds sun_path (108 bytes). Either the
    daemon refuses at start naming the problem (before launching the job), or pause/stop still work."""
    deep = tmp_path / ("d" * 60) / ("e" * 60) / ("f" * 60)
    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.1)
""", total=100000)
    run = make_run(tmp_path, job, state=deep)
    try:
        run.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and run.proc is not None and run.proc.poll() is None:
            if isinstance(run.status().get("step"), int):
                break
            time.sleep(0.3)
        if run.proc is not None and run.proc.poll() is not None:
            out = run.daemon_output()
            assert run.proc.returncode != 0 and "socket" in out.lower(), out[-2000:]
            assert not job_pids(run.state)
            return
        rc, ans = run.ctl("stop", timeout=20)
        assert rc == 0, ans
        assert final_state(run, 60) == "STOPPED"
    finally:
        run.stop()


# --------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,needle", [
    ('\n[daemon]\ntick_s = 0.5\n', "daemon"),                       # the [daemon] table twice
    ('\n[detector]\nhang_timeout_floor_s = 5\n', "detector"),       # a typo'd section
    ('\n[job]\ncommand = ["other.py"]\n', "job"),                    # [job] twice
])
def test_spec_with_duplicate_or_unknown_tables_is_refused_by_name(tmp_path: Path, extra: str,
                                                                   needle: str) -> None:
    run = make_run(tmp_path, _job("print('hi')\n"))
    run.spec.write_text(run.spec.read_text() + extra)
    run.start()
    rc = run.wait_daemon(60)
    out = run.daemon_output()
    assert rc == 2, out[-2000:]
    assert needle in out, out[-2000:]
    assert not (run.state / "runs").exists() or not any((run.state / "runs").iterdir())


# --------------------------------------------------------------------------------------------------------
# Operators and the control socket
# --------------------------------------------------------------------------------------------------------

LONG_JOB = """\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.1)
"""


def _socket_path(run_state: Path) -> str:
    info = json.loads((run_state / "ulyssesd.daemon.json").read_text())
    return str(info.get("socket") or run_state / "ulyssesd.sock")


def test_pause_resume_stop_storm_from_concurrent_operators(tmp_path: Path) -> None:
    """Three operators hammer pause/resume/restart concurrently for a while, then one stops. Every answer is
    a clean ok or a refusal (never `internal`), never two attempts' jobs alive at once, and the run ends
    STOPPED with no job process left."""
    job = _job(LONG_JOB, total=100000)
    run = make_run(tmp_path, job, stop_grace_s=5)
    answers: list[tuple[int, object]] = []
    overlap: list[list[int]] = []
    stop_flag = threading.Event()

    def operator(cmds: list[str]) -> None:
        i = 0
        while not stop_flag.is_set():
            answers.append(run.ctl(cmds[i % len(cmds)], timeout=30))
            i += 1

    def watch() -> None:
        while not stop_flag.is_set():
            attempts = set()
            for pid in job_pids(run.state):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                attempts |= {e for e in env if e.startswith(b"ULYSSESD_JOB_ID=")}
            if len(attempts) > 1:
                overlap.append(sorted(len(a) for a in attempts))
            time.sleep(0.1)

    try:
        run.start()
        run.wait_step(3, 60)
        threads = [threading.Thread(target=operator, args=(c,)) for c in
                   (["pause", "resume"], ["resume", "pause", "restart"], ["restart", "resume"])]
        threads.append(threading.Thread(target=watch))
        for t in threads:
            t.start()
        time.sleep(25)
        stop_flag.set()
        for t in threads:
            t.join(60)
        rc, ans = run.ctl("stop", timeout=30)
        if rc != 0:   # a PAUSED run is stopped too; any other refusal is a finding
            assert isinstance(ans, dict) and ans.get("code") not in ("internal",), ans
        assert final_state(run, 90) == "STOPPED", run.daemon_output()[-3000:]
        internal = [a for a in answers if isinstance(a[1], dict) and (a[1].get("code") == "internal"
                                                                        or a[0] in (-1, 1))]
        assert not internal, internal[:5]
        assert not overlap, overlap[:5]
        wait_for(lambda: not job_pids(run.state), 20, "no job process left")
    finally:
        stop_flag.set()
        run.stop()


def test_control_socket_flood_of_idle_and_garbage_connections(tmp_path: Path) -> None:
    """400 connections that send nothing, 200 that send garbage without a newline and hold: the job is
    still supervised (steps keep being read), `ulyssesctl status` is answered once the flood has been
    cut off, and a stop works."""
    job = _job(LONG_JOB, total=100000)
    run = make_run(tmp_path, job)
    socks: list[socket.socket] = []
    try:
        run.start()
        run.wait_step(3, 60)
        path = _socket_path(run.state)
        for i in range(600):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except (BlockingIOError, OSError):
                pass
            if i >= 400:
                try:
                    s.send(b'{"cmd": "status", "args": {' + b"x" * 1000)
                except OSError:
                    pass
            socks.append(s)
        step0 = run.status().get("step")
        # The flood is held; the supervision must go on under it.
        wait_for(lambda: isinstance(s := run.status().get("step"), int) and isinstance(step0, int)
                 and s > step0 + 10, 60, "steps to advance under the flood")
        rc, ans = run.ctl("stop", timeout=30)
        assert rc == 0, ans
        assert final_state(run, 90) == "STOPPED"
    finally:
        for s in socks:
            s.close()
        run.stop()


def test_control_socket_flood_past_a_low_fd_limit(tmp_path: Path) -> None:
    """The daemon runs with RLIMIT_NOFILE = 128 (a container default gone wrong) and 300 connections
    arrive and stay: accept fails with EMFILE. Once they go away the daemon answers again, the job was
    supervised throughout, and the run completes."""
    import resource

    def low_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.1)
""", total=250)
    run = make_run(tmp_path, job)
    socks: list[socket.socket] = []
    try:
        run.start(preexec=low_fds)
        run.wait_step(3, 60)
        path = _socket_path(run.state)
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except OSError:
                pass
            socks.append(s)
        time.sleep(8)
        for s in socks:
            s.close()
        socks.clear()
        rc, st = run.ctl("status", timeout=30)
        assert rc == 0 and str(st.get("daemon", "")).startswith("running"), st
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["step"] == 250
    finally:
        for s in socks:
            s.close()
        run.stop()


# --------------------------------------------------------------------------------------------------------
# Signals to the daemon at awkward moments
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGPIPE,
])
def test_stray_signal_to_the_daemon_does_not_end_supervision(tmp_path: Path, sig: int) -> None:
    """SIGHUP (a closed terminal, `systemctl reload`), SIGUSR1/2 (a `kill -USR1` meant for a rank),
    SIGPIPE: the daemon must not die of a default action and leave the job unsupervised. It keeps
    supervising (the run completes under it) or detaches cleanly (exit 0, saying so)."""
    # 400 steps of 0.1 s: the signal lands while the daemon supervises (with 80 a loaded box's status poll saw
    # step 3 as the run ended, and a SIGHUP in the interpreter's last milliseconds is not this probe).
    job = _job(LONG_JOB, total=400)
    run = make_run(tmp_path, job)
    try:
        run.start()
        run.wait_step(3, 60)
        run.signal_daemon(sig)
        rc = run.wait_daemon(300)
        assert rc == 0, (rc, run.daemon_output()[-2000:])
        assert run.state_name() == "COMPLETED", run.daemon_output()[-2000:]
    finally:
        run.stop()


def test_daemon_sigstopped_past_the_hang_timeout_does_not_kill_a_healthy_job(tmp_path: Path) -> None:
    """The daemon is frozen (SIGSTOP: a suspended VM, a debugger) for longer than the hang timeout while
    the job trains on. After SIGCONT the backlog shows progress: no hang verdict, no restart."""
    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.1)
""", total=200)
    run = make_run(tmp_path, job, hang_floor_s=5)
    try:
        run.start()
        run.wait_step(10, 60)
        run.signal_daemon(signal.SIGSTOP)
        time.sleep(12)
        run.signal_daemon(signal.SIGCONT)
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["attempt"] == 1, run.status()
        assert not [i for i in run.incidents() if i.get("symptom") == "hang"], run.incidents()
    finally:
        run.signal_daemon(signal.SIGCONT) if run.proc and run.proc.poll() is None else None
        run.stop()


def test_daemon_sigterm_in_the_middle_of_an_operator_stop(tmp_path: Path) -> None:
    """`ulyssesctl stop`, then the daemon gets SIGTERM (detach) while the job is still saving on its
    SIGTERM; a new daemon re-adopts. The operator's stop is not lost: the run ends STOPPED, never
    relaunched, never COMPLETED."""
    job = _job("""\
import signal
stopping = []
signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
s = 0
while True:
    s += 1
    print(step_line(s), flush=True)
    if stopping:
        time.sleep(4)          # a slow final save
        print("saved", flush=True)
        sys.exit(0)
    time.sleep(0.1)
""", total=100000)
    run = make_run(tmp_path, job, stop_grace_s=30)
    try:
        run.start()
        run.wait_step(5, 60)
        rc, ans = run.ctl("stop", timeout=20)
        assert rc == 0, ans
        time.sleep(0.5)
        run.signal_daemon(signal.SIGTERM)
        run.wait_daemon(30)
        run.start()
        assert final_state(run, 90) == "STOPPED", run.daemon_output()[-3000:]
        assert run.status()["attempt"] == 1
    finally:
        run.stop()


# --------------------------------------------------------------------------------------------------------
# The run directory under the daemon's feet
# --------------------------------------------------------------------------------------------------------

def test_run_directory_deleted_mid_run(tmp_path: Path) -> None:
    """The run directory is removed (`rm -rf`) while the job trains. The daemon stays up and says so
    (an incident, or a state reason), and `ulyssesctl stop` still ends the run STOPPED."""
    import shutil

    job = _job(LONG_JOB, total=100000)
    run = make_run(tmp_path, job)
    try:
        run.start()
        run.wait_step(5, 60)
        shutil.rmtree(run.run_dir(), ignore_errors=True)
        time.sleep(5)
        assert run.proc is not None and run.proc.poll() is None, run.daemon_output()[-3000:]
        wait_for(lambda: run.incidents() or "run dir" in str(run.status().get("state_reason", "")), 30,
                 "the daemon to say that the run directory is gone")
        rc, ans = run.ctl("stop", timeout=20)
        assert rc == 0, ans
        assert final_state(run, 60) == "STOPPED"
    finally:
        run.stop()


def test_run_directory_made_read_only_for_a_while(tmp_path: Path) -> None:
    """chmod 0555 on the run directory for 8 s mid-run (an operator's mistake, a permission-fixing cron):
    the daemon's writes there fail with EACCES. The run is not ended; when the mode comes back, it goes on
    and completes."""
    job = _job("""\
for s in range(1, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.1)
""", total=200)
    run = make_run(tmp_path, job)
    rd = None
    try:
        run.start()
        run.wait_step(5, 60)
        rd = run.run_dir()
        mode = rd.stat().st_mode
        rd.chmod(0o555)
        time.sleep(8)
        rd.chmod(stat.S_IMODE(mode))
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["step"] == 200
    finally:
        if rd is not None and rd.exists():
            rd.chmod(0o755)
        run.stop()


# --------------------------------------------------------------------------------------------------------
# Hangs dressed as progress, and FIFOs where the daemon reads
# --------------------------------------------------------------------------------------------------------

def test_a_job_that_repeats_the_same_step_line_forever_is_a_hang(tmp_path: Path) -> None:
    """Stuck in a retry loop that re-prints its last step line every 50 ms: repeats are not progress, so
    the hang is found (a hang incident, a relaunch), not hidden by the chatter."""
    job = _job("""\
for s in range(1, 11):
    print(step_line(s), flush=True)
    time.sleep(0.2)
if os.environ["ULYSSESD_ATTEMPT"] == "1":
    while True:
        print(step_line(10), flush=True)
        time.sleep(0.05)
for s in range(11, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job, hang_floor_s=5)
    try:
        run.start()
        wait_for(lambda: [i for i in run.incidents() if i.get("symptom") == "hang"], 90,
                 "a hang incident for a job repeating its last step")
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
    finally:
        run.stop()


def test_stack_dump_file_replaced_by_a_fifo_before_a_hang(tmp_path: Path) -> None:
    """The job catches SIGUSR1 (so the hang path signals it) but its stack-dump file is a FIFO nobody
    writes to; then it hangs. The hang path must not block on the FIFO: the attempt is ended and the run
    relaunched, and it completes."""
    job = _job("""\
import signal
signal.signal(signal.SIGUSR1, lambda *a: None)
rd = os.environ["ULYSSESD_RUN_DIR"]
os.makedirs(os.path.join(rd, "stacks"), exist_ok=True)
fifo = os.path.join(rd, "stacks", "attempt-%s-rank-0.txt" % os.environ["ULYSSESD_ATTEMPT"])
if os.environ["ULYSSESD_ATTEMPT"] == "1" and not os.path.exists(fifo):
    os.mkfifo(fifo)
for s in range(1, 11):
    print(step_line(s), flush=True)
    time.sleep(0.2)
if os.environ["ULYSSESD_ATTEMPT"] == "1":
    time.sleep(3600)
for s in range(11, T + 1):
    print(step_line(s), flush=True)
    time.sleep(0.05)
""")
    run = make_run(tmp_path, job, hang_floor_s=5, daemon_extra="stack_dump_wait_s = 2")
    try:
        run.start()
        wait_for(lambda: [i for i in run.incidents() if i.get("symptom") == "hang"], 90, "a hang incident")
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
    finally:
        run.stop()


def test_fifo_at_the_exit_file_path_does_not_wedge_a_readopting_daemon(tmp_path: Path) -> None:
    """The job leaves a FIFO at attempts/1.exit; the daemon is SIGKILLed and started again. The new
    daemon re-adopts without blocking on the FIFO (status answers) and the run completes."""
    job = _job("""\
rd = os.environ["ULYSSESD_RUN_DIR"]
for s in range(1, T + 1):
    if s == 3:
        os.makedirs(os.path.join(rd, "attempts"), exist_ok=True)
        os.mkfifo(os.path.join(rd, "attempts", "1.exit"))
    print(step_line(s), flush=True)
    time.sleep(0.15)
""", total=120)
    run = make_run(tmp_path, job)
    try:
        run.start()
        run.wait_step(6, 60)
        run.signal_daemon(signal.SIGKILL)
        run.wait_daemon(20)
        run.start()
        assert final_state(run, 120) == "COMPLETED", run.daemon_output()[-3000:]
        assert run.status()["step"] == 120
    finally:
        run.stop()
