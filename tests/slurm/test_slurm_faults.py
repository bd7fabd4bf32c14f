"""Slurm fault logic with a fake Slurm (the `SlurmCommands` seam) and a fake clock: the watcher (submit, attach,
node loss, signals through scancel, bounded polling) and the supervisor's decisions on a job's end (a lost node
is named, excluded within bounds and resumed from; a time limit is a continuation outside the restart budget;
re-adoption by job id; stack dumps through scancel)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from uls_daemon_helpers import fake_spec  # noqa: E402

from ulyssesd.daemon.host.process import ExitStatus, HostLoad, JobHandle  # noqa: E402
from ulyssesd.daemon.job import slurm as sl  # noqa: E402
from ulyssesd.daemon.job.slurm_watch import MAX_QUERY_FAILURES, Watcher, WatchPlan, read_end  # noqa: E402
from ulyssesd.daemon.spec import load_run_spec  # noqa: E402
from ulyssesd.daemon.store import open_store  # noqa: E402
from ulyssesd.daemon.store.enums import RunState  # noqa: E402
from ulyssesd.daemon.supervisor import Supervisor  # noqa: E402

S = RunState


class FakeSlurm:
    """A scheduler in memory: jobs with a state and node list, nodes with a state, every call recorded."""

    def __init__(self, nodes=("n1", "n2", "n3")):
        self.nodes = {n: "IDLE" for n in nodes}
        self.jobs: dict[str, dict[str, str]] = {}
        self.calls: list[tuple] = []
        self.next_id = 100
        self.fail_queries = 0
        self.on_poll = None  # callable(fake, job_id) run at each job() call: the test's scenario

    def sbatch(self, script, args, env):
        self.calls.append(("sbatch", tuple(args)))
        job_id = str(self.next_id)
        self.next_id += 1
        exclude = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--exclude=")), [])
        want = int(next(a.split("=")[1] for a in args if a.startswith("--nodes=")))
        free = [n for n in self.nodes if n not in exclude and not sl.node_lost(self.nodes[n])][:want]
        self.jobs[job_id] = {"JobId": job_id, "JobState": "RUNNING", "NodeList": ",".join(free), "ExitCode": "0:0"}
        for n in free:
            self.nodes[n] = "ALLOCATED"
        return job_id

    def job(self, job_id):
        self.calls.append(("job", job_id))
        if self.fail_queries:
            self.fail_queries -= 1
            raise sl.SlurmError("scontrol: Socket timed out on send/recv operation")
        if self.on_poll is not None:
            self.on_poll(self, job_id)
        return dict(self.jobs[job_id]) if job_id in self.jobs else None

    def node(self, name):
        return {"NodeName": name, "State": self.nodes[name], "Reason": "Not responding"
                if sl.node_lost(self.nodes[name]) else ""} if name in self.nodes else None

    def sacct(self, job_id):
        raise sl.SlurmError("sacct: Slurm accounting storage is disabled")

    def partition_nodes(self, partition):
        return list(self.nodes)

    def scancel(self, job_id, signal=None, full=False):
        self.calls.append(("scancel", job_id, signal))
        if signal is None and job_id in self.jobs:
            self.end(job_id, "CANCELLED", "0:15")

    def raw(self, argv):
        return " ".join(argv)

    def end(self, job_id, state, code="0:0"):
        self.jobs[job_id].update(JobState=state, ExitCode=code)
        for n in self.jobs[job_id]["NodeList"].split(","):
            if self.nodes.get(n) == "ALLOCATED":
                self.nodes[n] = "IDLE"

    def cancels(self, sig=None):
        return [c for c in self.calls if c[0] == "scancel" and c[2] == sig]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def _plan(tmp_path, attempt=1, grace=10.0):
    (tmp_path / "slurm").mkdir(parents=True, exist_ok=True)
    return WatchPlan(run_dir=str(tmp_path), attempt=attempt, script=str(tmp_path / "x.sbatch"),
                     sbatch_args=["--nodes=2", "--ntasks-per-node=1"], env={}, ntasks_per_node=1, poll_s=1.0,
                     command_timeout_s=5.0, cancel_grace_s=grace)


def _watcher(tmp_path, fake, **kw):
    clock = Clock()
    return Watcher(_plan(tmp_path, **kw), fake, clock=clock, sleep=clock.sleep, say=lambda m: None), clock


# ------------------------------------------------------------------------------------------ watcher
def test_watcher_cancels_at_once_when_a_node_goes_down_and_names_it(tmp_path):
    fake = FakeSlurm()

    def scenario(f, job_id):
        if sum(c[0] == "job" for c in f.calls) == 3:
            f.nodes["n2"] = "DOWN*"  # slurmd stopped answering mid-run

    fake.on_poll = scenario
    w, clock = _watcher(tmp_path, fake)
    end, code = w.run()
    assert end.kind == "node_lost" and end.lost_nodes == ["n2"] and end.lost_ranks == {"n2": [1]}
    assert fake.cancels() == [("scancel", "100", None)] and code == 1
    assert clock.t <= 4.0  # cancelled on the poll that saw it, not at a timeout
    assert read_end(tmp_path, 1).lost_nodes == ["n2"]
    assert "sacct_error" in end.evidence and "accounting storage is disabled" in end.evidence["sacct_error"]
    assert json.loads((tmp_path / "slurm" / "attempt-1.job.json").read_text())["job_id"] == "100"


def test_watcher_leaves_a_healthy_job_alone_until_it_completes(tmp_path):
    fake = FakeSlurm()

    def scenario(f, job_id):
        if sum(c[0] == "job" for c in f.calls) == 20:
            f.end(job_id, "COMPLETED")

    fake.on_poll = scenario
    w, _ = _watcher(tmp_path, fake)
    end, code = w.run()
    assert end.kind == "completed" and code == 0 and not [c for c in fake.calls if c[0] == "scancel"]


def test_watcher_attaches_to_a_recorded_job_instead_of_submitting(tmp_path):
    fake = FakeSlurm()
    fake.jobs["77"] = {"JobId": "77", "JobState": "COMPLETED", "NodeList": "n1,n3", "ExitCode": "0:0"}
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": "77"}))
    w, _ = _watcher(tmp_path, fake)
    end, _ = w.run()
    assert not [c for c in fake.calls if c[0] == "sbatch"] and end.job_id == "77" and end.nodes == ["n1", "n3"]


def test_watcher_routes_signals_through_scancel_then_kills_after_the_grace(tmp_path):
    fake = FakeSlurm()
    w, clock = _watcher(tmp_path, fake, grace=5.0)

    def scenario(f, job_id):
        n = sum(c[0] == "job" for c in f.calls)
        if n == 2:
            w.want_dump = True  # the daemon's SIGUSR1 (hang path)
        if n == 4:
            w.want_term = 1  # the daemon's SIGTERM (stop / restart); this job ignores it

    fake.on_poll = scenario
    end, _ = w.run()
    assert fake.cancels("USR1") == [("scancel", "100", "USR1")]
    assert fake.cancels("TERM") == [("scancel", "100", "TERM")]
    assert fake.cancels() == [("scancel", "100", None)]  # grace over: cancelled outright
    term_at = [i for i, c in enumerate(fake.calls) if c == ("scancel", "100", "TERM")][0]
    kill_at = [i for i, c in enumerate(fake.calls) if c == ("scancel", "100", None)][0]
    assert sum(c[0] == "job" for c in fake.calls[term_at:kill_at]) >= 4  # ~5 polls of 1 s between
    assert end.kind == "cancelled"


def test_watcher_survives_a_busy_controller_but_gives_up_bounded(tmp_path):
    fake = FakeSlurm()
    fake.fail_queries = 3  # a few timeouts: the watch goes on

    def scenario(f, job_id):
        if sum(c[0] == "job" for c in f.calls) == 8:
            f.end(job_id, "COMPLETED")

    fake.on_poll = scenario
    end, _ = _watcher(tmp_path, fake)[0].run()
    assert end.kind == "completed"
    dead = FakeSlurm()
    dead.fail_queries = 10_000  # the controller never answers: bounded, and the job is not left unwatched
    w, _ = _watcher(tmp_path / "b", dead)
    w.run()
    assert sum(c[0] == "job" for c in dead.calls) >= MAX_QUERY_FAILURES
    assert dead.cancels() == [("scancel", "100", None)]


# --------------------------------------------------------------------------------------- supervisor
class WatcherOS:
    """The OS seam where every attempt is one watcher process (no local ranks, as on a login node)."""

    def __init__(self):
        self.t, self.m = 1_000_000.0, 0.0
        self.jobs: dict[int, dict] = {}
        self.spawned: list[list[str]] = []
        self.signals: list[tuple[int, int]] = []
        self.next_pid = 5000

    def time(self):
        return self.t

    def monotonic(self):
        return self.m

    def sleep(self, s):
        self.advance(s)

    def advance(self, s):
        self.t += s
        self.m += s

    def host_load(self):
        return HostLoad([0.0, 0.0, 0.0], 2, [])

    def spawn(self, argv, env, cwd, log_path):
        self.spawned.append(argv)
        pid = self.next_pid
        self.next_pid += 10
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as fh:
            fh.write("[ulyssesd slurm] submitted\n")
        self.jobs[pid] = {"alive": True, "status": None}
        return JobHandle(pid, self.t)

    def start_time_of(self, pid):
        return self.t

    def is_alive(self, job):
        return job.pid in self.jobs and self.jobs[job.pid]["alive"]

    def exit_status(self, job, exit_file):
        j = self.jobs.get(job.pid)
        return None if j and j["alive"] else (j["status"] if j else ExitStatus(None, None, "unknown"))

    def die(self, pid, status):
        self.jobs[pid].update(alive=False, status=status)

    def job_pids(self, job, marker=None):
        return [job.pid, job.pid + 1] if self.is_alive(job) else []  # the wrapper and its watcher

    def rank_pids(self, job, module, marker=None):
        return []

    def signal_pids(self, pids, sig):
        self.signals += [(p, sig) for p in pids]
        return list(pids)


def _slurm_sup(tmp_path, fos, fake, slurm=None, remediation=None, run_id=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = fake_spec(tmp_path, launcher={"kind": "srun", "nnodes": 2, "nproc_per_node": 1},
                          remediation=remediation)
    with open(spec_path, "a") as fh:
        fh.write("\n[slurm]\npoll_s = 1.0\n")
        for k, v in {"mode": "submit", **(slurm or {})}.items():
            fh.write(f"{k} = {json.dumps(v)}\n")
    spec = load_run_spec(spec_path)
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos, run_id=run_id)
    sup.slurm_commands = fake
    return sup


def _watcher_ran(sup, fake, end_state, lost=(), code="0:0", timelimit=False):
    """What the attempt's watcher does in the real thing: submit, record, see the end, write it, exit."""
    plan = WatchPlan.read(sup.run_dir / "slurm" / f"attempt-{sup.attempt}.plan.json")
    job_id = fake.sbatch(Path(plan.script), plan.sbatch_args, plan.env)
    (sup.run_dir / "slurm" / f"attempt-{sup.attempt}.job.json").write_text(json.dumps({"job_id": job_id}))
    for n in lost:
        fake.nodes[n] = "DOWN*"
    fake.end(job_id, end_state, code)
    if timelimit:
        plan.time_limit_mark.touch()
    end = sl.classify_end(job_id, fake.job(job_id), [], {n: fake.nodes[n] for n in fake.nodes}, 1, timelimit)
    (sup.run_dir / "slurm" / f"attempt-{sup.attempt}.end.json").write_text(json.dumps(end.to_json()))
    return job_id, plan


