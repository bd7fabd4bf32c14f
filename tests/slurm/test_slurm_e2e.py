"""End to end on the real Slurm test cluster (tests/slurm/conftest.py): the daemon submits the REAL tiny job
(ZeRO-3 + Ulysses SP=2, one rank on each of 2 nodes, gloo across the nodes' network namespaces) and supervises
it: a plain run completes; a node killed mid-run is named, excluded, and the run resumes on the spare with the
same losses step by step as the uninterrupted run (CPU fp32); the time-limit signal checkpoints the job and the
run continues in a new allocation. Slow: every attempt costs a Slurm submission and DeepSpeed's start-up."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from uls_daemon_helpers import write_spec  # noqa: E402

from ulyssesd.daemon.host.process import RealOS  # noqa: E402
from ulyssesd.daemon.job import slurm as sl  # noqa: E402
from ulyssesd.daemon.spec import load_run_spec  # noqa: E402
from ulyssesd.daemon.store import open_store  # noqa: E402
from ulyssesd.daemon.store.enums import RunState  # noqa: E402
from ulyssesd.daemon.supervisor import Supervisor  # noqa: E402

pytestmark = pytest.mark.slow
S = RunState


def slurm_spec(tmp: Path, *, steps: int, interval: int = 4, slurm: dict | None = None, name: str = "slurm",
               detectors: dict | None = None) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    tmp.mkdir(parents=True, exist_ok=True)
    return write_spec(tmp / "run.toml", {
        "run": {"name": name},
        "launcher": {"kind": "srun", "nnodes": 2, "nproc_per_node": 1, "env": {"GLOO_SOCKET_IFNAME": "eth0"}},
        "slurm": {"mode": "submit", "partition": "debug", "poll_s": 1.0, "cancel_grace_s": 30.0, **(slurm or {})},
        "model": {"preset": "tiny"},
        "parallel": {"sequence_parallel_size": 2},
        "precision": {"dtype": "fp32"},
        "train": {"steps": steps, "seq_len": 64, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 2, "device": "cpu"},
        "deepspeed.config.zero_optimization": {"stage": 3, "overlap_comm": False},
        "data": {"kind": "synthetic"},
        "checkpoint": {"interval_steps": interval, "keep_last": 10},
        # configs/tiny-cpu.toml's thresholds: the tiny model's loss is multi-modal, and a detector acting on its
        # noise (a restart with a patched config) would end an attempt before the time limit does.
        "detectors": {"warmup_steps": 10, "loss_smooth_records": 50, "loss_spike_min_rel": 1.0, "loss_osc_ratio": 6.0,
                      "slow_step_ratio": 5.0, "slow_step_min_consecutive": 5, "throughput_drop_frac": 0.8,
                      "throughput_persist_steps": 50, "drift_enabled": False, "hang_timeout_floor_s": 120.0,
                      **(detectors or {})},
        "remediation": {"max_restarts_per_hour": 10},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.25, "stop_grace_s": 60.0,
                   "hang_grace_s": 5.0, "stack_dump_wait_s": 2.0, "early_death_s": 5.0, "preflight": False},
    })


def supervise(spec_path: Path, until, timeout: float, during=None) -> Supervisor:
    spec = load_run_spec(spec_path)
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(),
                     say=lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
    sup.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.tick()
        if during is not None:
            during(sup)
        if until(sup):
            return sup
        time.sleep(0.25)
    log = sup.run_dir / "logs" / f"attempt-{sup.attempt}.log"
    tail = log.read_text()[-3000:] if log.exists() else "(no log)"
    raise AssertionError(f"not reached in {timeout}s: state {sup.state} attempt {sup.attempt} step "
                         f"{sup.last_step}\n{tail}")


def losses(run_dir: Path) -> dict[int, list[tuple[int, float]]]:
    """step -> [(attempt, loss)] of every step record (a resumed attempt redoes some steps)."""
    out: dict[int, list[tuple[int, float]]] = {}
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d.get("kind") == "step":
            out.setdefault(d["step"], []).append((d.get("attempt"), d["loss"]))
    return out


def failures(sup: Supervisor) -> list[str]:
    """Incidents that say something failed (the tiny model's noisy loss may trip a detector: not one of them)."""
    return [i.summary for i in sup.store.list_incidents(sup.run_id)
            if i.symptom.value in ("crash", "hang", "crash_loop", "no_progress", "launch_failure")]


@pytest.fixture
def cluster(slurm_cluster_clean, monkeypatch):
    for k, v in slurm_cluster_clean.env.items():
        monkeypatch.setenv(k, v)  # the daemon's own scontrol/scancel and the jobs' environment
    return slurm_cluster_clean


def test_tiny_job_on_two_nodes_completes_and_a_killed_node_is_named_excluded_and_resumed_from(cluster, tmp_path):
    steps, interval = 16, 4
    ref = supervise(slurm_spec(tmp_path / "ref", steps=steps, interval=interval, name="ref"),
                    lambda s: s.state in (S.COMPLETED, S.FAILED), 420)
    # The uninterrupted run is also the plain case: the tiny job on 2 nodes completes under the daemon.
    assert ref.state == S.COMPLETED, ref.store.get_run(ref.run_id).state_reason
    att = ref.store.list_attempts(ref.run_id)
    assert len(att) == 1 and att[0].host.startswith("slurm job ") and att[0].host.endswith("on n1,n2")
    assert sorted(losses(ref.run_dir)) == list(range(1, steps + 1))
    log = (ref.run_dir / "logs" / "attempt-1.log").read_text()
    assert "[ulyssesd slurm] submitted job" in log and "MASTER_ADDR=10.77." in log
    cluster.reset()
    marks: dict[str, float] = {}

    def kill_mid_run(sup):
        if "killed" not in marks and sup.latest_ckpt is not None and (sup.last_step or 0) >= interval + 2:
            marks["killed"] = time.monotonic()
            marks["killed_wall"] = time.time()
            marks["killed_at_step"] = sup.last_step
            cluster.kill_node("n2")

    sup = supervise(slurm_spec(tmp_path / "run", steps=steps, interval=interval), lambda s: s.state in
                    (S.COMPLETED, S.FAILED), 900, during=kill_mid_run)
    assert sup.state == S.COMPLETED, sup.store.get_run(sup.run_id).state_reason
    incidents = [i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]
    assert len(incidents) == 1 and "n2 (rank 1" in incidents[0].summary, [i.summary for i in
                                                                          sup.store.list_incidents(sup.run_id)]
    assert incidents[0].evidence["slurm"]["lost_nodes"] == ["n2"]
    assert "scontrol_show_node" in incidents[0].evidence["slurm"]["evidence"]
    assert sl.read_exclusions(sup.run_dir) == ["n2"]
    attempts = sup.store.list_attempts(sup.run_id)
    assert attempts[0].diagnosis == "node_lost" and attempts[-1].host.endswith("on n1,n3")
    got, want = losses(sup.run_dir), losses(ref.run_dir)
    resumed = [s for s, rows in got.items() if any(a == attempts[-1].number for a, _ in rows)]
    # It resumed from a checkpoint, not from scratch: its first step follows the tag it loaded. The tag may be the
    # step the daemon last saw when it killed the node (a save of that step can land before the node dies).
    from_step = int(attempts[-1].resumed_from.rsplit("-", 1)[-1])
    assert resumed and min(resumed) == from_step + 1 and 0 < from_step <= marks["killed_at_step"], (
        attempts[-1].resumed_from, min(resumed), marks)
    for s in sorted(want):
        last = got[s][-1][1]
        assert last == want[s][0][1], (s, got[s], want[s])  # bit-equal on CPU fp32
    # node loss -> the first step the resumed attempt computed (its telemetry time), for bench/RESULTS.md
    first_new = min(d["time"] for d in map(json.loads, (sup.run_dir / "telemetry.jsonl").read_text().splitlines())
                    if d.get("kind") == "step" and d.get("attempt") == attempts[-1].number)
    ended = attempts[0].ended_at.timestamp()
    print(f"SLURM_NODE_LOSS_TO_STEP_S={first_new - marks['killed_wall']:.1f} (attempt ended "
          f"{ended - marks['killed_wall']:.1f} s after the kill; resubmission to first step {first_new - ended:.1f} s)")
    cluster.restore_node("n2")


def test_time_limit_signal_checkpoints_and_the_run_continues_in_a_new_allocation(cluster, tmp_path):
    steps, interval = 400, 50  # far more than one allocation does here: the signal, not the end, stops it
    sent: dict[str, object] = {}

    def time_limit_signal(sup):
        # What Slurm does `time_limit_signal_s` before the limit (--signal=B:USR2@N), sent now: the batch shell
        # gets SIGUSR2. (A real --time here could be no shorter than a minute, and Slurm may send the signal up
        # to a minute early; the path from the signal on is the same.)
        from ulyssesd.daemon.job.slurm_watch import read_job_id

        if "job" not in sent and sup.attempt == 1 and (sup.last_step or 0) >= 3:
            job = read_job_id(sup.run_dir, 1)
            import subprocess

            subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True, timeout=30)
            sent["job"], sent["step"] = job, sup.last_step

    sup = supervise(slurm_spec(tmp_path, steps=steps, interval=interval, slurm={"time": "30"}),
                    lambda s: s.attempt >= 2 and s.state == S.RUNNING or s.state in (S.FAILED, S.COMPLETED), 600,
                    during=time_limit_signal)
    assert sup.state not in (S.FAILED, S.COMPLETED), sup.store.get_run(sup.run_id).state_reason
    a1 = sup.store.list_attempts(sup.run_id)[0]
    assert a1.diagnosis == "time_limit", (a1.diagnosis, a1.diagnosis_evidence)
    assert (sup.run_dir / "slurm" / "attempt-1.timelimit").exists()
    assert not failures(sup)  # not a failure
    assert not sup.counters.restarts  # not a restart against the budget
    acts = [a for a in sup.store.list_actions(run_id=sup.run_id) if (a.parameters or {}).get("continuation")]
    assert len(acts) == 1
    a2 = sup.store.list_attempts(sup.run_id)[1]
    assert a2.resumed_from is not None and a2.resumed_from != "none"  # from the checkpoint the signal made
    assert "--time=30" in json.loads((sup.run_dir / "slurm" / "attempt-2.plan.json").read_text())["sbatch_args"]
    assert read_job_id_of(sup, 2) != sent["job"]  # a new allocation
    _abandon(sup)


