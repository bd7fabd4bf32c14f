"""`ulyssesctl runs` and `ulyssesctl logs` on real run directories: runs written by real fake-job supervised
runs; attempt logs written the way the daemon writes them (the launcher wrapper as the writer's parent, its
stdout+stderr in `logs/attempt-N.log`, the wrapper's exit file when it ends). The daemon is down throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.store.enums import RunState

CTL = Path(sys.executable).parent / "ulyssesctl"
DONE = (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)
# What torchrun (`[rankN]:`), torchrun --tee (`[defaultN]:`) and srun -l (`N: `) put before a rank's lines.
MIXED = (b"launcher: starting 2 ranks\n[rank0]:step 1 loss 2.0\n[rank1]:step 1 loss 2.1\n"
         b"[default1]:Traceback (most recent call last):\n1: srun-labelled line\n 0: padded rank 0\n"
         b"[rank1]:RuntimeError: boom\nlauncher: done\n")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A state dir with two finished runs: `older` completed in one attempt, `newer` crashed once."""
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    tmp = tmp_path_factory.mktemp("runs")
    for run_id, faults in (("older", None), ("newer", [{"kind": "sigkill", "at_step": 4}])):
        spec = load_run_spec(fake_spec(tmp, steps=8, interval=3, faults=faults))
        sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(), run_id=run_id)
        sup.start()
        run_until(sup, lambda s: s.state in DONE, timeout=60)
        assert sup.state == RunState.COMPLETED
        sup.store.close()
    return tmp / "state"


def _out(capsys, argv, code=0) -> str:
    capsys.readouterr()
    assert main(argv) == code
    return capsys.readouterr().out


def test_runs_lists_every_run_newest_first(two_runs, capsys, tmp_path):
    sd = ["--state-dir", str(two_runs)]
    rows = json.loads(_out(capsys, [*sd, "runs", "--json"]))
    assert [r["run_id"] for r in rows] == ["newer", "older"]
    newer, older = rows
    assert newer["state"] == older["state"] == "COMPLETED"
    assert (newer["step"], newer["total_steps"], older["step"], older["total_steps"]) == (8, 8, 8, 8)
    assert (newer["attempts"], older["attempts"]) == (2, 1)
    assert newer["incidents"] == 1 and older["incidents"] == 0 and newer["open_incidents"] == 0
    assert newer["started"] >= older["started"] and newer["last_change"] >= newer["started"]
    table = _out(capsys, [*sd, "runs"])
    assert "newer" in table and "older" in table and "8 / 8" in table and "None" not in table
    assert main(["--state-dir", str(tmp_path / "empty"), "runs"]) == 20  # no database: its own exit code


def test_logs_picks_the_attempt_and_the_rank(two_runs, capsys):
    sd = ["--state-dir", str(two_runs)]
    logs = two_runs / "runs" / "newer" / "logs"
    (logs / "attempt-1.log").write_bytes(MIXED)
    (logs / "attempt-2.log").write_bytes(b"attempt two says hello\n")
    assert _out(capsys, [*sd, "logs", "newer"]) == "attempt two says hello\n"  # the newest attempt by default
    assert _out(capsys, [*sd, "--run", "newer", "logs", "--attempt", "1"]) == MIXED.decode()
    assert _out(capsys, [*sd, "logs", "newer", "--attempt", "1", "--rank", "1"]) == (
        "step 1 loss 2.1\nTraceback (most recent call last):\nsrun-labelled line\nRuntimeError: boom\n")
    assert _out(capsys, [*sd, "logs", "newer", "--attempt", "1", "--rank", "0"]) == "step 1 loss 2.0\npadded rank 0\n"
    assert _out(capsys, [*sd, "logs", "newer", "--attempt", "1", "-n", "2"]) == "[rank1]:RuntimeError: boom\nlauncher: done\n"
    assert main([*sd, "logs", "newer", "--attempt", "7"]) == 4  # no such attempt: not found, names those there
    assert "attempts with logs: 1, 2" in capsys.readouterr().err.replace("\n", "")
    assert main([*sd, "logs", "newer", "--rank", "1"]) == 2  # attempt 2's log has no rank prefixes at all
    assert "no rank-prefixed lines" in capsys.readouterr().err.replace("\n", "")
    assert main([*sd, "logs", "nosuchrun"]) == 4
    # The built-in job's own format (training/__main__.py) labels mid-line: such lines are kept whole.
    job = (b"2026-12-01 23:37:01,835 [rank0] INFO ulyssesd.training: step 33 loss 4.227\n"
           b"Traceback (most recent call last):\n2026-12-01 23:37:01,901 [rank1] INFO ulyssesd.training: saved\n")
    (logs / "attempt-2.log").write_bytes(job)
    assert _out(capsys, [*sd, "logs", "newer", "--rank", "1"]) == (
        "2026-12-01 23:37:01,901 [rank1] INFO ulyssesd.training: saved\n")


