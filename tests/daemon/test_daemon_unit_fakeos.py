"""Fast tests of the state machine and the supervisor's fault logic with a fake OS and a fake clock."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec

from ulyssesd.daemon.core.launch import checkpoint_for
from ulyssesd.daemon.core.states import TRANSITIONS, IllegalTransition, can_transition, check_transition
from ulyssesd.daemon.host.process import ExitStatus, HostLoad, JobHandle
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import TERMINAL_RUN_STATES, RunState
from ulyssesd.daemon.supervisor import Supervisor

S = RunState


# ------------------------------------------------------------------------------------ state machine
def test_every_state_reaches_a_terminal_state_and_terminals_are_final():
    graph: dict[RunState, set[RunState]] = {}
    for a, b in TRANSITIONS:
        graph.setdefault(a, set()).add(b)
    for st in RunState:
        if st in TERMINAL_RUN_STATES:
            assert st not in graph
            with pytest.raises(IllegalTransition, match="terminal"):
                check_transition(st, S.RUNNING)
            continue
        seen, todo = set(), [st]
        while todo:
            cur = todo.pop()
            for nxt in graph.get(cur, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen & TERMINAL_RUN_STATES, st


def test_illegal_transition_names_both_states_and_allowed_ones():
    assert not can_transition(S.PAUSED, S.RUNNING)
    with pytest.raises(IllegalTransition, match=r"PAUSED -> RUNNING.*allowed from PAUSED: \['STARTING', 'STOPPED'\]"):
        check_transition(S.PAUSED, S.RUNNING)
    assert check_transition(S.RUNNING, S.REMEDIATING) == "anomaly detected"


def test_transition_table_is_commented_with_a_reason():
    src = (Path(__file__).parents[2] / "daemon" / "core" / "states.py").read_text()
    for a, b in TRANSITIONS:
        assert f"# {a.value} -> {b.value} because" in src, (a, b)


# ---------------------------------------------------------------------------------------- fake OS
class FakeOS:
    def __init__(self):
        self.t, self.m = 1_000_000.0, 0.0
        self.jobs: dict[int, dict] = {}
        self.signals: list[tuple[float, int, int]] = []
        self.spawns: list[float] = []
        self.fail_spawn = 0
        self.next_pid = 1000
        self.term_behaviour = "ignore"  # "exit0": a SIGTERM'd job saves and exits 0; "ignore": hung

    def time(self):
        return self.t

    def monotonic(self):
        return self.m

    def sleep(self, s):
        self.advance(s)

    def host_load(self):
        return HostLoad([0.0, 0.0, 0.0], 2, [])

    def advance(self, s):
        self.t += s
        self.m += s

    def spawn(self, argv, env, cwd, log_path):
        self.spawns.append(self.t)
        if self.fail_spawn:
            self.fail_spawn -= 1
            raise OSError(2, "No such file or directory", argv[0])
        pid = self.next_pid
        self.next_pid += 10
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("starting\n")
        self.jobs[pid] = {"alive": True, "status": None, "ranks": [pid + 1, pid + 2], "log": log_path}
        return JobHandle(pid, self.t)

    def start_time_of(self, pid):
        return self.t

    def is_alive(self, job):
        return self.jobs[job.pid]["alive"]

    def exit_status(self, job, exit_file):
        j = self.jobs[job.pid]
        return None if j["alive"] else j["status"]

    def die(self, pid, status):
        self.jobs[pid].update(alive=False, status=status)

    def job_pids(self, job, marker=None):
        j = self.jobs.get(job.pid)
        return [job.pid, *j["ranks"]] if j and j["alive"] else []

    def rank_pids(self, job, module, marker=None):
        j = self.jobs.get(job.pid)
        return list(j["ranks"]) if j and j["alive"] else []

    def signal_pids(self, pids, sig):
        for pid in pids:
            self.signals.append((self.m, pid, sig))
            owner = next((p for p, j in self.jobs.items() if pid == p or pid in j["ranks"]), None)
            if owner is None or not self.jobs[owner]["alive"]:
                continue
            if sig == signal.SIGUSR1:
                with open(self.jobs[owner]["log"], "a") as fh:
                    fh.write(f'Current thread 0x{pid:x} (most recent call first):\n  File "train.py", line 1 in step\n')
            elif sig == signal.SIGKILL:
                self.die(owner, ExitStatus(None, signal.SIGKILL, "wait"))
            elif sig == signal.SIGTERM and self.term_behaviour == "exit0":
                self.die(owner, ExitStatus(0, None, "file"))
        return list(pids)


def _sup(tmp_path, fos, **kw):
    spec = load_run_spec(fake_spec(tmp_path, **kw))
    store = open_store(spec.daemon.resolved_db_path(), clock=fos)  # rows stamped on the fake clock too
    return Supervisor(spec, store, fos)


def _emit(sup, **rec):
    rec = {"v": 1, "time": sup.os.time(), "attempt": sup.attempt, **rec}
    with open(sup.telemetry_path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def _steps(sup, a, b, dt=0.5):
    for s in range(a, b + 1):
        sup.os.advance(dt)
        _emit(sup, kind="step", step=s, loss=3.0 - 0.01 * s, step_time_s=dt, samples=[s - 1, s])
        sup.tick()


def test_hang_sequence_dump_then_term_then_kill_then_relaunch(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"stack_dump_wait_s": 2.0, "hang_grace_s": 5.0},
               detectors={"hang_timeout_floor_s": 10.0})
    sup.start()
    job1 = sup.job
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    assert sup.state == S.RUNNING
    fos.advance(9.0)
    sup.tick()
    assert not fos.signals  # 9 s < 10 s timeout: nothing yet (negative control)
    fos.advance(2.0)
    sup.tick()
    assert [(p, s) for _, p, s in fos.signals] == [(job1.pid + 1, signal.SIGUSR1), (job1.pid + 2, signal.SIGUSR1)]
    assert sup.state == S.RESTARTING
    fos.advance(1.0)
    sup.tick()
    assert all(s == signal.SIGUSR1 for _, _, s in fos.signals)  # still waiting for the dumps
    fos.advance(1.5)
    sup.tick()
    terms = [p for _, p, s in fos.signals if s == signal.SIGTERM]
    assert terms == [job1.pid + 1, job1.pid + 2]
    fos.advance(4.0)
    sup.tick()
    assert not any(s == signal.SIGKILL for _, _, s in fos.signals)  # grace not over
    fos.advance(1.5)
    sup.tick()
    assert any(s == signal.SIGKILL for _, _, s in fos.signals)
    sup.tick()
    assert sup.attempt == 2 and sup.job.pid != job1.pid and sup.state == S.STARTING
    inc = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(inc) == 1 and "Current thread" in inc[0].evidence["stacks"]


def test_early_deaths_back_off_exponentially_then_fail(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"backoff_base_s": 2.0, "backoff_max_s": 100.0, "early_death_s": 30.0},
               remediation={"max_restarts_per_hour": 20, "no_progress_restarts": 20, "max_crash_restarts": 5})
    sup.start()
    for _ in range(12):
        if sup.state == S.FAILED:
            break
        if sup.job is not None and fos.is_alive(sup.job):
            fos.advance(1.0)
            with open(fos.jobs[sup.job.pid]["log"], "a") as fh:
                fh.write("Traceback (most recent call last):\nRuntimeError: boom at start\n")
            fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
        sup.tick()
        while sup.state == S.BACKOFF:
            fos.advance(0.25)
            sup.tick()
    assert sup.state == S.FAILED
    gaps = [b - a for a, b in zip(fos.spawns, fos.spawns[1:], strict=False)]
    assert len(gaps) >= 3
    # 1 s of runtime + backoff 2, 4, 8 ... (x1..1.25 jitter): strictly growing
    assert all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:], strict=False)), gaps
    assert gaps[0] >= 3.0


def test_launcher_that_cannot_start_is_retried_then_run_fails(tmp_path, monkeypatch):
    import tenacity

    monkeypatch.setattr(tenacity.nap, "sleep", lambda s: None)
    fos = FakeOS()
    fos.fail_spawn = 99
    sup = _sup(tmp_path, fos, daemon={"launch_retries": 2})
    sup.start()
    assert len(fos.spawns) == 3  # 1 + 2 retries, bounded
    assert sup.state == S.FAILED
    inc = sup.store.list_incidents(sup.run_id)
    assert [i.symptom.value for i in inc] == ["launch_failure"]
    assert "No such file or directory" in inc[0].summary


def test_daemon_signal_detaches_without_touching_the_job(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    sup.enqueue("signal", signal.SIGTERM)
    sup.tick()
    assert sup.detach and fos.signals == [] and fos.is_alive(sup.job)


def test_readopt_live_job_with_fake_os(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 5)
    pid = sup.job.pid
    sup2 = _sup(tmp_path, fos)  # same spec: finds the unfinished run
    sup2.start()
    assert sup2.run_id == sup.run_id and sup2.job.pid == pid and sup2.attempt == 1
    assert len(fos.spawns) == 1  # nothing relaunched
    assert sup2.last_step == 5
    fos.die(pid, ExitStatus(0, None, "file"))
    _emit(sup2, kind="event", event="exiting", reason="completed", step=5)
    sup2.tick()
    assert sup2.state == S.COMPLETED


def _make_tag(ckdir: Path, step: int) -> None:
    from ulyssesd.training import checkpoint as ck

    d = ckdir / ck.tag_for_step(step)
    d.mkdir(parents=True)
    (d / "state.bin").write_bytes(bytes([step % 256]) * 64)
    ck.write_manifest(d, step, 1.0, step, 1)


def test_rollback_picks_newest_valid_tag_at_or_before_target_and_sets_newer_aside(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (5, 10, 15):
        _make_tag(sup.ckpt_dir, s)
    tag, notes = checkpoint_for(sup, rollback_to_step=7)
    assert tag == "step-00000005" and notes == []
    names = sorted(p.name for p in sup.ckpt_dir.iterdir())
    assert any(n.startswith("step-00000010.rolledback-") for n in names)
    assert any(n.startswith("step-00000015.rolledback-") for n in names)
    assert (sup.ckpt_dir / "latest").read_text().strip() == "step-00000005"


def test_rollback_target_pruned_falls_back_to_oldest_valid_not_scratch(tmp_path):
    from ulyssesd.training.checkpoint import rollback_guard as rg

    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (10, 15):
        _make_tag(sup.ckpt_dir, s)
    # Only before the onset (tests/daemon/test_rollback_pending_fakeos.py has the tags after it).
    rg.write_pending(sup.run_dir, rg.PendingRollback(onset_step=13, target_step=7))
    tag, notes = checkpoint_for(sup, rollback_to_step=7)
    assert tag == "step-00000010"
    assert "no valid checkpoint at or before step 7" in notes[0]
    assert any(p.name.startswith("step-00000015.rolledback-") for p in sup.ckpt_dir.iterdir())


def test_corrupt_newest_tag_quarantined_previous_used(tmp_path):
    sup = _sup(tmp_path, FakeOS())
    sup.start()
    for s in (5, 10):
        _make_tag(sup.ckpt_dir, s)
    (sup.ckpt_dir / "step-00000010" / "state.bin").write_bytes(b"\xff" * 64)  # same size, flipped bytes
    tag, notes = checkpoint_for(sup, rollback_to_step=None)
    assert tag == "step-00000005"
    assert "step-00000010 invalid" in notes[0] and "sha256" in notes[0] and "quarantined" in notes[0]


def test_all_checkpoints_corrupt_fails_instead_of_restarting_from_scratch(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    _make_tag(sup.ckpt_dir, 5)
    (sup.ckpt_dir / "step-00000005" / "state.bin").write_bytes(b"\x00" * 64)
    fos.die(sup.job.pid, ExitStatus(None, signal.SIGKILL, "wait"))
    sup.tick()
    for _ in range(20):  # an early death backs off first
        fos.advance(1.0)
        sup.tick()
    assert sup.state == S.FAILED
    inc = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "checkpoint_corrupt"]
    assert inc and inc[-1].status.value == "failed" and "not restarting from scratch" in inc[-1].summary
    assert len(fos.spawns) == 1
    assert any(p.name.startswith("step-00000005.corrupt-") for p in sup.ckpt_dir.iterdir())  # kept


def test_readopting_daemon_still_resolves_incidents_the_dead_one_opened(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=100, interval=10)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 12)
    _emit(sup, kind="event", event="checkpoint_saved", step=10, tag="step-00000010")
    sup.tick()
    fos.die(sup.job.pid, ExitStatus(None, signal.SIGSEGV, "wait"))
    sup.tick()
    for _ in range(5):
        fos.advance(1.0)
        sup.tick()
    crash = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "crash"]
    assert crash and crash[0].status.value == "remediating" and sup.attempt == 2
    sup2 = _sup(tmp_path, fos, steps=100, interval=10)  # the first daemon "died"; a new one adopts
    sup2.start()
    assert sup2.attempt == 2
    _emit(sup2, kind="event", event="started", step=10)
    _steps(sup2, 11, 21)
    _emit(sup2, kind="event", event="checkpoint_saved", step=20, tag="step-00000020")
    sup2.tick()
    assert sup2.store.get_incident(crash[0].id).status.value == "resolved"


def test_observe_only_records_the_hang_and_touches_nothing(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, remediation={"mode": "observe"}, detectors={"hang_timeout_floor_s": 10.0})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    fos.advance(30.0)
    sup.tick()
    assert fos.signals == [] and fos.is_alive(sup.job) and sup.attempt == 1
    inc = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id)]
    assert [i.symptom.value for i in inc] == ["hang"]
    assert inc[0].actions[0].observe_only and inc[0].actions[0].kind.value == "observe_only_noop"


# ------------------------------------------------------------------------------------ rank watch
def _training_six_steps(tmp_path):
    """A supervisor (rank watch: 3 s grace, 1 s scans) whose attempt 1 has trained 6 steps. The hang timeout
    (10 s) is longer than the grace: the rank watch, not the hang detector, ends the attempt."""
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"rank_exit_grace_s": 3.0, "rank_watch_every_s": 1.0},
               detectors={"hang_timeout_floor_s": 10.0})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 6)
    return fos, sup, sup.job


def test_lost_rank_ends_the_attempt_after_grace_and_is_a_crash_with_evidence(tmp_path):
    fos, sup, job1 = _training_six_steps(tmp_path)
    assert not fos.signals
    fos.jobs[job1.pid]["ranks"].remove(job1.pid + 2)  # rank 1 SIGKILLed; torchrun still up, rank 0 blocked
    removed_at = fos.m
    while not fos.signals and fos.m - removed_at < 10:
        fos.advance(0.25)
        sup.tick()
    # Noticed at the next scan (<= 1 s), then the 3 s grace: not sooner (a normal end has time), not much later.
    assert 3.0 <= fos.m - removed_at <= 4.25, fos.m - removed_at
    assert sup.attempt == 1
    assert [(p, s) for _, p, s in fos.signals] == [(job1.pid + 1, signal.SIGTERM)]  # the survivor, no grace
    fos.advance(0.5)
    sup.tick()  # SIGKILL (grace 0) -> exit -> crash handling -> relaunch
    assert any(s == signal.SIGKILL for _, _, s in fos.signals)
    sup.tick()
    assert sup.attempt == 2
    crash = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "crash"]
    assert len(crash) == 1
    inc = sup.store.get_incident(crash[0].id)
    assert inc.evidence["rank_lost"]["pids"] == [job1.pid + 2] and "died" in inc.summary


def test_ranks_leaving_at_a_normal_end_do_not_trigger_the_rank_watch(tmp_path):
    fos, sup, job1 = _training_six_steps(tmp_path)
    _emit(sup, kind="event", event="exiting", step=6, reason="completed")
    fos.jobs[job1.pid]["ranks"].remove(job1.pid + 2)  # rank 1 left first; rank 0 and the launcher linger
    for _ in range(6):
        fos.advance(1.0)
        sup.tick()
    assert not fos.signals and sup.attempt == 1 and sup.job is job1


def test_hang_reading_names_the_waiting_ranks_and_the_rank_they_wait_for(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"stack_dump_wait_s": 1.0, "hang_grace_s": 1.0},
               detectors={"hang_timeout_floor_s": 10.0})
    sup.start()
    job1 = sup.job
    stacks = tmp_path / "state" / "runs"
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 10)
    run_stacks = sup.run_dir / "stacks"
    run_stacks.mkdir(parents=True, exist_ok=True)
    (run_stacks / "attempt-1-rank-0.txt").write_text("old dump from an operator's SIGUSR1\n")
    fos.advance(11.0)
    sup.tick()  # hang -> SIGUSR1; the ranks now write their dumps
    with open(run_stacks / "attempt-1-rank-0.txt", "a") as fh:
        fh.write(COLLECTIVE_DUMP)
    (run_stacks / "attempt-1-rank-1.txt").write_text(STRAGGLER_DUMP)
    for _ in range(6):
        fos.advance(1.0)
        sup.tick()
    assert sup.attempt == 2, [s for _, _, s in fos.signals]
    hang = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    inc = sup.store.get_incident(hang[0].id)
    assert inc.evidence["diagnosis"] == "nccl_timeout" and inc.evidence["waited_for_ranks"] == [1]
    assert "old dump" not in inc.evidence["stacks"] and "=== rank 1 stack dump" in inc.evidence["stacks"]
    assert "rank 1 is outside any collective at" in inc.summary and "faults.py" in inc.summary
    att = sup.store.list_attempts(sup.run_id)[0]
    assert att.diagnosis == "nccl_timeout"
    assert "=== rank 0 stack dump" in fos.jobs[job1.pid]["log"].read_text()  # copied into the attempt log
    assert stacks.exists()


COLLECTIVE_DUMP = '''Thread 0x00007f91310de6c0 (most recent call first):
  <no Python frame>

Current thread 0x00007f948af76140 (most recent call first):
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/streams.py", line 254 in synchronize
  File "/tmp/site/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 412 in fetch_sub_module
  File "/tmp/site/deepspeed/runtime/zero/parameter_offload.py", line 470 in pre_sub_module_forward_function
  File "/tmp/site/ulyssesd/training/model.py", line 160 in forward
  File "/tmp/site/ulyssesd/training/train.py", line 420 in _train_step_inner
  File "/tmp/site/ulyssesd/training/__main__.py", line 80 in main
'''
STRAGGLER_DUMP = '''Current thread 0x00007f2428460140 (most recent call first):
  File "/tmp/site/ulyssesd/training/faults.py", line 120 in before_step
  File "/tmp/site/ulyssesd/training/train.py", line 415 in _train_step_inner
  File "/tmp/site/ulyssesd/training/__main__.py", line 80 in main
'''


def test_python_exception_mid_run_is_one_crash_incident_labelled_by_its_traceback(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    job1 = sup.job
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 8)
    with open(fos.jobs[job1.pid]["log"], "a") as fh:
        fh.write('Traceback (most recent call last):\n  File "train.py", line 3, in step\n'
                 "RuntimeError: boom at step 9\n"
                 "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                 "Connection closed by peer [127.0.0.1]:29500\n")
    fos.advance(1.0)
    fos.die(job1.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    inc = sup.store.list_incidents(sup.run_id)
    assert [i.symptom.value for i in inc] == ["crash"], [(i.symptom.value, i.summary) for i in inc]
    att = sup.store.list_attempts(sup.run_id)[0]
    assert att.diagnosis == "python_exception" and "boom at step 9" in " ".join(att.diagnosis_evidence or [])
    assert sup.attempt == 2 or sup.state == S.BACKOFF


def test_pending_rollback_survives_a_daemon_death_between_decision_and_relaunch(tmp_path):
    fos = FakeOS()
    spec = dict(daemon={"stop_grace_s": 30.0}, detectors={"warmup_steps": 2}, remediation={"known_good_steps": 3})
    sup = _sup(tmp_path, fos, **spec)
    sup.start()
    job1 = sup.job
    _emit(sup, kind="event", event="started", step=0)
    for s in (4, 8, 12):
        _steps(sup, s - 3, s)
        _make_tag(sup.ckpt_dir, s)
        _emit(sup, kind="event", event="checkpoint_saved", step=s, tag=f"step-{s:08d}", seconds=0.1, bytes=64)
    _steps(sup, 13, 15)
    fos.advance(0.5)
    # The NaN step's own save (taken after the onset) is poisoned: never the target, set aside on relaunch.
    _emit(sup, kind="step", step=16, loss="nan", step_time_s=0.5, samples=[15, 16])
    _make_tag(sup.ckpt_dir, 16)
    _emit(sup, kind="event", event="checkpoint_saved", step=16, tag="step-00000016", seconds=0.1, bytes=64)
    sup.tick()
    assert sup.state == S.RESTARTING, sup.state
    act = next(a for a in sup.store.list_actions(run_id=sup.run_id) if a.kind.value == "rollback_skip")
    target = act.parameters["rollback_to_step"]
    assert target is not None and target < 16  # the newest clean save before the NaN, not the poisoned one
    # The daemon dies here (the job, told to stop, is still up); a new daemon re-adopts the run.
    sup2 = _sup(tmp_path, fos, **spec)
    sup2.start()
    assert sup2.job.pid == job1.pid and sup2.attempt == 1
    for _ in range(80):
        if sup2.attempt == 2:
            break
        fos.advance(0.5)
        sup2.tick()
    att2 = sup2.store.list_attempts(sup2.run_id)[1]
    expected = max(s for s in (4, 8, 12, 16) if s <= target)
    assert att2.resumed_from == f"step-{expected:08d}", (att2.resumed_from, target)
    assert any(p.name.startswith("step-00000016.rolledback-") for p in sup2.ckpt_dir.iterdir())
