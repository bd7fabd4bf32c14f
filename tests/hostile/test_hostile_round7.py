"""Hostile round 7 (issue 31): an outside tester's probes of what an unattended week meets.

Written black-box from README.md, docs/ and --help only. Each probe runs a real `ulyssesd run` on a small
command job (a Python script the probe writes) with the `local` launcher, and asserts the behaviour the docs
promise. A probe that found a bug is `xfail(strict=True)` with the correct behaviour asserted, so a fix flips it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from r7kit import (
    FINAL,
    ULYSSESCTL,
    ULYSSESD,
    Daemon,
    ctl,
    incidents,
    job_spec,
    kill_probe,
    probe_pids,
    state_of,
    status,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.extended]

STEPS_JOB = """
import os, sys, time
T = {total}
for s in range(1, T + 1):
    print(f"step {{s}}/{{T}} loss {{3.0 - s * 0.01:.4f}}", flush=True)
    time.sleep({sleep})
"""


@pytest.fixture
def tmp(tmp_path: Path):
    yield tmp_path
    kill_probe(tmp_path)


def run_to_end(spec: Path, state: Path, timeout: float = 120, *args: str) -> tuple[int, Daemon]:
    d = Daemon(spec, state, *args)
    try:
        rc = d.wait(timeout)
    finally:
        d.stop()
    return rc, d


# ---------------------------------------------------------------- odd job output


def test_binary_garbage_between_step_lines_is_read_past(tmp: Path) -> None:
    """NUL bytes, invalid UTF-8 and random binary between step lines: the run still ends at its last step."""
    spec = job_spec(tmp, """
        import os, random, sys, time
        rnd = random.Random(7)
        out = sys.stdout.buffer
        for s in range(1, 31):
            out.write(bytes(rnd.randrange(256) for _ in range(300)) + b"\\n")
            out.write(b"\\x00\\xff\\xfe garbage \\xc3\\x28 \\n")
            out.write(f"step {s}/30 loss {3.0 - s * 0.01:.4f}\\n".encode()); out.flush()
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    assert rc == 0 and st["state"] == "COMPLETED", st.get("state_reason")
    assert st["step"] == 30