def test_lines_with_rank_counts_that_ranks_lines(two_runs, capsys):
    """`--rank R -n N` is rank R's last N lines. A hung attempt's log ends with the ranks' stack dumps, which
    nobody labels: `-n` of the file's tail then found no labelled line and said, wrongly, that the log had none
    (exit 2; seen on `make demo`'s hang attempt). Many lines of another rank after R's are looked past too."""
    sd = ["--state-dir", str(two_runs)]
    job = "".join(f"2026-12-02 02:34:{i:02d},000 [rank0] INFO ulyssesd.training: step {i} loss 4.5\n"
                  for i in range(30))
    dump = "Thread 0x00007f (most recent call first):\n  File \"train.py\", line 9 in step\n" * 40
    log = "[rank1]:rank one early\n[rank1]:rank one late\n" + job + dump
    (two_runs / "runs" / "older" / "logs" / "attempt-1.log").write_text(log)
    assert _out(capsys, [*sd, "logs", "older", "--rank", "0", "-n", "2"]) == (
        "2026-12-02 02:34:28,000 [rank0] INFO ulyssesd.training: step 28 loss 4.5\n"
        "2026-12-02 02:34:29,000 [rank0] INFO ulyssesd.training: step 29 loss 4.5\n")
    assert _out(capsys, [*sd, "logs", "older", "--rank", "1", "-n", "1"]) == "rank one late\n"
    assert _out(capsys, [*sd, "logs", "older", "--rank", "1", "-n", "5"]) == "rank one early\nrank one late\n"
    assert _out(capsys, [*sd, "logs", "older", "-n", "1"]) == "  File \"train.py\", line 9 in step\n"  # no --rank: the file's
    capsys.readouterr()
    assert main([*sd, "logs", "older", "--rank", "2", "-n", "3"]) == 0  # labelled log, no rank 2: empty, 0,
    got = capsys.readouterr()  # and it says so (a silent empty output read as broken)
    assert got.out == "" and "attempt-1.log has no line of rank 2; its labelled lines are of rank(s) 0, 1" in got.err


def test_an_empty_newest_log_points_at_the_attempt_before(two_runs, capsys):
    """Right after a relaunch the newest attempt's log is still empty: say so, and where the last output is."""
    sd = ["--state-dir", str(two_runs)]
    logs = two_runs / "runs" / "newer" / "logs"
    (logs / "attempt-1.log").write_bytes(b"[rank0]:the crash\n")
    (logs / "attempt-2.log").write_bytes(b"")
    capsys.readouterr()
    assert main([*sd, "logs", "newer"]) == 0
    got = capsys.readouterr()
    assert got.out == "" and "attempt 2's log is empty so far; the one before: --attempt 1" in got.err
    assert main([*sd, "logs", "newer", "--attempt", "2"]) == 0 and capsys.readouterr().err == ""  # asked for it
    (logs / "attempt-2.log").write_bytes(b"started\n")
    assert _out(capsys, [*sd, "logs", "newer"]) == "started\n"


