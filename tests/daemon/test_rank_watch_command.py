"""The rank watch of a bring-your-own job (`[job] kind = "command"`): its ranks are found by torch's rank
variables in their environment, not by the built-in job's module on their command line. Pure cases of the
rule (`pick_ranks`), then real processes: torchrun's two ranks of a user script found (not torchrun, not the
wrapper, not a rank's shell-out), a SIGUSR1 never sent to a process that would die of it, and a supervised
torchrun command job whose rank 1 is SIGKILLed while rank 0 hangs (ignoring SIGTERM, like a rank in NCCL):
the loss is noticed within the grace and recorded, where torchrun alone takes 30 s; the healthy job is not
flagged; a hung command job using the client library gets each rank's own stack dump into the incident."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from uls_daemon_helpers import wait_for, write_spec

from ulyssesd.daemon.host.process import (
    ProcInfo,
    RealOS,
    catches_signal,
    is_launcher,
    launch_vars_of,
    pick_ranks,
)
from ulyssesd.daemon.job.launcher import build_launch
from ulyssesd.daemon.spec import JobSection, LauncherSection
from ulyssesd.daemon.store.enums import RunState

S = RunState
PY = "/venv/bin/python"

# A user's training script that knows nothing about ulyssesd: rank 0 prints `step=N loss=X` (the stdout
# telemetry source), every rank sleeps per step; RANK_CHILD=1 makes each rank keep a shell-out child; on
# attempt 1, HANG_AT=K makes rank 0 hang at step K with SIGTERM ignored.
SCRIPT = r'''
import os, signal, subprocess, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ.get("ULYSSESD_ATTEMPT", "1"))
steps = int([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])  # DeepSpeed adds --local_rank
hang_at = int(os.environ.get("HANG_AT", "0"))
child = subprocess.Popen(["sleep", "600"]) if os.environ.get("RANK_CHILD") == "1" else None
if rank == 0 and hang_at:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for step in range(1, steps + 1):
    if rank == 0 and attempt == 1 and step == hang_at:
        print("rank 0 waits for its peer forever", flush=True)
        time.sleep(600)
    time.sleep(0.05)
    if rank == 0:
        print(f"step={step} loss={2.0 / step:.4f}", flush=True)
if child is not None:
    child.kill()
'''


def _script(tmp: Path) -> Path:
    path = tmp / "train_two_ranks.py"
    path.write_text(SCRIPT)
    return path


# ------------------------------------------------------------------------------- the rule, pure
def env(**v: str) -> tuple[str | None, ...]:
    return launch_vars_of(v)


def worker(rank: int, world: int = 2, port: str = "29500", **more: str) -> tuple[str | None, ...]:
    """What torchrun / the DeepSpeed launcher set for one rank."""
    return env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **more)


NONE = env()


def test_ranks_are_the_topmost_processes_with_rank_variables_below_the_launchers():
    wrapper, torchrun = 100, 101
    procs = [
        ProcInfo(torchrun, wrapper, (PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py"), NONE),
        ProcInfo(102, torchrun, (PY, "-u", "train.py", "--steps", "5"), worker(0)),
        ProcInfo(103, torchrun, (PY, "-u", "train.py", "--steps", "5"), worker(1)),
        ProcInfo(104, 102, (PY, "-u", "train.py", "--steps", "5"), worker(0)),  # rank 0's DataLoader worker
        ProcInfo(105, 103, ("sleep", "600"), worker(1)),  # rank 1's shell-out: inherits its environment
        ProcInfo(106, 105, ("cat",), worker(1)),  # below it, still not a rank
        ProcInfo(107, 103, ("python", "x.py"), worker(7)),  # sets its own RANK, but below a rank: not one
    ]
    assert pick_ranks(procs, "ulyssesd.training") == [102, 103]
    # The DeepSpeed launcher's two levels and the daemon's wrapper are never ranks, whatever their environment.
    ds = [ProcInfo(201, 200, (PY, "-m", "deepspeed.launcher.runner", "--num_gpus=2", "t.py"), NONE),
          ProcInfo(202, 201, (PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=x", "t.py"), NONE),
          ProcInfo(203, 202, (PY, "-u", "t.py", "--local_rank=0"), worker(0, CROSS_RANK="0")),
          ProcInfo(204, 202, (PY, "-u", "t.py", "--local_rank=1"), worker(1, CROSS_RANK="0")),
          ProcInfo(205, 200, (PY, "/venv/bin/torchrun", "t.py"), worker(1)),
          ProcInfo(206, 200, (PY, "-m", "ulyssesd.daemon.job.wrapper", "--", "x"), worker(1))]
    assert pick_ranks(ds, "ulyssesd.training") == [203, 204]
    assert is_launcher(("srun", "--nodes=1", "python", "t.py")) and not is_launcher((PY, "torchrun_notes.py"))


def test_variables_merely_inherited_from_a_launcher_do_not_make_a_rank():
    """The daemon itself started with RANK=3 in its environment (inside another job): torchrun inherits it,
    its ranks get their own values, and a helper torchrun runs keeps the inherited ones: not a rank. torchrun
    under the `local` launcher (RANK=0, LOCAL_RANK=0 from the wrapper): its rank 0 has the same RANK and
    LOCAL_RANK as torchrun, and is still a rank (its world size and rendezvous port are torchrun's)."""
    torchrun = 301
    inherited = env(RANK="3", WORLD_SIZE="8", MASTER_PORT="1234")
    procs = [ProcInfo(torchrun, 300, (PY, "-m", "torch.distributed.run", "t.py"), inherited),
             ProcInfo(302, torchrun, (PY, "-u", "t.py"), worker(0)),
             ProcInfo(303, torchrun, (PY, "-u", "t.py"), worker(1)),
             ProcInfo(304, torchrun, ("nvidia-smi", "-L"), inherited)]
    assert pick_ranks(procs, "ulyssesd.training") == [302, 303]
    local = worker(0, world=1, port="40001")  # what the local launcher gives the wrapper and its child
    nested = [ProcInfo(402, 401, (PY, "/venv/bin/torchrun", "--nproc-per-node=2", "t.py"), local),
              ProcInfo(403, 402, (PY, "-u", "t.py"), worker(0, port="29400", TORCHELASTIC_RUN_ID="x")),
              ProcInfo(404, 402, (PY, "-u", "t.py"), worker(1, port="29400", TORCHELASTIC_RUN_ID="x"))]
    assert pick_ranks(nested, "ulyssesd.training") == [403, 404]
    # The local launcher alone: the wrapper (not among the scanned processes) set RANK=0 for the one rank.
    assert pick_ranks([ProcInfo(502, 501, (PY, "train.py"), local)], "ulyssesd.training") == [502]


def test_a_builtin_rank_is_found_by_its_module_when_its_environment_cannot_be_read():
    procs = [ProcInfo(11, 10, (PY, "-m", "ulyssesd.training", "--config", "v1.json"), None),  # another user's
             ProcInfo(12, 10, (PY, "train.py"), None),  # unknown command, unreadable: not claimed
             ProcInfo(13, 10, (PY, "train.py"), NONE),  # readable, no rank variables: a helper, not a rank
             ProcInfo(14, 11, (PY, "-m", "ulyssesd.training", "--config", "v1.json"), None)]  # its worker
    assert pick_ranks(procs, "ulyssesd.training") == [11]
    assert pick_ranks(procs, "not.this.job") == []


# ------------------------------------------------------------------------------- real processes
def _launch(tmp: Path, env: dict[str, str], steps: int, kind: str) -> tuple[RealOS, object, object]:
    job = JobSection(kind="command", command=[str(_script(tmp)), str(steps)])
    plan = build_launch(LauncherSection(kind=kind, nproc_per_node=2), run_id="r", run_dir=tmp, attempt=1,
                        config_version=1, base_env={**os.environ, **env}, job=job)
    os_ = RealOS()
    return os_, os_.spawn(plan.argv, plan.env, plan.cwd, plan.log_path), plan


@pytest.mark.parametrize("kind", ["torchrun", "deepspeed"])
def test_the_launchers_ranks_of_a_user_script_are_found_and_a_sigusr1_spares_them(tmp_path, kind):
    os_, job, plan = _launch(tmp_path, {"RANK_CHILD": "1", "DS_ACCELERATOR": "cpu"}, steps=10_000, kind=kind)
    try:
        ranks = wait_for(lambda: (r := os_.rank_pids(job, "ulyssesd.training")) and len(r) == 2 and r, 60,
                         "two ranks")
        envs = sorted(psutil.Process(p).environ()["RANK"] for p in ranks)
        assert envs == ["0", "1"]
        for pid in ranks:
            assert "train_two_ranks.py" in " ".join(psutil.Process(pid).cmdline())
        sleepers = wait_for(lambda: (z := [p for p in os_.job_pids(job, plan.marker)
                                           if psutil.Process(p).name() == "sleep"]) and len(z) == 2 and z, 30,
                            "the shell-outs")
        everything = os_.job_pids(job, plan.marker)
        launchers = [p for p in everything if p != job.pid and p not in ranks and p not in sleepers]
        # the launchers (torchrun; the DeepSpeed runner and its per-node launch), the wrapper and the ranks'
        # `sleep` children are the job's processes, not ranks
        assert len(launchers) == (1 if kind == "torchrun" else 2), [psutil.Process(p).cmdline() for p in launchers]
        assert not set(sleepers) & set(ranks) and job.pid in everything
        assert os_.rank_pids(job, "ulyssesd.training") == ranks  # stable across scans
        # The script installs no SIGUSR1 handler: a stack-dump request must not kill it (default action).
        assert all(catches_signal(p, signal.SIGUSR1) is False for p in ranks)
        assert os_.signal_pids(ranks, signal.SIGUSR1) == []
        time.sleep(0.5)
        assert all(psutil.Process(p).is_running() and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in ranks)
        # One that catches it gets it.
        catcher = subprocess.Popen([sys.executable, "-c", "import signal,time\nsignal.signal(signal.SIGUSR1, "
                                    "lambda *a: print('usr1', flush=True))\nprint('ready', flush=True)\n"
                                    "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
        try:
            assert catcher.stdout.readline().strip() == "ready"
            assert catches_signal(catcher.pid, signal.SIGUSR1) is True
            assert os_.signal_pids([catcher.pid], signal.SIGUSR1) == [catcher.pid]
            assert catcher.stdout.readline().strip() == "usr1"
        finally:
            catcher.kill()
            catcher.wait()
    finally:
        os_.signal_pids(os_.job_pids(job, plan.marker), signal.SIGKILL)


def _spec(tmp: Path, env: dict[str, str], steps: int) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    return write_spec(tmp / "run.toml", {
        "run": {"name": "cmdranks"},
        "job": {"kind": "command", "command": [str(_script(tmp)), str(steps)]},
        "telemetry": {"source": "stdout"},
        "launcher": {"kind": "torchrun", "nproc_per_node": 2, "python": sys.executable,
                     "env": {"OMP_NUM_THREADS": "1", **env}},
        # the production rank watch (1 s scans, 1 s grace); the hang detector far away: not what is tested
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.1, "stop_grace_s": 5.0,
                   "backoff_base_s": 0.2, "backoff_max_s": 1.0, "early_death_s": 1.0, "preflight": False},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 120.0},
    })


def _supervise(make_sup, spec: Path, on_tick=None, timeout: float = 150.0):
    sup = make_sup(spec)
    sup.start()
    most_ranks = 0
    deadline = time.monotonic() + timeout
    while sup.state not in (S.COMPLETED, S.FAILED, S.STOPPED):
        assert time.monotonic() < deadline, f"state={sup.state} step={sup.last_step}"
        sup.tick()
        most_ranks = max(most_ranks, len(sup.rank_watch.live) if sup.job is not None else 0)
        if on_tick is not None:
            on_tick(sup)
        time.sleep(0.05)
    return sup, most_ranks


@pytest.mark.slow
def test_a_sigkilled_rank_of_a_torchrun_command_job_is_noticed_within_the_grace(tmp_path, make_sup):
    killed: dict[str, float | int] = {}

    def kill_rank_1_once_rank_0_hangs(sup):
        if killed or sup.job is None or sup.attempt != 1 or "waits for its peer" not in _log(sup):
            return
        live = sup.rank_watch.live
        if len(live) != 2:
            return  # the watch has not scanned both ranks yet
        rank1 = next(p for p in live if psutil.Process(p).environ().get("RANK") == "1")
        os.kill(rank1, signal.SIGKILL)
        killed.update(pid=rank1, at=time.time())

    sup, most = _supervise(make_sup, _spec(tmp_path, {"HANG_AT": "8"}, steps=200), kill_rank_1_once_rank_0_hangs)
    assert "pid" in killed and most == 2
    assert sup.state == S.COMPLETED and sup.attempt == 2 and sup.last_step == 200
    crash = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "crash"]
    assert len(crash) == 1, crash
    lost = crash[0].evidence["rank_lost"]
    assert lost["pids"] == [killed["pid"]], lost
    detected = crash[0].detected_at.timestamp() - float(killed["at"])
    print(f"\nSIGKILL of rank 1 of a torchrun command job -> crash incident after {detected:.2f} s")
    # >= the 1 s grace; torchrun alone would wait 30 s for the SIGTERM-deaf rank 0
    assert 1.0 <= detected <= 6.0, detected