def test_eight_mib_line_without_newline_for_a_while_does_not_blind(tmp: Path) -> None:
    """A 8 MiB line (a tensor dumped by print) between steps: the steps after it are still read."""
    spec = job_spec(tmp, """
        import sys, time
        for s in range(1, 41):
            if s == 10:
                sys.stdout.write("x" * (8 << 20)); sys.stdout.flush(); time.sleep(1); print()
            print(f"step {s}/40 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED" and st["step"] == 40, st.get("state_reason")


def test_interleaved_ranks_in_random_order_judge_rank0_only(tmp: Path) -> None:
    """Two ranks print their own (finite, tenfold different) losses in random order under `[rankN]:` prefixes.

    docs/CLIENT.md: prefixes are stripped and only the lowest rank's losses count, so the interleaving must not
    read as an oscillating or spiking loss.
    """
    spec = job_spec(tmp, """
        import random, time
        rnd = random.Random(3)
        for s in range(1, 61):
            lines = [f"[rank0]: step {s}/60 loss {3.0 - s * 0.01:.4f}",
                     f"[rank1]: step {s}/60 loss {30.0 - s * 0.1:.4f}"]
            rnd.shuffle(lines)
            for ln in lines:
                print(ln, flush=True)
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert st["state"] == "COMPLETED" and st["step"] == 60, (st.get("state_reason"), kinds)
    assert not any(k and "loss" in k for k in kinds), kinds
    assert st["loss"] is not None and st["loss"] < 3.0, st["loss"]


def test_step_counter_that_resets_each_epoch_keeps_the_run_alive(tmp: Path) -> None:
    """Per-epoch step counters (1..15, then 1..15 again): a reset is an event, the run completes, no hang."""
    spec = job_spec(tmp, """
        import time
        for ep in range(3):
            for s in range(1, 16):
                print(f"step {s} loss {3.0 - (ep * 15 + s) * 0.01:.4f}", flush=True)
                time.sleep(0.05)
    """, detectors="warmup_steps = 3\nhang_timeout_floor_s = 20")
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert st["state"] == "COMPLETED", (st.get("state_reason"), kinds)
    assert "hang" not in kinds
    assert st["telemetry_health"]["step_records"] >= 40, st["telemetry_health"]


def test_utf16_log_is_loud_not_healthy(tmp: Path) -> None:
    """A job whose log is UTF-16 (a Windows-born logger): no step is understood, so the completion says so."""
    spec = job_spec(tmp, """
        import sys, time
        for s in range(1, 21):
            sys.stdout.buffer.write(f"step {s}/20 loss {3.0 - s * 0.01:.4f}\\n".encode("utf-16")); sys.stdout.flush()
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    # Either it reads them (steps 20) or it says it could not (no_progress warning). Never a silent "healthy".
    assert st["step"] == 20 or "no_progress" in kinds, (st.get("state_reason"), kinds, st["telemetry_health"])


def test_latin1_and_cjk_text_around_step_lines(tmp: Path) -> None:
    """Step lines carrying Latin-1 bytes and CJK words (`Verlust`, `損失`) are still step records."""
    spec = job_spec(tmp, """
        import sys, time
        out = sys.stdout.buffer
        for s in range(1, 21):
            out.write(f"Schritt \\xe4 {s}: ".encode("latin-1") + f"step {s}/20 loss {3.0 - s * 0.01:.4f} 損失\\n".encode())
            out.flush(); time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED" and st["step"] == 20, (st.get("state_reason"), st["telemetry_health"])


def test_crlf_line_endings(tmp: Path) -> None:
    """A log with Windows line endings: every step read, the run ends at its last step."""
    spec = job_spec(tmp, """
        import sys, time
        for s in range(1, 21):
            sys.stdout.buffer.write(f"step {s}/20 loss {3.0 - s * 0.01:.4f}\\r\\n".encode()); sys.stdout.flush()
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED" and st["step"] == 20, (st.get("state_reason"), st["telemetry_health"])


def test_job_that_closes_stdout_and_reports_on_stderr(tmp: Path) -> None:
    """The job closes fd 1 after step 5 and prints the rest to stderr: stderr is in the attempt log too."""
    spec = job_spec(tmp, """
        import os, sys, time
        for s in range(1, 31):
            if s == 6:
                sys.stdout.flush(); os.close(1)
            f = sys.stdout if s < 6 else sys.stderr
            print(f"step {s}/30 loss {3.0 - s * 0.01:.4f}", file=f, flush=True)
            time.sleep(0.05)
        os._exit(0)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED" and st["step"] == 30, (st.get("state_reason"), st["telemetry_health"])


def test_step_counter_running_backwards_then_jump_is_not_a_completion_short(tmp: Path) -> None:
    """An in-job rollback (steps 1..20, back to 10, on to 30): the run completes at 30, not 'short of total'."""
    spec = job_spec(tmp, """
        import time
        seq = list(range(1, 21)) + list(range(10, 31))
        for s in seq:
            print(f"step {s}/30 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED" and st["step"] == 30, (st.get("state_reason"), st["telemetry_health"])
    assert "before its declared total" not in (st.get("state_reason") or "")


# ---------------------------------------------------------------- process trouble


def test_double_forked_daemon_of_the_job_does_not_outlive_the_run(tmp: Path) -> None:
    """The job starts a setsid'd, double-forked helper (a metrics pusher) and exits 0: it must not survive.

    docs/DAEMON.md: after every attempt the daemon checks that none of the attempt's processes survives.
    """
    spec = job_spec(tmp, """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                for fd in (0, 1, 2):
                    os.close(fd)
                open(os.environ["R7_PROBE"] + "/helper.pid", "w").write(str(os.getpid()))
                time.sleep(600)
            os._exit(0)
        for s in range(1, 21):
            print(f"step {s}/20 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    assert state_of(tmp / "state") == "COMPLETED"
    helper = int((tmp / "helper.pid").read_text())
    wait_for(lambda: not Path(f"/proc/{helper}").exists() or "Z" in Path(f"/proc/{helper}/stat").read_text().split(")")[1][:3],
             20, f"the job's double-forked helper {helper} to be gone")


def test_grandchild_holding_stdout_open_does_not_hold_the_run(tmp: Path) -> None:
    """The job exits 0 but a child it started keeps its stdout open (and quiet): the run still ends."""
    spec = job_spec(tmp, """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        for s in range(1, 21):
            print(f"step {s}/20 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
    """)
    rc, _ = run_to_end(spec, tmp / "state", 150)
    assert state_of(tmp / "state") == "COMPLETED"
    wait_for(lambda: not probe_pids(tmp), 20, "no process of the job left")


def test_job_ignoring_sigterm_is_stopped_within_its_grace(tmp: Path) -> None:
    """`ulyssesctl stop` on a job that ignores SIGTERM: STOPPED after stop_grace_s (then SIGKILL), no process left."""
    spec = job_spec(tmp, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for s in range(1, 100000):
            print(f"step {s} loss {3.0 - s * 1e-5:.5f}", flush=True)
            time.sleep(0.1)
    """, daemon="preflight = false\nstop_grace_s = 5")
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 5, 60, "step 5")
        p = d.ctl("stop")
        assert p.returncode == 0, p.stdout + p.stderr
        rc = d.wait(60)
    finally:
        d.stop()
    assert rc == 0 and state_of(tmp / "state") == "STOPPED"
    wait_for(lambda: not probe_pids(tmp), 10, "the SIGTERM-ignoring job to be gone")


def test_sigstopped_job_is_a_hang_and_is_relaunched(tmp: Path) -> None:
    """The job is SIGSTOPped at step 10 (a frozen process: cgroup freezer, a debugger left attached).

    The hang detector must fire, SIGTERM cannot reach a stopped process, so it must end in SIGKILL; the next
    attempt completes.
    """
    spec = job_spec(tmp, """
        import os, signal, time
        for s in range(1, 31):
            print(f"step {s}/30 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
            if s == 10 and os.environ.get("ULYSSESD_ATTEMPT") == "1":
                os.kill(os.getpid(), signal.SIGSTOP)
    """, detectors="warmup_steps = 3\nhang_timeout_floor_s = 8", daemon="preflight = false\nhang_grace_s = 3\nstop_grace_s = 5")
    rc, _ = run_to_end(spec, tmp / "state", 180)
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert st["state"] == "COMPLETED" and st["step"] == 30, (st.get("state_reason"), kinds)
    assert "hang" in kinds and st["attempt"] == 2, kinds


def test_unreaped_zombie_children_do_not_confuse_the_rank_watch(tmp: Path) -> None:
    """The job leaves 30 zombie children (never waited for) and trains on: the run completes, no crash found."""
    spec = job_spec(tmp, """
        import os, time
        kids = []
        for i in range(30):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            kids.append(pid)
        for s in range(1, 31):
            print(f"step {s}/30 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.1)
    """)
    rc, _ = run_to_end(spec, tmp / "state")
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert st["state"] == "COMPLETED" and st["step"] == 30 and st["attempt"] == 1, (st.get("state_reason"), kinds)


# ---------------------------------------------------------------- operator mistakes


def test_second_daemon_on_the_same_state_dir_exits_12_and_leaves_the_first_alone(tmp: Path) -> None:
    spec = job_spec(tmp, STEPS_JOB.format(total=100000, sleep=0.1), daemon="preflight = false\nstop_grace_s = 5")
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 3, 60, "step 3")
        p = subprocess.run([ULYSSESD, "run", "--spec", str(spec), "--state-dir", str(tmp / "state")],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 12, p.stdout[-2000:] + p.stderr[-2000:]
        assert state_of(tmp / "state") == "RUNNING" and d.proc.poll() is None
        assert d.ctl("stop").returncode == 0
        assert d.wait(120) == 0
    finally:
        d.stop()
    assert state_of(tmp / "state") == "STOPPED"


def test_readopting_with_an_edited_spec_never_runs_two_jobs(tmp: Path) -> None:
    """Detach the daemon (SIGTERM), edit the spec (a detector value), start it again.

    Whatever the daemon decides (re-adopt, or a new run), two copies of the job must never train at once:
    they would write the same checkpoint_dir. The job takes an exclusive flock and records a clash.
    """
    spec = job_spec(tmp, """
        import fcntl, os, time
        fd = os.open(os.environ["R7_PROBE"] + "/job.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            open(os.environ["R7_PROBE"] + "/CLASH", "a").write(f"{os.getpid()}\\n")
            fcntl.flock(fd, fcntl.LOCK_EX)
        for s in range(1, 81):
            print(f"step {s}/80 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.1)
    """)
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 5, 60, "step 5")
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait(60) == 0
    finally:
        d.stop()
    spec.write_text(spec.read_text().replace("warmup_steps = 3", "warmup_steps = 4"))
    d2 = Daemon(spec, tmp / "state")
    try:
        d2.wait(150)
    finally:
        d2.stop()
    assert not (tmp / "CLASH").exists(), "a second copy of the job was started while the first still trained"


def test_operator_commands_in_odd_orders(tmp: Path) -> None:
    """resume while RUNNING, pause twice, restart while PAUSED, ack of a missing incident, stop while PAUSED."""
    spec = job_spec(tmp, STEPS_JOB.format(total=100000, sleep=0.1), daemon="preflight = false\nstop_grace_s = 5")
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 3, 60, "step 3")
        assert d.ctl("resume").returncode == 5
        assert d.ctl("ack", "999999").returncode in (4, 5)
        p1 = d.ctl("pause")
        p2 = d.ctl("pause")
        assert p1.returncode == 0, p1.stdout + p1.stderr
        assert p2.returncode in (0, 5), p2.stdout + p2.stderr
        wait_for(lambda: state_of(tmp / "state") == "PAUSED", 60, "PAUSED")
        r = d.ctl("restart")
        assert r.returncode in (0, 5), r.stdout + r.stderr
        wait_for(lambda: state_of(tmp / "state") in ("PAUSED", "RUNNING"), 60, "PAUSED or RUNNING after restart")
        assert d.ctl("stop").returncode == 0
        assert d.wait(60) == 0
    finally:
        d.stop()
    assert state_of(tmp / "state") == "STOPPED"
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert "internal_error" not in kinds, kinds


@pytest.mark.xfail(strict=False, reason=(
    "intermittent (failed 2 of 3 runs): among 12 concurrent ctl calls a `pause` was answered exit 3 'ulyssesd is not "
    "running: no control socket at STATE/ulyssesd.sock (this command needs a running daemon)' while the daemon "
    "ran and answered the others"))
def test_concurrent_ctl_calls_leave_a_consistent_run(tmp: Path) -> None:
    """Twelve ctl calls at once (pause, resume, restart, status, ack): every answer a documented code, no
    internal error, and after a final resume the run completes."""
    spec = job_spec(tmp, STEPS_JOB.format(total=150, sleep=0.1), daemon="preflight = false\nstop_grace_s = 5")
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 3, 60, "step 3")
        cmds = ["pause", "resume", "restart", "status", "pause", "ack", "resume", "status", "restart", "pause",
                "runs", "resume"]
        procs = [subprocess.Popen([ULYSSESCTL, "--state-dir", str(tmp / "state"), c, *(["1"] if c == "ack" else [])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
        codes = [(c, p.wait(90), p.stderr.read()[-300:]) for c, p in zip(cmds, procs, strict=True)]
        assert all(rc in (0, 4, 5, 7) for _, rc, _ in codes), codes
        assert not any("Traceback" in err for _, _, err in codes), codes
        def settle() -> bool:
            s = state_of(tmp / "state")
            if s == "PAUSED":
                d.ctl("resume")
            return s in ("RUNNING", *FINAL)
        wait_for(settle, 90, "the run back to RUNNING", every=1.0)
        rc = d.wait(240)
    finally:
        d.stop()
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert rc == 0 and state_of(tmp / "state") == "COMPLETED", kinds
    assert "internal_error" not in kinds, kinds


def test_missing_program_fails_bounded_and_named(tmp: Path) -> None:
    """`command = ["trian.py"]` (a typo): the run ends FAILED in bounded time and the record names the file."""
    spec = job_spec(tmp, STEPS_JOB.format(total=10, sleep=0.01),
                    daemon="preflight = false\nbackoff_base_s = 0.5\nbackoff_max_s = 2")
    spec.write_text(spec.read_text().replace('command = ["job.py"]', 'command = ["/nonexistent/trian.py"]'))
    d = Daemon(spec, tmp / "state")
    try:
        rc = d.wait(240)
    finally:
        d.stop()
    st = status(tmp / "state")
    text = json.dumps(incidents(tmp / "state")) + (st.get("state_reason") or "") + d.output()
    assert rc in (2, 10), d.output()[-2000:]
    assert "trian.py" in text


# ---------------------------------------------------------------- file-system trouble

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@pytest.fixture
def mounts(tmp: Path):
    from r7kit import mount_tmpfs, umount_lazy
    made: list[Path] = []

    def mount(path: Path, size: str, *opts: str) -> Path:
        mount_tmpfs(path, size, *opts)
        made.append(path)
        return path
    yield mount
    kill_probe(tmp)
    for p in reversed(made):
        umount_lazy(p)


@needs_root
def test_state_disk_full_for_a_while_is_survived(tmp: Path, mounts) -> None:
    """Another tenant fills the state dir's 16 MiB disk at step 10 and frees it 10 s later.

    The job's own prints fail on the full disk and it dies; the daemon cannot write either. Once the space
    is back the run must go on and complete (docs/DAEMON.md: retried with backoff, at most 6 tries).
    """
    state = mounts(tmp / "state", "16m")
    spec = job_spec(tmp, STEPS_JOB.format(total=60, sleep=0.1),
                    daemon="preflight = false\nbackoff_base_s = 2\nbackoff_max_s = 8")
    d = Daemon(spec, state)
    filler = state / "filler.bin"
    try:
        wait_for(lambda: (status(state).get("step") or 0) >= 10, 60, "step 10")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        time.sleep(10)
        ans = ctl(state, "status", "--json")
        filler.unlink()
        rc = d.wait(240)
    finally:
        d.stop()
    st = status(state)
    assert ans.returncode in (0, 7) and "Traceback" not in ans.stderr, ans.stderr[-2000:]
    assert rc == 0 and st["state"] == "COMPLETED" and st["step"] == 60, (st.get("state_reason"), d.output()[-3000:])


@needs_root
def test_read_only_checkpoint_dir_of_a_command_job_stops_cleanly(tmp: Path, mounts) -> None:
    """The command job's checkpoint_dir is on a read-only mount; its save at step 5 raises EROFS.

    A relaunch cannot help: docs/DAEMON.md promises a clean stop with a reason naming the read-only file
    system, not a crash loop through the restart budget.
    """
    ck = mounts(tmp / "ck", "4m")
    subprocess.run(["mount", "-o", "remount,ro", str(ck)], check=True)
    spec = job_spec(tmp, f"""
        import os, time
        for s in range(1, 31):
            print(f"step {{s}}/30 loss {{3.0 - s * 0.01:.4f}}", flush=True)
            if s % 5 == 0:
                os.makedirs("{ck}/step_%06d" % s)
            time.sleep(0.05)
    """, job=f'checkpoint_dir = "{ck}"', daemon="preflight = false\nbackoff_base_s = 0.5\nbackoff_max_s = 2")
    rc, d = run_to_end(spec, tmp / "state", 240)
    st = status(tmp / "state")
    text = (st.get("state_reason") or "") + json.dumps(incidents(tmp / "state"))
    assert st["state"] == "FAILED" and "read-only" in text.lower(), (st.get("state_reason"), st["restarts"])
    assert st["restarts"] <= 1, f"{st['restarts']} restarts on a read-only checkpoint disk"


@needs_root
def test_symlinked_checkpoint_entry_never_deletes_outside(tmp: Path) -> None:
    """A `step_000001` symlink in checkpoint_dir points at a folder outside it (a dataset); keep_last = 1.

    Retention and room-making may drop the link, never the files it points at.
    """
    victim = tmp / "dataset"
    victim.mkdir()
    (victim / "shard-0.bin").write_bytes(b"\1" * 4096)
    ck = tmp / "ck"
    ck.mkdir()
    os.symlink(victim, ck / "step_000001")
    spec = job_spec(tmp, f"""
        import os, time
        for s in range(1, 41):
            print(f"step {{s}}/40 loss {{3.0 - s * 0.01:.4f}}", flush=True)
            if s % 5 == 0:
                d = "{ck}/step_%06d" % s
                os.makedirs(d, exist_ok=True)
                open(d + "/model.bin", "wb").write(b"x" * 1000)
            time.sleep(0.15)
    """, job=f'checkpoint_dir = "{ck}"', extra="[checkpoint]\nkeep_last = 1\n")
    rc, d = run_to_end(spec, tmp / "state", 120, "--no-preflight")
    assert state_of(tmp / "state") == "COMPLETED", d.output()[-2000:]
    assert (victim / "shard-0.bin").exists(), "retention deleted files outside checkpoint_dir through a symlink"
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert "internal_error" not in kinds, kinds


def _run_dir(state: Path) -> Path:
    return wait_for(lambda: next(iter((state / "runs").glob("*")), None) if (state / "runs").exists() else None,
                    30, "the run dir")


@pytest.mark.parametrize("then_mkdir", [
    False,
    True,
], ids=["rm", "rm-then-mkdir"])
def test_attempt_log_removed_mid_run(tmp: Path, then_mkdir: bool) -> None:
    """A tmp cleaner removes logs/attempt-1.log mid-run (and, in the second case, a careless `mkdir -p` puts a
    directory there). docs/CLIENT.md: the daemon holds the log open, so it reads on from the file the job still
    writes: the run completes at its real last step, not "before its declared total"."""
    spec = job_spec(tmp, STEPS_JOB.format(total=300, sleep=0.1))
    d = Daemon(spec, tmp / "state")
    try:
        run = _run_dir(tmp / "state")
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 10, 60, "step 10")
        log = run / "logs" / "attempt-1.log"
        log.unlink()
        if then_mkdir:
            log.mkdir()
        rc = d.wait(180)
    finally:
        d.stop()
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert "hang" not in kinds, kinds
    assert rc == 0 and st["state"] == "COMPLETED" and st["step"] == 300, (st.get("state_reason"), kinds)


def test_stdout_telemetry_file_replaced_by_a_directory_mid_run(tmp: Path) -> None:
    """{run_dir}/telemetry-stdout.jsonl becomes a directory mid-run (a bad restore script): a healthy job must
    not be ended for it; the daemon says so and the run completes at its last step."""
    spec = job_spec(tmp, STEPS_JOB.format(total=300, sleep=0.1))
    d = Daemon(spec, tmp / "state")
    try:
        run = _run_dir(tmp / "state")
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 10, 60, "step 10")
        tel = run / "telemetry-stdout.jsonl"
        tel.unlink()
        tel.mkdir()
        d.wait(180)
    finally:
        d.stop()
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED", (st.get("state_reason"), [i.get("summary") for i in incidents(tmp / "state")])


def test_daemon_json_replaced_by_a_directory_status_still_answers(tmp: Path) -> None:
    """ulyssesd.daemon.json becomes a directory mid-run: status still answers, and the daemon's exit at the
    run's end is its documented 0 (COMPLETED), not a traceback and 1."""
    spec = job_spec(tmp, STEPS_JOB.format(total=60, sleep=0.1))
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 5, 60, "step 5")
        dj = tmp / "state" / "ulyssesd.daemon.json"
        if dj.exists():
            dj.unlink()
        dj.mkdir()
        p = ctl(tmp / "state", "status", "--json")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert json.loads(p.stdout)["state"] == "RUNNING"
        rc = d.wait(120)
    finally:
        d.stop()
    assert state_of(tmp / "state") == "COMPLETED"
    assert rc == 0 and "Traceback" not in d.output(), d.output()[-2000:]


def test_lock_path_is_a_directory_gives_a_clear_error(tmp: Path) -> None:
    """`{state_dir}/ulyssesd.lock` is a directory (a bad tmpfiles.d line): one clear line, no traceback."""
    (tmp / "state").mkdir()
    (tmp / "state" / "ulyssesd.lock").mkdir()
    spec = job_spec(tmp, STEPS_JOB.format(total=5, sleep=0.01))
    p = subprocess.run([ULYSSESD, "run", "--spec", str(spec), "--state-dir", str(tmp / "state")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    assert "ulyssesd.lock" in p.stdout + p.stderr


@needs_root
def test_builtin_preflight_refuses_a_tiny_checkpoint_disk(tmp: Path, mounts) -> None:
    """configs/tiny-cpu.toml with its checkpoints on an 8 MiB tmpfs: exit 11 with what fits (docs)."""
    ck = mounts(tmp / "ck", "8m")
    src = (Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml").read_text()
    spec = tmp / "tiny.toml"
    spec.write_text(src.replace("[checkpoint]", f'[checkpoint]\ndir = "{ck}"'))
    p = subprocess.run([ULYSSESD, "run", "--spec", str(spec), "--state-dir", str(tmp / "state")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 11, (p.stdout + p.stderr)[-3000:]
    assert "What fits" in p.stdout + p.stderr


@needs_root
def test_builtin_preflight_refuses_a_read_only_checkpoint_disk(tmp: Path, mounts) -> None:
    """The tiny run's checkpoint dir is on a read-only mount with plenty of room: refuse before launch
    (exit 11, naming read-only), rather than train to the first save and fail there."""
    ck = mounts(tmp / "ck", "512m")
    subprocess.run(["mount", "-o", "remount,ro", str(ck)], check=True)
    src = (Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml").read_text()
    spec = tmp / "tiny.toml"
    spec.write_text(src.replace("[checkpoint]", f'[checkpoint]\ndir = "{ck}"') + "\n[daemon]\nmin_free_gib = 0\n")
    d = Daemon(spec, tmp / "state")
    try:
        rc = d.wait(300)
    finally:
        d.stop()
    out = d.output()
    # exit 2 ("not readable and writable", nothing started) or 11 (preflight): both refuse before launch.
    assert rc in (2, 11) and ("read-only" in out.lower() or "writable" in out.lower()), (rc, out[-3000:])


def test_log_flood_is_capped_and_no_step_is_lost(tmp: Path) -> None:
    """A job that spews ~24 MiB of warnings between its steps, with `[daemon] attempt_log_max_mib = 2`: the
    attempt log stays bounded (<= 1.5x the cap, docs/DAEMON.md) and every step line is still read."""
    spec = job_spec(tmp, """
        import sys, time
        junk = ("W" * 1023 + "\\n") * 1024
        for s in range(1, 61):
            if s % 5 == 0:
                for _ in range(2):
                    sys.stdout.write(junk)
            print(f"step {s}/60 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
    """, daemon="preflight = false\nattempt_log_max_mib = 2")
    rc, _ = run_to_end(spec, tmp / "state", 180)
    st = status(tmp / "state")
    assert st["state"] == "COMPLETED" and st["step"] == 60, st.get("state_reason")
    assert st["telemetry_health"]["step_records"] == 60, st["telemetry_health"]
    logs = Path(st["run_dir"]) / "logs"
    size = sum(f.stat().st_size for f in logs.glob("attempt-1.log*"))
    assert size <= 3 * (1 << 20) + (1 << 20), f"attempt logs hold {size} bytes for a 2 MiB cap"


# ---------------------------------------------------------------- clock jumps (libfaketime, the daemon only)

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


@pytest.mark.skipif(not FAKETIME_LIB.exists(), reason="libfaketime not installed")
@pytest.mark.parametrize("jump", [
    "+0",
    "-3600",
], ids=["no-jump-control", "back-1h"])
def test_wall_clock_stepped_back_an_hour_does_not_blind_the_hang_detector(tmp: Path, jump: str) -> None:
    """NTP steps the daemon's wall clock back one hour (a VM resumed, a bad time server) at step 10, and the job
    hangs right there. The hang must still be found on its timescale (floor 8 s), not an hour later. The
    control (`+0`) runs the same under libfaketime without a jump."""
    offset = tmp / "faketime"
    offset.write_text("+0\n")
    env = {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1",
           "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    spec = job_spec(tmp, """
        import os, sys, time
        if os.environ.pop("LD_PRELOAD", None):  # only the daemon's clock jumps, not the job's
            os.execv(sys.executable, [sys.executable, *sys.argv])
        for s in range(1, 31):
            print(f"step {s}/30 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.1)
            if s == 10 and os.environ.get("ULYSSESD_ATTEMPT") == "1":
                while not os.path.exists(os.environ["R7_PROBE"] + "/jumped"):
                    time.sleep(0.05)
                time.sleep(3600)
    """, detectors="warmup_steps = 3\nhang_timeout_floor_s = 8", daemon="preflight = false\nhang_grace_s = 3\nstop_grace_s = 3")
    d = Daemon(spec, tmp / "state", env=env)
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 10, 60, "step 10")
        offset.write_text(jump + "\n")
        (tmp / "jumped").touch()
        found = wait_for(lambda: "hang" in [i.get("symptom") for i in incidents(tmp / "state")], 120,
                         "a hang incident after the clock stepped back", every=1.0)
        assert found
        d.ctl("stop")
        d.wait(60)
    finally:
        d.stop()


# ---------------------------------------------------------------- spec values and the new settings


BAD_SPECS = {
    "total_steps_zero": ("[job]", "[job]\ntotal_steps = 0"),
    "total_steps_negative": ("[job]", "[job]\ntotal_steps = -5"),
    "hang_floor_nan": ("[detectors]", "[detectors]\nhang_timeout_floor_s = nan"),
    "stop_grace_negative": ("[daemon]", "[daemon]\nstop_grace_s = -1"),
    "attempt_log_cap_zero": ("[daemon]", "[daemon]\nattempt_log_max_mib = 0"),
    "silent_after_1s": ("[telemetry]", "[telemetry]\nsilent_after_s = 1"),
    "empty_command": ('command = ["job.py"]', "command = []"),
    "empty_program": ('command = ["job.py"]', 'command = [""]'),
    "inner_torchrun_on_local": ("[launcher]", '[launcher]\ninner_restarts = "torchrun"'),
    "inner_mode_typo": ("[launcher]", '[launcher]\ninner_restarts = "torchrunn"'),
    "in_process_without_tier": ("[run]", "[checkpoint]\nin_process_restart = true\n\n[run]"),
    "memory_interval_negative": ("[run]", "[checkpoint]\nmemory_tier = true\nmemory_interval_steps = -1\n\n[run]"),
    "pattern_without_loss_group": ('source = "stdout"', 'source = "stdout"\npattern = \'it#(?P<step>\\d+)\''),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_spec_values_are_refused_with_the_key(tmp: Path, case: str) -> None:
    """Each wrong value: exit 2 before anything runs, one message naming the key, no traceback."""
    spec = job_spec(tmp, STEPS_JOB.format(total=5, sleep=0.01))
    old, new = BAD_SPECS[case]
    text = spec.read_text()
    assert old in text
    spec.write_text(text.replace(old, new, 1))
    p = subprocess.run([ULYSSESD, "run", "--spec", str(spec), "--state-dir", str(tmp / "state")],
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert not probe_pids(tmp)


def test_memory_tier_on_a_command_job_is_not_silently_ignored(tmp: Path) -> None:
    """`[checkpoint] memory_tier = true` is the built-in job's feature; on a command job it cannot take effect.

    Unknown is loud: either the spec is refused naming it, or the daemon says it does not reach the job.
    """
    spec = job_spec(tmp, STEPS_JOB.format(total=10, sleep=0.01),
                    extra="[checkpoint]\nmemory_tier = true\nin_process_restart = true\n")
    p = subprocess.run([ULYSSESD, "run", "--spec", str(spec), "--state-dir", str(tmp / "state")],
                       capture_output=True, text=True, timeout=120)
    out = (p.stdout + p.stderr).replace(str(tmp), "TMP")  # the tmp dir's name holds the test's name
    assert p.returncode == 2 or "memory_tier" in out, out[-3000:]


def test_nvrx_mode_without_nvrx_installed_is_loud_and_bounded(tmp: Path) -> None:
    """`inner_restarts = "nvrx"` on a host without nvidia-resiliency-ext: refused at load, or the run ends
    FAILED quickly with the missing module named, never a crash loop that blames the job."""
    spec = job_spec(tmp, STEPS_JOB.format(total=10, sleep=0.01),
                    launcher='kind = "torchrun"\nnproc_per_node = 1\ninner_restarts = "nvrx"',
                    daemon="preflight = false\nbackoff_base_s = 0.5\nbackoff_max_s = 2")
    d = Daemon(spec, tmp / "state")
    try:
        rc = d.wait(300)
    finally:
        d.stop()
    st = status(tmp / "state")
    text = d.output() + json.dumps(incidents(tmp / "state")) + (st.get("state_reason") or "")
    assert rc in (2, 10), d.output()[-2000:]
    assert "nvidia_resiliency_ext" in text or "nvidia-resiliency-ext" in text


def test_torchrun_inner_restart_is_recorded_not_counted(tmp: Path) -> None:
    """`inner_restarts = "torchrun"`: the worker crashes once (first inner try); torchrun restarts it. The
    daemon records one `inner_restart`, counts no daemon restart, and the run completes."""
    spec = job_spec(tmp, """
        import os, sys, time
        for s in range(1, 21):
            print(f"step {s}/20 loss {3.0 - s * 0.01:.4f}", flush=True)
            time.sleep(0.05)
            if s == 8 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                sys.exit(1)
    """, launcher='kind = "torchrun"\nnproc_per_node = 1\ninner_restarts = "torchrun"\ninner_max_restarts = 2')
    rc, d = run_to_end(spec, tmp / "state", 240)
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert st["state"] == "COMPLETED" and st["step"] == 20, (st.get("state_reason"), kinds)
    assert st["restarts"] == 0 and kinds.count("inner_restart") == 1, (st["restarts"], kinds)


# ---------------------------------------------------------------- the new commands: simulate, tune, plan


def _cli(*argv: str, timeout: float = 60) -> tuple[int | None, str]:
    """Run a command; (exit code or None when it ran past `timeout`, its output)."""
    p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out


def test_simulate_short_run_holds_its_invariants(tmp: Path) -> None:
    rc, out = _cli(ULYSSESD, "simulate", "--seed", "11", "--runs", "1", "--days", "0.05", "--out", str(tmp / "v"),
                   timeout=300)
    assert rc == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary.get("violations") in (0, [], None) or not summary.get("violations"), summary


@pytest.mark.parametrize("days", ["inf", "1e300"])
def test_simulate_refuses_an_unbounded_number_of_days(days: str) -> None:
    rc, out = _cli(ULYSSESD, "simulate", "--runs", "1", "--days", days, timeout=30)
    assert rc == 2, f"exit {rc} after 30 s: {out[-500:]}"


@pytest.mark.parametrize("content", [b'{"seed": 1, "faults": [1, 2', b'{"seed": "x", "faults": "no"}',
                                     bytes(range(256)) * 40], ids=["truncated", "wrong-types", "binary"])
def test_simulate_replay_of_a_damaged_trace_is_one_line(tmp: Path, content: bytes) -> None:
    trace = tmp / "violation-seed-1.json"
    trace.write_bytes(content)
    rc, out = _cli(ULYSSESD, "simulate", "--replay", str(trace), timeout=60)
    assert rc == 2 and "Traceback" not in out, out[-1500:]
    assert str(trace) in out or trace.name in out


def test_simulate_replay_of_a_fifo_does_not_block(tmp: Path) -> None:
    fifo = tmp / "trace.json"
    os.mkfifo(fifo)
    rc, out = _cli(ULYSSESD, "simulate", "--replay", str(fifo), timeout=30)
    assert rc is not None and rc != 0, "still blocked after 30 s"


def test_tune_fits_a_stdout_telemetry_run(tmp: Path) -> None:
    spec = job_spec(tmp, STEPS_JOB.format(total=150, sleep=0.02))
    rc, _ = run_to_end(spec, tmp / "state", 120)
    assert state_of(tmp / "state") == "COMPLETED"
    p = ctl(tmp / "state", "tune")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "150" in p.stdout, p.stdout


def test_tune_names_what_is_wrong_with_a_non_regular_file(tmp: Path) -> None:
    fifo = tmp / "t.jsonl"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero", str(tmp)):
        rc, out = _cli(ULYSSESCTL, "tune", "--telemetry", path, timeout=30)
        assert rc not in (None, 0), out
        assert "does not exist" not in out and "regular file" in out, out


@pytest.mark.xfail(strict=True, reason=(
    "`ulyssesctl plan --spec` of a command-job spec plans the built-in default 'tiny' model (213,568 params) "
    "and says FITS with exit 0: a CI gate passes on a model the planner never saw"))
def test_plan_of_a_command_job_does_not_claim_it_fits(tmp: Path) -> None:
    spec = job_spec(tmp, STEPS_JOB.format(total=5, sleep=0.01))
    rc, out = _cli(ULYSSESCTL, "plan", "--spec", str(spec), "--gpu", "h100-80g", timeout=120)
    assert rc == 2, f"exit {rc}: {out[:600]}"
    assert "command" in out.replace(str(tmp), "TMP")


# ---------------------------------------------------------------- more of a week: the daemon itself stalls, the
# spec is edited, a small checkpoint disk under a command job


def test_daemon_sigstopped_for_a_while_does_not_call_a_healthy_job_hung(tmp: Path) -> None:
    """Ctrl-Z on the daemon (or a host stall) for 25 s while the job trains on, with an 8 s hang floor.

    On SIGCONT the daemon reads the backlog: the job never stopped, so no hang incident and no kill.
    """
    spec = job_spec(tmp, STEPS_JOB.format(total=500, sleep=0.1),
                    detectors="warmup_steps = 3\nhang_timeout_floor_s = 8", daemon="preflight = false\nhang_grace_s = 3")
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 20, 60, "step 20")
        os.kill(d.proc.pid, signal.SIGSTOP)
        time.sleep(25)
        stalled = ctl(tmp / "state", "status", "--json", timeout=60)
        os.kill(d.proc.pid, signal.SIGCONT)
        rc = d.wait(180)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT) if d.proc.poll() is None else None
        d.stop()
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    assert stalled.returncode == 7, (stalled.returncode, stalled.stdout[-500:])
    assert "hang" not in kinds, kinds
    assert rc == 0 and st["state"] == "COMPLETED" and st["attempt"] == 1, (st.get("state_reason"), kinds)


def test_spec_file_broken_while_running_then_operator_restart(tmp: Path) -> None:
    """The operator saves a half-edited spec (a TOML syntax error) while the run trains, then runs
    `ulyssesctl restart`: the run's own copy is what counts; attempt 2 starts and the run completes."""
    spec = job_spec(tmp, STEPS_JOB.format(total=80, sleep=0.1), daemon="preflight = false\nstop_grace_s = 5")
    d = Daemon(spec, tmp / "state")
    try:
        wait_for(lambda: (status(tmp / "state").get("step") or 0) >= 5, 60, "step 5")
        spec.write_text(spec.read_text() + "\n[detectors\nwarmup_steps = \n")
        p = d.ctl("restart")
        assert p.returncode == 0, p.stdout + p.stderr
        rc = d.wait(180)
    finally:
        d.stop()
    st = status(tmp / "state")
    assert rc == 0 and st["state"] == "COMPLETED" and st["attempt"] == 2, st.get("state_reason")


@needs_root
def test_command_job_on_a_small_checkpoint_disk_is_kept_within_it(tmp: Path, mounts) -> None:
    """A command job saves a 1.5 MiB `step_N/` every 5 steps into a 10 MiB tmpfs (keep_last = 2, no margin).

    docs/CHECKPOINT_DISK.md: retention keeps the directory to its budget, so the job never meets ENOSPC; if
    it does, the disk_full rung makes room and resumes. Either way the run completes at its last step and the
    newest save is on disk.
    """
    ck = mounts(tmp / "ck", "10m")
    spec = job_spec(tmp, f"""
        import os, sys, time
        start = 0
        if len(sys.argv) > 1 and sys.argv[1]:
            start = int(os.path.basename(sys.argv[1].rstrip("/")).split("_")[1])
        for s in range(start + 1, 61):
            print(f"step {{s}}/60 loss {{3.0 - s * 0.01:.4f}}", flush=True)
            if s % 5 == 0:
                d = "{ck}/step_%06d" % s
                os.makedirs(d, exist_ok=True)
                with open(d + "/model.bin", "wb") as f:
                    f.write(os.urandom(3 << 19))
                print(f"Saving model checkpoint to {{d}}", flush=True)
            time.sleep(0.3)
    """, job=f'checkpoint_dir = "{ck}"', extra="[checkpoint]\nkeep_last = 2\n",
        daemon="preflight = false\nmin_free_gib = 0\nset_aside_keep = 0\ncheckpoint_anchors = 1")
    spec.write_text(spec.read_text().replace('command = ["job.py"]', 'command = ["job.py", "{resume}"]'))
    rc, d = run_to_end(spec, tmp / "state", 240)
    st = status(tmp / "state")
    kinds = [i.get("symptom") for i in incidents(tmp / "state")]
    disk = (sorted(p.name for p in ck.iterdir()), os.statvfs(ck).f_bavail * os.statvfs(ck).f_frsize,
            st["checkpoint_disk"])
    prunes = [a for i in incidents(tmp / "state") for a in i.get("actions", []) if a.get("kind") == "prune"]
    assert st["state"] == "COMPLETED" and st["step"] == 60, (st.get("state_reason"), kinds, disk, prunes)
    assert (ck / "step_000060" / "model.bin").exists(), sorted(p.name for p in ck.iterdir())
