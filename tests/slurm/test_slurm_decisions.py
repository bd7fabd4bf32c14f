"""The pure Slurm decisions (daemon/job/slurm.py): parsing, hostlists, rank -> node, how a job ended, the
bounded --exclude, the sbatch options, the rank environment under srun; and the batch script run by a real
bash with stand-in srun/scontrol/scancel (its time-limit trap)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ulyssesd.daemon.job import slurm as sl
from ulyssesd.daemon.spec import SlurmSection, run_spec_from_dict
from ulyssesd.training.__main__ import rank_env_from_slurm
from ulyssesd.training.spec import SpecError


def test_hostlists_expand_in_order_with_padding():
    assert sl.expand_hostlist("n[1-3,5]") == ["n1", "n2", "n3", "n5"]
    assert sl.expand_hostlist("gpu[08-10],cpu1") == ["gpu08", "gpu09", "gpu10", "cpu1"]
    assert sl.expand_hostlist("n1,n2") == ["n1", "n2"]
    assert sl.expand_hostlist("(null)") == [] and sl.expand_hostlist("") == []
    with pytest.raises(sl.SlurmError, match="unreadable hostlist range 'x-2'"):
        sl.expand_hostlist("n[x-2]")


def test_scontrol_records_keep_values_with_spaces():
    rec = sl.parse_scontrol("JobId=7 JobName=r JobState=NODE_FAIL Reason=Not responding [root@t] "
                            "NodeList=n[1-2] Command=/bin/sh -c x ExitCode=0:0")
    assert rec["JobState"] == "NODE_FAIL" and rec["Reason"] == "Not responding [root@t]"
    assert rec["NodeList"] == "n[1-2]" and rec["ExitCode"] == "0:0" and rec["Command"] == "/bin/sh -c x"


@pytest.mark.parametrize("state,lost", [("DOWN", True), ("DOWN*", True), ("IDLE*", True), ("ALLOCATED*", True),
                                        ("MIXED+NOT_RESPONDING", True), ("DOWN+DRAIN", True),
                                        ("ALLOCATED", False), ("IDLE", False), ("MIXED+DRAIN", False),
                                        ("ALLOCATED+COMPLETING", False), ("", False)])
def test_node_lost_only_for_down_or_not_responding(state, lost):
    assert sl.node_lost(state) is lost


def test_rank_to_node_is_the_block_distribution():
    assert sl.rank_nodes(["n1", "n2"], 1) == {0: "n1", 1: "n2"}
    assert sl.rank_nodes(["a", "b"], 2) == {0: "a", 1: "a", 2: "b", 3: "b"}


def _job(state, nodes="n[1-2]", code="0:0"):
    return {"JobId": "12", "JobState": state, "NodeList": nodes, "ExitCode": code}


def test_a_lost_node_is_named_with_its_ranks_and_a_healthy_end_is_not():
    end = sl.classify_end("12", _job("NODE_FAIL"), [], {"n1": "ALLOCATED", "n2": "DOWN*"}, 1, False)
    assert end.kind == "node_lost" and end.lost_nodes == ["n2"] and end.lost_ranks == {"n2": [1]}
    assert "n2 (rank 1, state DOWN*)" in end.why
    healthy = sl.classify_end("12", _job("COMPLETED"), [], {"n1": "IDLE", "n2": "IDLE"}, 1, False)
    assert healthy.kind == "completed" and healthy.lost_nodes == []
    # the job completed, then its node went down: the completion stands
    after = sl.classify_end("12", _job("COMPLETED"), [], {"n1": "IDLE", "n2": "DOWN*"}, 1, False)
    assert after.kind == "completed" and after.lost_nodes == []
    # the watcher saw n1 go while the job ran, then cancelled it: lost, though the end state is CANCELLED
    seen = sl.classify_end("12", _job("CANCELLED"), [], {"n1": "IDLE", "n2": "IDLE"}, 1, False, ["n1"])
    assert seen.kind == "node_lost" and seen.lost_ranks == {"n1": [0]}


def test_time_limit_vs_plain_failure_vs_cancel():
    assert sl.classify_end("12", _job("TIMEOUT", code="0:15"), [], {}, 1, False).kind == "time_limit"
    # the trap saw USR2, the ranks saved and exited: COMPLETED, but it is the time limit's end
    assert sl.classify_end("12", _job("COMPLETED"), [], {}, 1, True).kind == "time_limit"
    failed = sl.classify_end("12", _job("FAILED", code="1:0"), [], {"n1": "IDLE", "n2": "IDLE"}, 1, False)
    assert failed.kind == "failed" and "FAILED (exit 1:0)" in failed.why
    assert sl.classify_end("12", _job("CANCELLED by 0"), [], {}, 1, False).kind == "cancelled"
    # scontrol forgot the job: sacct's row decides; neither: unknown, said so
    row = [{"JobID": "12", "State": "NODE_FAIL", "ExitCode": "0:0", "NodeList": "n[1-2]"}]
    assert sl.classify_end("12", None, row, {"n2": "DOWN"}, 1, False).lost_nodes == ["n2"]
    assert sl.classify_end("12", None, [], {}, 1, False).kind == "unknown"


def test_exclusion_is_bounded_by_what_the_job_needs():
    assert sl.bounded_exclude([], ["n2"], ["n1", "n2", "n3"], 2, None) == (["n2"], None)
    kept, why = sl.bounded_exclude(["n2"], ["n1"], ["n1", "n2", "n3"], 2, None)
    assert kept == ["n2"] and "leaves 1 usable node(s) (n3)" in why and "needs 2" in why
    kept, why = sl.bounded_exclude(["n2"], ["n3"], ["n1", "n2", "n3", "n4"], 2, 1)
    assert kept == ["n2"] and "slurm.max_excluded=1" in why
    assert sl.bounded_exclude(["n2"], ["n2"], ["n1", "n2", "n3"], 2, None) == (["n2"], None)  # no double


def test_sbatch_options_carry_the_spec_and_the_exclusions(tmp_path):
    s = SlurmSection(mode="submit", partition="debug", gres="gpu:8", time="1-00:00", time_limit_signal_s=300,
                     sbatch_args=["--account=llm"])
    args = sl.sbatch_args(s, job_name="run1", nodes=2, ntasks_per_node=8, exclude=["n2"], log_path=tmp_path / "l",
                          run_dir=tmp_path)
    for a in ("--job-name=run1", "--nodes=2", "--ntasks-per-node=8", "--partition=debug", "--gres=gpu:8",
              "--time=1-00:00", "--signal=B:USR2@300", "--exclude=n2", "--no-requeue", "--account=llm"):
        assert a in args
    plain = sl.sbatch_args(SlurmSection(mode="submit"), job_name="r", nodes=1, ntasks_per_node=1, exclude=[],
                           log_path=tmp_path / "l", run_dir=tmp_path)
    assert not any(a.startswith(("--time", "--signal", "--exclude", "--partition")) for a in plain)


def test_spec_refuses_slurm_without_srun_and_a_bad_time():
    ok = run_spec_from_dict({"launcher": {"kind": "srun", "nnodes": 2}, "slurm": {"mode": "submit", "time": "30"}})
    assert ok.slurm.mode == "submit" and ok.slurm.time == "30"
    with pytest.raises(SpecError, match="needs launcher.kind='srun'"):
        run_spec_from_dict({"slurm": {"mode": "submit"}})
    with pytest.raises(SpecError, match="slurm.time"):
        run_spec_from_dict({"launcher": {"kind": "srun"}, "slurm": {"mode": "submit", "time": "5h"}})
    with pytest.raises(SpecError, match="slurm.mode"):
        run_spec_from_dict({"launcher": {"kind": "srun"}, "slurm": {"mode": "sometimes"}})


def test_rank_env_comes_from_slurm_and_a_launcher_wins():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "40"}
    assert rank_env_from_slurm(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                        "MASTER_ADDR": "gpu07", "MASTER_PORT": "29540"}
    assert env["RANK"] == "3"
    set_by_torchrun = {"SLURM_PROCID": "0", "RANK": "5", "MASTER_ADDR": "h"}
    assert rank_env_from_slurm(set_by_torchrun) == {} and set_by_torchrun["RANK"] == "5"
    assert rank_env_from_slurm({"RANK": "0"}) == {}  # not under Slurm: nothing


# ------------------------------------------------------------------------------- the batch script
def _stand_ins(bin_dir: Path, calls: Path) -> None:
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\ncase "$*" in *hostnames*) echo n1; echo n2;; '
                                      '*"show node"*) echo "NodeName=n1 NodeAddr=10.0.0.11 State=IDLE";; esac\n')
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "scancel $*" >> {calls}\n'
                                     f'kill -TERM $(cat {calls}.srun) 2>/dev/null\n')
    # srun: record its env and args, wait for SIGTERM (the ranks' save-and-exit), exit 0 then
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho $$ > {calls}.srun\necho "srun $* MASTER=$MASTER_ADDR:$MASTER_PORT"'
                                  f' >> {calls}\ntrap "echo saved >> {calls}; exit 0" TERM\n'
                                  'for i in $(seq 300); do sleep 0.1; done\nexit 7\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def test_batch_script_sends_term_to_the_ranks_on_the_time_limit_signal(tmp_path):
    calls, mark = tmp_path / "calls", tmp_path / "mark"
    _stand_ins(tmp_path / "bin", calls)
    script = tmp_path / "job.sbatch"
    script.write_text(sl.batch_script(["python", "-m", "x"], nodes=2, ntasks_per_node=1, mark_path=mark,
                                      master_port=29601))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "12",
           "SLURM_JOB_NODELIST": "n[1-2]"}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not (calls.exists() and "srun" in calls.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --distribution=block python -m x " \
           "MASTER=10.0.0.11:29601" in calls.read_text()
    assert not mark.exists()
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out  # the step saved and exited 0: the script says so, not 7 (no signal)
    text = calls.read_text()
    assert "scancel --signal=TERM 12" in text and "saved" in text and mark.exists()
    assert "time limit near" in out


def test_batch_script_passes_the_step_exit_code_through(tmp_path):
    calls = tmp_path / "calls"
    _stand_ins(tmp_path / "bin", calls)
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 3\n")
    script = tmp_path / "job.sbatch"
    script.write_text(sl.batch_script(["true"], nodes=1, ntasks_per_node=1, mark_path=tmp_path / "m",
                                      master_port=29602))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "1",
           "SLURM_JOB_NODELIST": "n1"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=20)
    assert done.returncode == 3 and "srun exited 3" in done.stdout