def read_job_id_of(sup: Supervisor, attempt: int) -> str | None:
    from ulyssesd.daemon.job.slurm_watch import read_job_id

    return read_job_id(sup.run_dir, attempt)


def test_a_real_time_limit_ends_the_allocation_and_the_run_continues(cluster, tmp_path):
    # --time=2 with the signal 45 s before: Slurm 22.05 sends it 45-75 s before the limit (its 30 s pass),
    # i.e. 45-75 s after the start, once the job trains here (start-up ~20-30 s on this box).
    sup = supervise(slurm_spec(tmp_path, steps=2000, interval=2, slurm={"time": "2", "time_limit_signal_s": 45}),
                    lambda s: s.attempt >= 2 and s.state == S.RUNNING or s.state in (S.FAILED, S.COMPLETED), 420)
    try:
        assert sup.state == S.RUNNING, sup.store.get_run(sup.run_id).state_reason
        a1 = sup.store.list_attempts(sup.run_id)[0]
        assert a1.diagnosis == "time_limit", (a1.diagnosis, a1.diagnosis_evidence)
        assert not failures(sup)
        assert read_job_id_of(sup, 2) != read_job_id_of(sup, 1)
        a2 = sup.store.list_attempts(sup.run_id)[1]
        assert a2.resumed_from not in (None, "none"), a2.resumed_from  # from a checkpoint of the first allocation
    finally:
        _abandon(sup)