def test_logs_work_from_the_run_dir_when_the_database_is_gone(two_runs, tmp_path):
    state = tmp_path / "state"
    (state / "runs").mkdir(parents=True)
    os.symlink(two_runs / "runs" / "newer", state / "runs" / "newer")
    (two_runs / "runs" / "newer" / "logs" / "attempt-2.log").write_bytes(b"still readable\n")
    res = subprocess.run([str(CTL), "--state-dir", str(state), "logs", "newer"], capture_output=True, timeout=60)
    assert (res.returncode, res.stdout) == (0, b"still readable\n"), res.stderr
    res = subprocess.run([str(CTL), "--state-dir", str(state), "logs"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 20 and "ulyssesctl logs RUN" in res.stderr  # which run? it must be named then


def _attempt(run_dir: Path, n: int, script: str) -> subprocess.Popen:
    """Attempt n as the daemon runs one: the launcher wrapper (which writes attempts/N.exit when its child
    exits) with stdout and stderr in logs/attempt-N.log."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "attempts").mkdir(exist_ok=True)
    log = open(run_dir / "logs" / f"attempt-{n}.log", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "ulyssesd.daemon.job.wrapper", "--exit-file",
                                 str(run_dir / "attempts" / f"{n}.exit"), "--", "bash", "-c", script],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def test_follow_prints_new_lines_until_the_attempt_ends(tmp_path):
    run_dir = tmp_path / "state" / "runs" / "r1"
    job = _attempt(run_dir, 1, 'for i in $(seq 1 12); do echo "[rank$((i % 2))]:line $i"; sleep 0.15; done')
    t0 = time.monotonic()
    res = subprocess.run([str(CTL), "--state-dir", str(tmp_path / "state"), "logs", "r1", "-f", "--rank", "1"],
                         capture_output=True, text=True, timeout=60)
    assert job.wait(10) == 0
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"line {i}" for i in range(1, 13, 2)]  # all of them: it followed to the end
    assert time.monotonic() - t0 >= 12 * 0.15  # and it waited for the attempt rather than reading once
    assert (run_dir / "attempts" / "1.exit").exists()


def test_follow_ends_cleanly_on_ctrl_c(tmp_path):
    run_dir = tmp_path / "state" / "runs" / "r1"
    job = _attempt(run_dir, 1, 'echo "first line"; sleep 60')
    try:
        ctl = subprocess.Popen([str(CTL), "--state-dir", str(tmp_path / "state"), "logs", "r1", "-f"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert ctl.stdout.readline() == "first line\n"
        assert ctl.poll() is None  # still following: the attempt has not ended
        ctl.send_signal(signal.SIGINT)
        out, err = ctl.communicate(timeout=10)
        assert ctl.returncode == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(10)


@pytest.mark.slow
def test_rank_comes_from_torchruns_own_per_rank_files(tmp_path, make_sup, capsys):
    """torchrun with `--log-dir` and `--redirects 3` writes each rank's output to its own files and nothing
    labelled to the console: `--rank` reads those files (a real torchrun, the fake job raising on attempt 1)."""
    spec = fake_spec(tmp_path, steps=8, interval=3, faults=[{"kind": "raise", "at_step": 4}],
                     launcher={"kind": "torchrun", "extra_args": ["--log-dir", "tr-logs", "--redirects", "3"]})
    sup = make_sup(spec)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=180)
    assert sup.state == RunState.COMPLETED and sup.attempt == 2
    sd = ["--state-dir", str(tmp_path / "state")]
    rank0 = _out(capsys, [*sd, "logs", "--attempt", "1", "--rank", "0"])
    assert "RuntimeError: injected fault at step 4" in rank0  # from tr-logs/<run>-1_*/attempt_0/0/stderr.log
    assert "[rank" not in rank0 and "[default" not in rank0
    combined = _out(capsys, [*sd, "logs", "--attempt", "1"])
    assert "injected fault at step 4" not in combined  # redirected: the console never saw the rank's stderr
    assert main([*sd, "logs", "--attempt", "1", "--rank", "1"]) == 2  # no rank 1 files, nothing labelled


def test_logs_into_head_ends_quietly(tmp_path):
    """`ulyssesctl logs RUN | head -1` on a log far larger than the pipe: exit 0, no BrokenPipe traceback."""
    logs = tmp_path / "state" / "runs" / "r1" / "logs"
    logs.mkdir(parents=True)
    (logs / "attempt-1.log").write_bytes(b"".join(b"[rank0]:line %d of a long log\n" % i for i in range(200_000)))
    cmd = (f"'{CTL}' --state-dir '{tmp_path / 'state'}' logs r1 --rank 0 2>ctl.err | head -1; "
           "echo \"ctl_rc=${PIPESTATUS[0]}\"; cat ctl.err >&2")
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.stdout.splitlines() == ["line 0 of a long log", "ctl_rc=0"], (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