@pytest.mark.slow
def test_a_healthy_torchrun_command_job_is_watched_and_not_flagged(tmp_path, make_sup):
    from ulyssesd.daemon.operator.ctl_status import job_processes

    scanned: list[tuple[list[int], list[int], str]] = []

    def status_scan_once_the_watch_sees_both(sup):
        if scanned or sup.job is None or len(sup.rank_watch.live) != 2:
            return
        attempt = sup.store.get_attempt(sup.run_id, sup.attempt)
        # `ulyssesctl status` with the daemon not answering: its own scan of this host's process table
        d = job_processes(attempt, None, sup.store.get_run(sup.run_id).spec["launcher"])
        scanned.append((list(sup.rank_watch.live), d["rank_pids"], d["rank_pids_source"]))

    sup, most = _supervise(make_sup, _spec(tmp_path, {}, steps=80), status_scan_once_the_watch_sees_both)
    assert most == 2  # the watch saw both ranks: it was active, not blind
    assert scanned and scanned[0][1] == scanned[0][0] and scanned[0][2] == "process table", scanned
    assert sup.state == S.COMPLETED and sup.attempt == 1 and sup.rank_lost is None
    assert [i.symptom.value for i in sup.store.list_incidents(sup.run_id)] == []


def _log(sup) -> str:
    try:
        return sup.log_path.read_text(errors="replace")
    except OSError:
        return ""