def _abandon(sup: Supervisor) -> None:
    """End a run the test is done with: its watcher and its Slurm job (the next test's reset cancels the rest)."""
    import os
    import signal
    import subprocess

    from ulyssesd.daemon.job.slurm_watch import read_job_id

    job = read_job_id(sup.run_dir, sup.attempt)
    if job is not None:
        subprocess.run(["scancel", job], timeout=30)
    if sup.job is not None:
        try:
            os.killpg(sup.job.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_allocation_mode_runs_srun_inside_the_allocation_and_survives_a_lost_node(cluster, tmp_path, monkeypatch):
    import re
    import subprocess

    # --no-kill: the allocation outlives a failed node (without it Slurm revokes it, the daemon with it)
    got = subprocess.run(["salloc", "-N3", "-p", "debug", "--no-kill", "--no-shell"], capture_output=True,
                         text=True, timeout=60)
    job = re.search(r"Granted job allocation (\d+)", got.stderr + got.stdout)
    assert job, got.stderr
    monkeypatch.setenv("SLURM_JOB_ID", job.group(1))  # as inside `salloc ... ulyssesd run`
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    killed: dict[str, int] = {}

    def kill_mid_run(sup):
        if not killed and sup.latest_ckpt is not None and (sup.last_step or 0) >= 6:
            killed["step"] = sup.last_step or 0
            cluster.kill_node("n2")

    try:
        sup = supervise(slurm_spec(tmp_path, steps=16, slurm={"mode": "allocation"}),
                        lambda s: s.state in (S.COMPLETED, S.FAILED), 600, during=kill_mid_run)
        assert sup.state == S.COMPLETED, sup.store.get_run(sup.run_id).state_reason
        att = sup.store.list_attempts(sup.run_id)
        assert "srun" in att[0].command and "--nodes=2" in att[0].command
        inc = [i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]
        assert len(inc) == 1 and "lost node n2 (rank 1" in inc[0].summary, [
            i.summary for i in sup.store.list_incidents(sup.run_id)]
        assert "--exclude=n2" in att[-1].command and att[0].diagnosis == "node_lost"
        assert sorted(losses(sup.run_dir)) == list(range(1, 17))
    finally:
        subprocess.run(["scancel", job.group(1)], timeout=30)
        cluster.restore_node("n2")


def test_a_restarted_daemon_whose_watcher_died_re_adopts_the_job_by_its_id(cluster, tmp_path):
    import os
    import signal

    from ulyssesd.daemon.job.slurm_watch import read_job_id

    spec_path = slurm_spec(tmp_path, steps=24, interval=4)
    first = supervise(spec_path, lambda s: (s.last_step or 0) >= 3 or s.state in (S.FAILED, S.COMPLETED), 300)
    job_id = read_job_id(first.run_dir, 1)
    assert job_id is not None and first.state == S.RUNNING
    # The login node "rebooted": the daemon and the attempt's wrapper + watcher are gone; the Slurm job runs on.
    os.killpg(first.job.pgid, signal.SIGKILL)
    time.sleep(1.0)
    spec = load_run_spec(spec_path)
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS(), run_id=first.run_id,
                     say=lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
    sup.start()
    assert sup.attempt == 1 and sup.job is not None and sup.job.pid != first.job.pid
    deadline = time.monotonic() + 300
    while sup.state not in (S.COMPLETED, S.FAILED) and time.monotonic() < deadline:
        sup.tick()
        time.sleep(0.25)
    assert sup.state == S.COMPLETED, sup.store.get_run(sup.run_id).state_reason
    attempts = sup.store.list_attempts(sup.run_id)
    assert len(attempts) == 1 and attempts[0].host.startswith(f"slurm job {job_id} ")  # the same job, no resubmit
    log = (sup.run_dir / "logs" / "attempt-1.log").read_text()
    assert f"attaching to job {job_id}" in log and log.count("submitted job") == 1


def test_a_hung_rank_is_dumped_through_scancel_and_the_hang_incident_names_its_node(cluster, tmp_path):
    import os
    import signal

    import slurm_cluster as sc

    stopped: dict[str, int] = {}

    def stop_rank_on_n2(sup):
        if not stopped and sup.attempt == 1 and (sup.last_step or 0) >= 5:
            ranks = [p for p in cluster.pids_on("n2") if "ulyssesd.training" in sc._cmdline(p)]
            if ranks:
                os.kill(ranks[0], signal.SIGSTOP)  # the node answers Slurm; its rank is wedged
                stopped["pid"] = ranks[0]

    sup = supervise(slurm_spec(tmp_path, steps=14, detectors={"hang_timeout_floor_s": 15.0}),
                    lambda s: s.state in (S.COMPLETED, S.FAILED), 600, during=stop_rank_on_n2)
    assert stopped and sup.state == S.COMPLETED, sup.store.get_run(sup.run_id).state_reason
    hang = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(hang) == 1, [i.summary for i in sup.store.list_incidents(sup.run_id)]
    assert hang[0].evidence["waited_for_nodes"] == ["n2"] and "node n2" in hang[0].summary, hang[0].summary
    log = (sup.run_dir / "logs" / "attempt-1.log").read_text()
    assert "scancel --signal=TERM" in log  # the stop went through the scheduler
    assert (sup.run_dir / "stacks" / "attempt-1-rank-0.txt").read_text().strip()  # rank 0 dumped via scancel
