"""The Slurm test cluster itself: nodes come up idle, jobs span namespaces, gloo crosses the bridge, node faults
look to Slurm like the real ones, and nothing is left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as sc

REPO = Path(__file__).resolve().parents[2]


def _slurm(cluster: sc.SlurmTestCluster, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env={**os.environ, **cluster.env}, capture_output=True, text=True,
                          timeout=timeout)


def _sbatch(cluster: sc.SlurmTestCluster, *args: str) -> str:
    # A job's output goes to the cluster dir unless the test names a file (sbatch's default is the cwd: the repo).
    output = () if "-o" in args else (f"--output={cluster.dir}/slurm-%j.out",)
    done = _slurm(cluster, "sbatch", "--parsable", "-p", "debug", *output, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _wait_job(cluster: sc.SlurmTestCluster, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = cluster.job_info(job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} never reached {states}; last: {info.get('JobState')} {info.get('Reason')}")


def test_parse_record_keeps_values_with_spaces():
    rec = sc.parse_record("JobId=7 JobState=NODE_FAIL Reason=Not responding [root@2026-12-01T23:07:09] "
                          "NodeList=n[1-2] Command=/bin/sh -c x=1 ExitCode=0:0")
    assert rec["JobId"] == "7"
    assert rec["JobState"] == "NODE_FAIL"
    assert rec["Reason"] == "Not responding [root@2026-12-01T23:07:09]"
    assert rec["NodeList"] == "n[1-2]"
    assert rec["Command"] == "/bin/sh -c x=1"  # lower-case `x=` inside a value: kept (keys here are CamelCase)
    assert rec["ExitCode"] == "0:0"


def test_bad_config_is_refused_with_the_field_named(tmp_path):
    with pytest.raises(ValueError, match="nodes"):
        sc.ClusterConfig(base_dir=tmp_path, nodes=0)
    with pytest.raises(ValueError, match="instance"):
        sc.ClusterConfig(base_dir=tmp_path, instance=99)


def test_missing_tools_and_non_root_are_named_as_the_skip_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    reason = sc.missing_prerequisites()
    assert reason and reason.startswith("not installed: ") and "slurmd" in reason and "munged" in reason
    assert "apt-get install" in reason
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (sc.missing_prerequisites() or "")


@pytest.mark.slow
def test_a_daemon_that_cannot_start_is_named_with_its_log_and_nothing_is_left(slurm_cluster, tmp_path):
    free = [i for i in range(sc.MAX_INSTANCES) if not (sc.CLAIMS_DIR / str(i)).exists()]
    if not free:
        pytest.skip("every test cluster instance is in use")
    busy = sc.ClusterConfig(base_dir=tmp_path / "c", nodes=1, instance=free[-1])
    with socket.socket() as squatter:  # slurmctld's port taken: it must fail, and say so
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", 16817 + 2 * free[-1]))
        squatter.listen()
        broken = sc.SlurmTestCluster(busy)
        with pytest.raises(sc.ClusterError, match="slurmctld exited") as err:
            broken.up()
    assert "Address already in use" in str(err.value)  # its log tail is quoted
    assert broken.leftovers() == []


def test_a_base_dir_too_long_for_the_munge_socket_is_refused_up_front(tmp_path):
    if sc.missing_prerequisites():
        pytest.skip(sc.missing_prerequisites())
    deep = sc.SlurmTestCluster(sc.ClusterConfig(base_dir=tmp_path / ("d" * 60) / ("e" * 60), nodes=1))
    with pytest.raises(sc.ClusterError, match="too long: the munge socket path"):
        deep.up()
    assert deep.instance == -1  # nothing was claimed or started


def test_sinfo_shows_three_idle_nodes_in_debug(slurm_cluster_clean):
    done = _slurm(slurm_cluster_clean, "sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T %c")
    assert done.returncode == 0, done.stderr
    rows = sorted(line.split() for line in done.stdout.splitlines())
    assert rows == [["n1", "idle", "2"], ["n2", "idle", "2"], ["n3", "idle", "2"]]


def test_srun_on_two_nodes_runs_in_two_namespaces(slurm_cluster_clean):
    c = slurm_cluster_clean
    done = _slurm(c, "srun", "-N2", "-n2", "--ntasks-per-node=1", "-p", "debug", "sh", "-c",
                  'echo "$(hostname) $SLURMD_NODENAME $(stat -L -c %i /proc/self/ns/net) $(getent hosts n2)"')
    assert done.returncode == 0, done.stderr
    rows = sorted(line.split() for line in done.stdout.splitlines())
    assert [r[0] for r in rows] == ["n1", "n2"] and [r[1] for r in rows] == ["n1", "n2"]
    inodes = {int(r[2]) for r in rows}
    assert inodes == {os.stat(f"/run/netns/{c.namespace(n)}").st_ino for n in ("n1", "n2")}
    assert os.stat("/proc/self/ns/net").st_ino not in inodes  # not the root namespace
    assert all(r[3] == c.node_addr("n2") for r in rows)  # n2 resolves on every node (getent = libc resolver)


def test_node_of_pid_names_the_node_a_job_process_runs_on(slurm_cluster_clean):
    c = slurm_cluster_clean
    job = _sbatch(c, "-w", "n2", "-N1", "--wrap", "exec sleep 60")
    _wait_job(c, job, {"RUNNING"}, 30)
    deadline = time.monotonic() + 20
    sleepers: list[int] = []
    while not sleepers and time.monotonic() < deadline:
        sleepers = [p for p in c.pids_on("n2") if sc._cmdline(p) == "sleep 60"]
        time.sleep(0.2)
    assert sleepers, f"no `sleep 60` on n2: {[sc._cmdline(p) for p in c.pids_on('n2')]}"
    assert c.node_of_pid(sleepers[0]) == "n2"
    assert c.node_of_pid(os.getpid()) is None  # the test runner is in the root namespace
    assert sleepers[0] not in c.pids_on("n1")
    _slurm(c, "scancel", job)


def test_gloo_all_reduce_between_two_nodes_crosses_the_bridge(slurm_cluster_clean, tmp_path):
    c = slurm_cluster_clean
    script = tmp_path / "allreduce.py"
    script.write_text(
        "import os, socket, torch, torch.distributed as dist\n"
        "rank, world = int(os.environ['SLURM_PROCID']), int(os.environ['SLURM_NTASKS'])\n"
        "dist.init_process_group('gloo', init_method=f\"tcp://{os.environ['MASTER_ADDR']}:29533\",\n"
        "                        rank=rank, world_size=world)\n"
        "t = torch.full((1 << 20,), float(rank + 1)); dist.all_reduce(t)  # 4 MiB\n"
        "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), rank, t[0].item(), flush=True)\n"
        "dist.destroy_process_group()\n")
    env = {**os.environ, **c.env, "MASTER_ADDR": c.master_addr}
    before = c.link_bytes("n2")
    done = subprocess.run(["srun", "-N2", "-n2", "--ntasks-per-node=1", "-p", "debug", "--time=2",
                           sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted(line.split() for line in done.stdout.splitlines() if line.startswith("n"))
    # each rank binds its node's own address (loopback would not reach the other namespace)
    assert rows == [["n1", c.node_addr("n1"), "0", "3.0"], ["n2", c.node_addr("n2"), "1", "3.0"]]
    # n2 sent and received its 4 MiB share (reduce-scatter + all-gather) through its link on the bridge
    assert c.link_bytes("n2") - before >= 2 * (4 << 20)


def test_sacct_says_accounting_is_disabled_and_jobcomp_records_the_job(slurm_cluster_clean):
    c = slurm_cluster_clean
    done = _slurm(c, "sacct", "-n")
    assert done.returncode != 0 and "accounting storage is disabled" in (done.stderr + done.stdout)
    job = _sbatch(c, "-N1", "--wrap", "true")
    _wait_job(c, job, {"COMPLETED"}, 60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not [r for r in c.jobcomp_records() if r.get("JobId") == job]:
        time.sleep(0.3)
    rec = [r for r in c.jobcomp_records() if r.get("JobId") == job]
    assert rec and rec[0]["JobState"] == "COMPLETED" and rec[0]["ExitCode"] == "0:0", rec


@pytest.mark.slow
def test_killed_node_goes_down_and_its_job_ends_node_fail(slurm_cluster_clean):
    c = slurm_cluster_clean
    job = _sbatch(c, "-N2", "-w", "n1,n2", "--wrap", "srun sleep 300")
    _wait_job(c, job, {"RUNNING"}, 30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(sc._cmdline(p) == "/usr/bin/sleep 300" for p in c.pids_on("n1")):
        time.sleep(0.2)
    t0 = time.monotonic()
    killed = c.kill_node("n1")
    assert killed and not c.pids_on("n1")
    c.wait_node_state("n1", {"down"}, timeout=c.config.slurmd_timeout_s + 20)
    seconds_to_down = time.monotonic() - t0
    info = _wait_job(c, job, {"NODE_FAIL"}, 60)
    seconds_to_node_fail = time.monotonic() - t0
    assert "n1" in info["NodeList"] or info["NodeList"] == "n[1-2]"
    assert c.node_states()["n2"] != "down"  # only the killed node is blamed
    assert "Not responding" in c.node_info("n1").get("Reason", "")
    c.restore_node("n1")
    assert c.node_states()["n1"] == "idle"
    print(f"node down {seconds_to_down:.1f}s, job NODE_FAIL {seconds_to_node_fail:.1f}s after kill "
          f"(SlurmdTimeout={c.config.slurmd_timeout_s})")


@pytest.mark.slow
def test_set_down_ends_the_job_node_fail_and_keeps_the_reason(slurm_cluster_clean):
    c = slurm_cluster_clean
    job = _sbatch(c, "-N1", "-w", "n3", "--wrap", "srun sleep 300")
    _wait_job(c, job, {"RUNNING"}, 30)
    c.set_down("n3", "gpu fell off the bus")
    assert _wait_job(c, job, {"NODE_FAIL"}, 30)["JobState"] == "NODE_FAIL"
    # The node's own state cannot be read reliably afterwards: with ReturnToService=2 slurmctld returns a DOWN
    # node whose slurmd still answers to service within milliseconds (seen: "state set to DOWN" at .344,
    # "node n3 returned to service" at .350), clearing the reason. slurmctld's log keeps both facts.
    log = (c.dir / "log" / "slurmctld.log").read_text(errors="replace")
    assert "update_node: node n3 reason set to: gpu fell off the bus" in log
    assert "update_node: node n3 state set to DOWN" in log
    c.restore_node("n3")
    c.wait_idle(30)


@pytest.mark.slow
def test_frozen_node_stops_answering_and_thaws(slurm_cluster_clean):
    c = slurm_cluster_clean
    frozen = c.freeze_node("n2")
    assert frozen
    t0 = time.monotonic()
    state = c.wait_node_state("n2", {"down", "idle"}, timeout=5)  # still idle right after the freeze
    assert state == "idle"
    c.wait_node_state("n2", {"down"}, timeout=c.config.slurmd_timeout_s + 20)
    print(f"frozen node down {time.monotonic() - t0:.1f}s after the freeze")
    assert c.node_states()["n2"].endswith("*")  # not responding: slurmctld's pings go unanswered
    c.restore_node("n2")
    c.wait_idle(30)


@pytest.mark.slow
def test_frozen_ranks_hang_while_slurm_keeps_the_node_up(slurm_cluster_clean):
    c = slurm_cluster_clean
    job = _sbatch(c, "-N1", "-w", "n2", "--wrap", "srun sleep 300")
    _wait_job(c, job, {"RUNNING"}, 30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(sc._cmdline(p) == "/usr/bin/sleep 300" for p in c.pids_on("n2")):
        time.sleep(0.2)
    stopped = c.freeze_node("n2", jobs_only=True)
    rank = [p for p in stopped if sc._cmdline(p) == "/usr/bin/sleep 300"]
    assert rank and sc._proc_state(rank[0]) == "T"
    daemons = [p for p in c.pids_on("n2") if sc._is_slurm_daemon(p)]
    assert daemons and not set(daemons) & set(stopped)
    time.sleep(c.config.slurmd_timeout_s + 8)  # longer than a frozen slurmd takes to be set DOWN (12 s measured)
    assert c.node_states()["n2"] in ("allocated", "mixed")
    assert c.job_info(job)["JobState"] == "RUNNING"
    c.thaw_node("n2")
    assert sc._proc_state(rank[0]) in ("S", "R")
    _slurm(c, "scancel", job)


@pytest.mark.slow
def test_slow_node_caps_the_cpu_of_what_runs_there_later(slurm_cluster_clean):
    c = slurm_cluster_clean
    if sc._cpu_cgroup_root() is None:
        pytest.skip("no cpu cgroup controller on this kernel: slow_node cannot work here")
    c.slow_node("n2", 0.2)
    burn = ("import time; t = time.time(); c = time.process_time()\n"
            "while time.time() - t < 3: pass\n"
            "print(open('/proc/self/cgroup').read().count('ulyssesd-'), round(time.process_time() - c, 2))")
    done = _slurm(c, "srun", "-N1", "-w", "n2", sys.executable, "-c", burn, timeout=60)
    assert done.returncode == 0, done.stderr
    in_cgroup, cpu_s = done.stdout.split()
    assert in_cgroup == "1"  # started after slow_node, by slurmd: inherited its cgroup
    assert float(cpu_s) <= 3 * 0.2 * 1.5, f"a 20% cap let it use {cpu_s} CPU-s in 3 s"
    c.wait_node_state("n2", {"idle"}, timeout=30)  # Slurm sees nothing wrong with a slow node
    c.unslow_node("n2")
    assert not [x for x in c.leftovers() if x.startswith("cgroup")]
    done = _slurm(c, "srun", "-N1", "-w", "n2", sys.executable, "-c", burn, timeout=60)
    assert done.returncode == 0 and done.stdout.split()[0] == "0", done.stdout + done.stderr


@pytest.mark.slow
def test_a_second_cluster_runs_alongside_and_leaves_nothing(slurm_cluster, tmp_path):
    other = sc.SlurmTestCluster(sc.ClusterConfig(base_dir=tmp_path / "c2", nodes=1))
    other.up()
    try:
        assert other.instance != slurm_cluster.instance and other.node_states() == {"n1": "idle"}
        done = _slurm(other, "srun", "-N1", "hostname")
        assert done.returncode == 0 and done.stdout.strip() == "n1", done.stderr
        namespaces = [other.namespace("n1")]
    finally:
        other.down(check=True)
    assert other.leftovers() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    assert not (sc.CLAIMS_DIR / str(other.instance)).exists()
    assert sc._pids_with_cmdline_containing(str(other.conf_path)) == []
    slurm_cluster.wait_idle(10)  # the session cluster was not touched


TICK_S = 30  # slurmctld checks time limits (and --signal warnings) on a ~30 s periodic pass (measured, 22.05.8)


@pytest.mark.slow
def test_time_limit_signal_comes_early_on_a_30s_pass_and_the_kill_after_the_limit(slurm_cluster_clean, tmp_path):
    """What a time-limit test can rely on (docs/SLURM.md): `--time` is whole minutes (0:40 is rounded up to 1),
    the B:USR2@N warning comes at a periodic pass up to ~30 s before the limit-N point, SIGTERM at the first
    pass after the limit (up to ~30 s late), then SIGKILL after KillWait."""
    c = slurm_cluster_clean
    script = tmp_path / "limit.sh"
    log = tmp_path / "limit.log"
    script.write_text("#!/bin/bash\n"
                      f"echo start $(date +%s.%N) >> {log}\n"
                      f"trap 'echo USR2 $(date +%s.%N) >> {log}' USR2\n"
                      f"trap 'echo TERM $(date +%s.%N) >> {log}; exit 0' TERM\n"
                      "for i in $(seq 1 600); do sleep 0.2; done\n")
    script.chmod(0o755)
    warn_s = 20
    job = _sbatch(c, "-N1", "--time=0:40", f"--signal=B:USR2@{warn_s}", "-o", str(tmp_path / "out"), str(script))
    assert c.job_info(job)["TimeLimit"] == "00:01:00"  # rounded up to a whole minute
    info = _wait_job(c, job, {"TIMEOUT", "COMPLETED", "CANCELLED", "FAILED"}, 60 + TICK_S + 60)
    stamps = {line.split()[0]: float(line.split()[1]) for line in log.read_text().splitlines()}
    usr2, term = stamps["USR2"] - stamps["start"], stamps["TERM"] - stamps["start"]
    print(f"USR2 at {usr2:.1f}s, TERM at {term:.1f}s after start (limit 60 s, warning asked at {60 - warn_s} s)")
    assert info["JobState"] == "TIMEOUT"
    assert 60 - warn_s - TICK_S - 5 <= usr2 <= 60 - warn_s + 5
    assert 60 - 2 <= term <= 60 + TICK_S + 5
    assert usr2 < term


@pytest.mark.slow
def test_a_cluster_whose_test_run_was_killed_is_reaped_by_the_next_up(slurm_cluster, tmp_path):
    base = tmp_path / "orphan"
    starter = ("import os, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import slurm_cluster as sc\n"
               "c = sc.SlurmTestCluster(sc.ClusterConfig(base_dir=Path(sys.argv[2]), nodes=1)).up()\n"
               "print(c.instance, flush=True); os.kill(os.getpid(), 9)  # dies without down()\n")
    done = subprocess.run([sys.executable, "-c", starter, str(REPO / "bench"), str(base)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    orphan = sc.cluster_from_dir(base)
    assert orphan.leftovers(), "the killed runner's cluster should still be up before the reaping"
    assert sc.reap_orphans() == [base]
    assert orphan.leftovers() == []
    assert not (sc.CLAIMS_DIR / done.stdout.strip()).exists()
    slurm_cluster.wait_idle(10)  # a live owner's cluster (this session's) is not reaped


@pytest.mark.slow
def test_cli_up_status_down_leaves_nothing(tmp_path):
    base = tmp_path / "cli"
    cli = [sys.executable, str(REPO / "bench" / "slurm_cluster.py")]
    up = subprocess.run([*cli, "up", "--nodes", "1", "--dir", str(base)], capture_output=True, text=True,
                        timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        assert f"export SLURM_CONF={base / 'slurm.conf'}" in up.stdout
        again = subprocess.run([*cli, "up", "--dir", str(base)], capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "already up" in again.stderr
        status = subprocess.run([*cli, "status", "--dir", str(base)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and '"state": "idle"' in status.stdout, status.stderr
    finally:
        down = subprocess.run([*cli, "down", "--dir", str(base)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert sc.cluster_from_dir(base).leftovers() == []
    missing = subprocess.run([*cli, "down", "--dir", str(tmp_path / "nothing")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 1 and "holds no test cluster" in missing.stderr


@pytest.mark.slow
def test_two_clusters_started_at_once_get_their_own_instances(slurm_cluster, tmp_path):
    import threading

    pair = [sc.SlurmTestCluster(sc.ClusterConfig(base_dir=tmp_path / f"c{k}", nodes=1)) for k in (1, 2)]
    errors: list[BaseException] = []

    def start(c: sc.SlurmTestCluster) -> None:
        try:
            c.up()
        except BaseException as e:  # reported below, with the other cluster's outcome
            errors.append(e)

    threads = [threading.Thread(target=start, args=(c,)) for c in pair]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        assert len({c.instance for c in pair} | {slurm_cluster.instance}) == 3
        for c in pair:
            done = _slurm(c, "srun", "-N1", "hostname")
            assert done.returncode == 0 and done.stdout.strip() == "n1", done.stderr
    finally:
        for c in pair:
            c.down(check=True)