# A user's script with the client library (no torch): telemetry from rank 0, SIGUSR1 -> per-rank stack files.
CLIENT_SCRIPT = r'''
import os, time
from ulyssesd.client import Reporter, install_signal_handlers
stop = install_signal_handlers()
rank, attempt = int(os.environ["RANK"]), int(os.environ.get("ULYSSESD_ATTEMPT", "1"))
with Reporter() as rep:
    rep.event("started", 0)
    for step in range(1, 41):
        if attempt == 1 and step == 8:
            while True:  # both ranks wedged, as in a collective that never completes
                time.sleep(600)
        time.sleep(0.05)
        rep.step(step, 2.0 / step)
    rep.event("exiting", 40, reason="completed")
'''


@pytest.mark.slow
def test_a_hung_command_job_gets_per_rank_stack_dumps_from_its_ranks(tmp_path, make_sup):
    script = tmp_path / "client_job.py"
    script.write_text(CLIENT_SCRIPT)
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    spec = write_spec(tmp_path / "run.toml", {
        "run": {"name": "cmdhang"},
        "job": {"kind": "command", "command": [str(script)]},
        "launcher": {"kind": "torchrun", "nproc_per_node": 2, "python": sys.executable,
                     "env": {"OMP_NUM_THREADS": "1"}},
        "daemon": {"state_dir": str(tmp_path / "state"), "socket_path": str(sock), "tick_s": 0.1,
                   "stop_grace_s": 5.0, "hang_grace_s": 1.0, "stack_dump_wait_s": 1.0, "backoff_base_s": 0.2,
                   "backoff_max_s": 1.0, "early_death_s": 1.0, "preflight": False},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 3.0},
    })
    sup, most = _supervise(make_sup, spec)
    assert sup.state == S.COMPLETED and sup.attempt == 2 and sup.last_step == 40 and most == 2
    hang = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(hang) == 1, hang
    stacks = hang[0].evidence["stacks"]
    # Each rank's own dump file, collected under its header (before: no SIGUSR1 reached a command job's ranks,
    # and the evidence was the log's tail)
    for rank in (0, 1):
        assert f"=== rank {rank} stack dump" in stacks, stacks[:2000]
    assert stacks.count("client_job.py") >= 2  # each rank's frame in the user's script