def _emit(sup, **rec):
    with open(sup.telemetry_path, "a") as fh:
        fh.write(json.dumps({"v": 1, "time": sup.os.time(), "attempt": sup.attempt, **rec}) + "\n")


def test_a_lost_node_is_named_excluded_and_the_run_resumes_without_it(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    assert "ulyssesd.daemon.job.slurm_watch" in fos.spawned[0]
    first = sup.job
    job_id, plan = _watcher_ran(sup, fake, "NODE_FAIL", lost=["n2"])
    assert not any(a.startswith("--exclude") for a in plan.sbatch_args)
    fos.advance(30)
    fos.die(first.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    inc = [i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]
    assert len(inc) == 1 and "n2 (rank 1" in inc[0].summary and "excludes n2" in inc[0].summary
    assert inc[0].evidence["slurm"]["lost_nodes"] == ["n2"]
    assert sl.read_exclusions(sup.run_dir) == ["n2"]
    assert sup.attempt == 2 and sup.state == S.STARTING
    nxt = WatchPlan.read(sup.run_dir / "slurm" / "attempt-2.plan.json")
    assert "--exclude=n2" in nxt.sbatch_args
    att = sup.store.list_attempts(sup.run_id)[0]
    assert att.diagnosis == "node_lost" and att.host == f"slurm job {job_id} on n1,n2"
    # the spare takes its place: the next job runs on n1 and n3
    job2, _ = _watcher_ran(sup, fake, "COMPLETED")
    assert fake.jobs[job2]["NodeList"] == "n1,n3"


def test_a_crash_on_healthy_nodes_excludes_nothing(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    _watcher_ran(sup, fake, "FAILED", code="1:0")
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sl.read_exclusions(sup.run_dir) == []
    assert not [i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]
    assert sup.attempt == 2  # the crash path restarted it, as without Slurm
    assert not any(a.startswith("--exclude") for a in WatchPlan.read(
        sup.run_dir / "slurm" / "attempt-2.plan.json").sbatch_args)


def test_no_node_left_to_exclude_stops_the_run_with_the_explanation(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"on_node_loss": "stop"})  # shrinking: test_slurm_elastic.py
    sup.start()
    _watcher_ran(sup, fake, "NODE_FAIL", lost=["n2"])
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.state == S.FAILED
    run = sup.store.get_run(sup.run_id)
    assert "leaves 1 usable node(s) (n1)" in run.state_reason and "needs 2" in run.state_reason
    assert sl.read_exclusions(sup.run_dir) == [] and sup.attempt == 1


def test_a_time_limit_is_a_continuation_not_a_restart_against_the_budget(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    # a budget of 0 restarts per hour: any counted restart would fail the run
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"time": "10"}, remediation={"max_restarts_per_hour": 0})
    sup.start()
    for attempt in (1, 2, 3):
        plan = WatchPlan.read(sup.run_dir / "slurm" / f"attempt-{attempt}.plan.json")
        assert "--time=10" in plan.sbatch_args and "--signal=B:USR2@120" in plan.sbatch_args
        sup.latest_ckpt = (f"global_step{attempt * 5}", attempt * 5)  # each allocation saved a new checkpoint
        _emit(sup, kind="event", event="exiting", step=attempt * 5, reason="sigterm")
        _watcher_ran(sup, fake, "COMPLETED", timelimit=True)
        fos.advance(600)
        fos.die(sup.job.pid, ExitStatus(0, None, "wait"))
        sup.tick()
        assert sup.state == S.STARTING and sup.attempt == attempt + 1, sup.store.get_run(sup.run_id).state_reason
    assert not sup.counters.restarts  # none counted
    acts = [a for a in sup.store.list_actions(run_id=sup.run_id) if (a.parameters or {}).get("continuation")]
    assert len(acts) == 3 and acts[0].parameters["continuation"] == "time_limit"
    assert [a.diagnosis for a in sup.store.list_attempts(sup.run_id)[:3]] == ["time_limit"] * 3
    assert not sup.store.list_incidents(sup.run_id)  # not a failure


def test_a_time_limit_without_a_new_checkpoint_counts(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"time": "10"}, remediation={"max_restarts_per_hour": 0})
    sup.start()
    _emit(sup, kind="event", event="exiting", step=0, reason="sigterm")
    _watcher_ran(sup, fake, "COMPLETED", timelimit=True)  # the limit came before the first checkpoint
    fos.advance(600)
    fos.die(sup.job.pid, ExitStatus(0, None, "wait"))
    sup.tick()
    assert sup.state == S.FAILED and "restarts in the last hour" in sup.store.get_run(sup.run_id).state_reason


def test_a_crash_still_counts_against_the_budget(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake, remediation={"max_restarts_per_hour": 0})
    sup.start()
    _watcher_ran(sup, fake, "FAILED", code="1:0")
    fos.advance(60)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.state == S.FAILED  # the negative control of the continuation test above


def test_hang_stack_dumps_go_through_scancel_and_name_the_node(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-1.plan.json")
    job_id = fake.sbatch(Path(plan.script), plan.sbatch_args, plan.env)
    (sup.run_dir / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": job_id}))
    _emit(sup, kind="event", event="started", step=0)
    for s in range(1, 8):
        fos.advance(0.5)
        _emit(sup, kind="step", step=s, loss=3.0, step_time_s=0.5, samples=[s - 1, s])
        sup.tick()
    stacks = sup.run_dir / "stacks"
    stacks.mkdir(exist_ok=True)
    fos.advance(60)
    sup.tick()
    assert fake.cancels("USR1") == [("scancel", job_id, "USR1")]
    assert not [s for _, s in fos.signals if s == signal.SIGUSR1]  # nothing signalled locally
    (stacks / "attempt-1-rank-0.txt").write_text('Thread 0x1 (most recent call first):\n  File "x.py", line 1 in '
                                                 'all_reduce\n  File "deepspeed/comm/torch.py", line 1 in all_reduce\n')
    (stacks / "attempt-1-rank-1.txt").write_text('Thread 0x2 (most recent call first):\n  File "train.py", line 9 '
                                                 'in forward\n')
    fos.advance(sup.dcfg.stack_dump_wait_s + 0.1)
    sup.tick()
    inc = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(inc) == 1
    ev = inc[0].evidence
    assert ev.get("slurm_job") == job_id, ev.get("waited_for_ranks")
    assert ev["waited_for_nodes"] == ["n2"] and "on node n2" in inc[0].summary
    assert [p for p, s in fos.signals if s == signal.SIGTERM] == [sup.job.pid + 1]  # the watcher: scancel TERM


def test_readoption_by_job_id_starts_a_new_watcher_on_the_same_job(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake, run_id="r1")
    sup.start()
    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-1.plan.json")
    job_id = fake.sbatch(Path(plan.script), plan.sbatch_args, plan.env)
    (sup.run_dir / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": job_id}))
    fos.jobs[sup.job.pid]["alive"] = False  # the login node rebooted: the daemon and its watcher are gone
    fos.jobs[sup.job.pid]["status"] = ExitStatus(None, signal.SIGKILL, "unknown")
    before = len(fos.spawned)
    sup2 = Supervisor(sup.spec, sup.store, fos, run_id="r1")
    sup2.slurm_commands = fake
    sup2.start()
    assert len(fos.spawned) == before + 1 and fos.spawned[-1] == fos.spawned[0]  # the same watcher command
    assert sup2.attempt == 1 and sup2.job is not None and fos.is_alive(sup2.job)
    assert not [c for c in fake.calls if c[0] == "sbatch"][1:]  # no second submission
    att = sup2.store.list_attempts("r1")[0]
    assert att.pid == sup2.job.pid


def test_readoption_without_a_job_id_relaunches_as_before(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake, run_id="r2")
    sup.start()
    fos.jobs[sup.job.pid]["alive"] = False  # died before sbatch answered: no job id recorded
    fos.jobs[sup.job.pid]["status"] = ExitStatus(None, signal.SIGKILL, "unknown")
    sup2 = Supervisor(sup.spec, sup.store, fos, run_id="r2")
    sup2.slurm_commands = fake
    sup2.start()
    assert sup2.job is not None and sup2.job.pid == sup.job.pid  # nothing re-attached; the tick handles the exit


@pytest.mark.parametrize("mode", ["allocation"])
def test_allocation_mode_runs_srun_with_the_exclusions(tmp_path, mode):
    from ulyssesd.daemon.job.launcher import build_launch
    from ulyssesd.daemon.spec import run_spec_from_dict

    spec = run_spec_from_dict({"launcher": {"kind": "srun", "nnodes": 2},
                               "slurm": {"mode": mode, "exclude": ["n9"], "srun_args": ["--cpu-bind=none"]}})
    sl.write_exclusions(tmp_path, ["n2"], "lost")
    plan = build_launch(spec.launcher, run_id="r", run_dir=tmp_path, attempt=1, config_version=1,
                        slurm=spec.slurm)
    cmd = plan.argv[plan.argv.index("--") + 1:]
    assert cmd[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--exclude=n9,n2"]
    assert "--cpu-bind=none" in cmd and not (tmp_path / "slurm" / "attempt-1.plan.json").exists()


def test_a_straggler_names_its_node_and_even_steps_name_nothing(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-1.plan.json")
    job_id = fake.sbatch(Path(plan.script), plan.sbatch_args, plan.env)
    (sup.run_dir / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": job_id}))
    _emit(sup, kind="event", event="started", step=0)
    for s in range(1, 40):  # even ranks: rank 1 a hair slower, well under straggler_ratio
        fos.advance(0.5)
        _emit(sup, kind="step", step=s, loss=3.0, step_time_s=0.5, step_time_max_s=0.52, slowest_rank=1,
              samples=[s - 1, s])
        sup.tick()
    assert not [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "straggler"]
    for s in range(40, 70):  # n2 slowed down: rank 1 takes twice as long, step after step
        fos.advance(1.0)
        _emit(sup, kind="step", step=s, loss=3.0, step_time_s=0.5, step_time_max_s=1.0, slowest_rank=1,
              samples=[s - 1, s])
        sup.tick()
    inc = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "straggler"]
    assert inc and inc[0].evidence["slowest_node"] == "n2" and "(rank 1 on node n2)" in inc[0].summary


def test_a_refused_submission_stops_the_run_with_sbatch_words_and_a_transient_one_does_not(tmp_path):
    from ulyssesd.daemon.job.slurm_watch import EXIT_REFUSED

    class Refusing(FakeSlurm):
        def sbatch(self, script, args, env):
            raise sl.SubmitRefused("sbatch refused the job (exit 1): sbatch: error: invalid partition specified: gpux")

    w, _ = _watcher(tmp_path / "w", Refusing())
    with pytest.raises(sl.SubmitRefused):
        w.run()
    assert "invalid partition" in json.loads((tmp_path / "w" / "slurm" / "attempt-1.refused.json").read_text())["error"]
    assert EXIT_REFUSED == 2
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path / "a", fos, fake)
    sup.start()
    (sup.run_dir / "slurm" / "attempt-1.refused.json").write_text(json.dumps(
        {"error": "sbatch: error: invalid partition specified: gpux"}))
    fos.advance(2)
    fos.die(sup.job.pid, ExitStatus(EXIT_REFUSED, None, "wait"))
    sup.tick()
    assert sup.state == S.FAILED and "invalid partition specified: gpux" in sup.store.get_run(sup.run_id).state_reason
    assert [i.symptom.value for i in sup.store.list_incidents(sup.run_id)] == ["launch_failure"]
    # the controller was only unreachable (no refusal recorded): the crash path relaunches it
    fos2, fake2 = WatcherOS(), FakeSlurm()
    sup2 = _slurm_sup(tmp_path / "b", fos2, fake2, remediation={"max_restarts_per_hour": 10})
    sup2.start()
    with open(sup2.log_path, "a") as fh:
        fh.write("ulyssesd slurm_watch: sbatch refused the job (exit 1): sbatch: error: Socket timed out\n")
    fos2.advance(2)
    fos2.die(sup2.job.pid, ExitStatus(1, None, "wait"))
    sup2.tick()
    while sup2.state == S.BACKOFF:
        fos2.advance(1)
        sup2.tick()
    assert sup2.state != S.FAILED and sup2.attempt == 2


def test_sbatch_refusal_and_transient_errors_are_told_apart(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, err in (("sbatch", "sbatch: error: invalid partition specified: gpux"),):
        (bin_dir / name).write_text(f"#!/bin/sh\necho '{err}' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    real = sl.RealSlurm(timeout_s=5, retries=0, bin_dir=str(bin_dir))
    with pytest.raises(sl.SubmitRefused, match="invalid partition"):
        real.sbatch(tmp_path / "x.sbatch", ["--nodes=1"], {})
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Socket timed out on send/recv operation' >&2\n"
                                    "exit 1\n")
    with pytest.raises(sl.SlurmError) as exc:
        real.sbatch(tmp_path / "x.sbatch", ["--nodes=1"], {})
    assert not isinstance(exc.value, sl.SubmitRefused)
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho '42;cluster'\n")
    assert real.sbatch(tmp_path / "x.sbatch", [], {}) == "42"


def test_allocation_mode_names_a_lost_node_of_the_allocation_and_excludes_it_from_the_next_srun(
        tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"mode": "allocation"})
    sup.start()
    assert fos.spawned[0][fos.spawned[0].index("--") + 1] == "srun"
    fake.nodes["n2"] = "DOWN*"  # --no-kill kept the allocation; the step died with the node
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    inc = [i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]
    assert len(inc) == 1 and "allocation 55 lost node n2 (rank 1, state DOWN*)" in inc[0].summary
    assert sl.read_exclusions(sup.run_dir) == ["n2"] and sup.attempt == 2
    assert "--exclude=n2" in fos.spawned[-1]
    # a crash while n2 is still down (already excluded) and the rest healthy: not blamed on n2 again
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert len([i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]) == 1
    assert sl.read_exclusions(sup.run_dir) == ["n2"] and sup.attempt == 3  # the crash path restarted it
    # the job completes while n2 is down: a completion, not a node loss
    with open(sup.telemetry_path, "a") as fh:
        fh.write(json.dumps({"v": 1, "time": fos.t, "attempt": 3, "kind": "event", "event": "exiting", "step": 40,
                             "reason": "completed"}) + "\n")
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(0, None, "wait"))
    sup.tick()
    assert sup.state == S.COMPLETED


def test_a_rank_that_wrote_no_stack_dump_while_its_peer_waits_names_its_node(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-1.plan.json")
    job_id = fake.sbatch(Path(plan.script), plan.sbatch_args, plan.env)
    (sup.run_dir / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": job_id}))
    _emit(sup, kind="event", event="started", step=0)
    for s in range(1, 8):
        fos.advance(0.5)
        _emit(sup, kind="step", step=s, loss=3.0, step_time_s=0.5, samples=[s - 1, s])
        sup.tick()
    fos.advance(60)
    sup.tick()
    stacks = sup.run_dir / "stacks"
    stacks.mkdir(exist_ok=True)
    # rank 0 waits in a collective; rank 1 (SIGSTOPped on n2) writes nothing
    (stacks / "attempt-1-rank-0.txt").write_text('Thread 0x1 (most recent call first):\n  File "x.py", line 1 in '
                                                 'all_reduce\n  File "deepspeed/comm/torch.py", line 1 in all_reduce\n')
    fos.advance(sup.dcfg.stack_dump_wait_s + 0.1)
    sup.tick()
    inc = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"][0]
    assert inc.evidence["silent_ranks"] == [1] and inc.evidence["waited_for_nodes"] == ["n2"]
    assert "(rank 1 wrote no stack dump: node n2)" in inc.summary


def test_every_rank_dumped_and_none_is_waited_for_names_no_node(tmp_path):
    from ulyssesd.daemon.job.slurm_supervise import hang_nodes

    fos, fake = WatcherOS(), FakeSlurm()
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    job_id = fake.sbatch(Path("x"), ["--nodes=2"], {})
    (sup.run_dir / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": job_id}))
    assert hang_nodes(sup, [], [0, 1]) == {}  # both dumped, nobody named: no node blamed
    assert hang_nodes(sup, [], []) == {}  # nobody dumped: no contrast, no node blamed
    assert hang_nodes(sup, [1], [0, 1])["note"] == "on node n2"
