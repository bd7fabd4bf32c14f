"""The warm standby's decisions (daemon/job/standby.py) with the fake OS and clock: started once an attempt
trains, promoted on a relaunch (gate opened with the config version of that moment), and a cold launch —
recorded with its reason — when the standby died, is for another world size or environment; stopped at the
run's end; a timed-out standby is replaced without counting as a failure."""

from __future__ import annotations

import json
import signal

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _steps
from uls_daemon_helpers import fake_spec

from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.supervisor import Supervisor
from ulyssesd.training.spec import SpecError

S = RunState


def _sup(tmp_path, fos, restart: str = "standby = true", **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = fake_spec(tmp_path, **kw)
    path.write_text(path.read_text() + f"\n[restart]\n{restart}\n")
    spec = load_run_spec(path)
    return Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos)


def _training(sup, steps=5):
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, steps)
    assert sup.state == S.RUNNING


def _crash(sup, fos):
    """SIGKILL of the training attempt; the tick handles the crash and relaunches."""
    fos.die(sup.job.pid, ExitStatus(None, signal.SIGKILL, "wait"))
    sup.tick()


def _patch(sup, patch, reason):
    """A new config version as a remediation makes one (the method's name differs across the loop's split)."""
    new_version = getattr(sup, "new_config_version", None) or sup._new_config_version
    return new_version(patch, reason)


def _launch_reason(sup, attempt):
    rows = [t for t in sup.store.list_transitions(sup.run_id) if t.to_state == S.STARTING and t.attempt == attempt]
    return rows[-1].reason


def test_standby_starts_after_the_first_step_and_is_promoted_with_the_config_of_the_relaunch(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    sup.tick()
    assert sup.standby.current is None and len(fos.spawns) == 1  # no step yet: no standby (negative control)
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 3)
    sb = sup.standby.current
    assert sb is not None and sb.attempt == 2 and len(fos.spawns) == 2
    assert "--standby-gate" in sb.plan.argv and "--config" not in sb.plan.argv
    assert sb.plan.env["ULYSSESD_STANDBY_PRELOAD"] == "1"
    _steps(sup, 4, 6)
    assert len(fos.spawns) == 2  # one standby at a time
    # A remediation patches the config after the standby started: the gate must carry the new version.
    version, _ = _patch(sup, {"train.gradient_clipping": 0.5}, "test: a patch after the standby started")
    assert version == 2
    assert not sb.gate.exists()
    _crash(sup, fos)
    assert sup.attempt == 2 and sup.job == sb.job and len(fos.spawns) == 2  # promoted, not spawned
    gate = json.loads(sb.gate.read_text())
    assert gate["attempt"] == 2 and gate["config_version"] == 2 and gate["config"].endswith("configs/v2.json")
    att = sup.store.get_attempt(sup.run_id, 2)
    assert "--standby-gate" in att.command and att.config_version == 2  # the attempt row says it
    assert "warm standby promoted" in _launch_reason(sup, 2)
    # The promoted attempt trains: the next standby (attempt 3) follows.
    _emit(sup, kind="event", event="started", step=4)
    _steps(sup, 5, 6)
    assert sup.standby.current is not None and sup.standby.current.attempt == 3 and len(fos.spawns) == 3


def test_a_dead_standby_falls_back_to_a_cold_launch_and_says_why(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, restart="standby = true\nstandby_max_failures = 1")
    _training(sup)
    sb = sup.standby.current
    sb.plan.log_path.write_text("standby log\nTraceback: boom\n")
    fos.die(sb.job.pid, ExitStatus(1, None, "wait"))
    sb.plan.exit_file.write_text('{"returncode": 1, "signal": null}')
    sup.tick()
    assert sup.standby.current is None and sup.standby.failures == 1
    assert not sb.plan.exit_file.exists()  # would shadow the exit of a cold attempt 2
    assert list(sb.plan.log_path.parent.glob("standby-2-*.log"))  # its log set aside, not lost
    _steps(sup, 6, 8)
    assert sup.standby.current is None  # standby_max_failures reached: no new standby
    _crash(sup, fos)
    assert sup.attempt == 2 and sup.job != sb.job and len(fos.spawns) == 3  # cold
    assert "cold launch (standby not used: the standby died (exit code 1))" in _launch_reason(sup, 2)
    assert "--config" in sup.store.get_attempt(sup.run_id, 2).command


def test_a_standby_for_another_world_size_or_environment_is_killed_and_the_launch_is_cold(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    _training(sup)
    sb = sup.standby.current
    launcher = sup.spec.launcher.model_copy(update={"nproc_per_node": 2})
    sup.spec = sup.spec.model_copy(update={"launcher": launcher})
    _crash(sup, fos)
    assert sup.job != sb.job and not fos.is_alive(sb.job)
    assert (sb.job.pid, signal.SIGKILL) in [(p, s) for _, p, s in fos.signals]
    assert "started for world size 1, the relaunch needs 2" in _launch_reason(sup, 2)

    fos2 = FakeOS()
    sup2 = _sup(tmp_path / "env", fos2)
    _training(sup2)
    sb2 = sup2.standby.current
    # The memory ladder's allocator setting reaches the ranks' environment: a warm process cannot take it.
    _patch(sup2, {"launcher.env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "test")
    _crash(sup2, fos2)
    assert sup2.job != sb2.job and not fos2.is_alive(sb2.job)
    assert "launcher environment changed since it started (PYTORCH_CUDA_ALLOC_CONF)" in _launch_reason(sup2, 2)


def test_a_timed_out_standby_is_replaced_and_not_counted_as_a_failure(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, restart="standby = true\nstandby_max_failures = 1")
    _training(sup)
    sb = sup.standby.current
    fos.die(sb.job.pid, ExitStatus(5, None, "wait"))
    sup.tick()
    assert sup.standby.failures == 0 and sup.standby.current is not None and sup.standby.current.job != sb.job


def test_standby_is_stopped_when_the_run_ends_or_is_stopped(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    _training(sup)
    sb = sup.standby.current
    _emit(sup, kind="event", event="exiting", step=5, reason="completed")
    fos.die(sup.job.pid, ExitStatus(0, None, "wait"))
    sup.run_forever()
    assert sup.state == S.COMPLETED and not fos.is_alive(sb.job) and sup.standby.current is None

    fos2 = FakeOS()
    fos2.term_behaviour = "exit0"
    sup2 = _sup(tmp_path / "stop", fos2)
    _training(sup2)
    sb2 = sup2.standby.current
    assert sup2.handle_command({"cmd": "stop", "args": {}, "peer": {"uid": 0}})["ok"]
    sup2.tick()
    assert not fos2.is_alive(sb2.job) and sup2.standby.current is None


def test_standby_off_by_default_and_refused_where_it_cannot_have_its_own_rendezvous(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, restart="")
    _training(sup)
    assert sup.standby.current is None and len(fos.spawns) == 1
    _crash(sup, fos)
    assert "standby" not in _launch_reason(sup, 2)
    with pytest.raises(SpecError, match="restart.standby needs launcher.kind 'torchrun' or 'local' on one node"):
        _sup(tmp_path / "srun", FakeOS(), launcher={"kind": "srun", "nnodes": 2})


def test_a_standby_left_by_a_dead_daemon_is_killed_by_the_next_one(tmp_path):
    from ulyssesd.daemon.job.launcher import job_marker

    class LeftBehind(FakeOS):
        """One process of a previous daemon's standby carries the next attempt's marker."""

        def __init__(self):
            super().__init__()
            self.orphan_alive, self.scanned = True, []

        def job_pids(self, job, marker=None):
            self.scanned.append(marker)
            if job.pid == 0 and self.orphan_alive and marker == self.want:
                return [4242]
            return super().job_pids(job, marker)

        def signal_pids(self, pids, sig):
            if 4242 in pids and sig == signal.SIGKILL:
                self.orphan_alive = False
            return super().signal_pids([p for p in pids if p != 4242], sig) + ([4242] if 4242 in pids else [])

    fos = LeftBehind()
    sup = _sup(tmp_path, fos)
    sup.start()
    fos.want = job_marker(sup.run_id, sup.run_dir, sup.attempt + 1)
    sup.tick()
    assert not fos.orphan_alive and fos.want in fos.scanned
    assert sup.job is not None and fos.is_alive(sup.job)  # the training attempt is untouched


def test_the_gate_opens_only_once_the_old_attempt_is_gone(tmp_path):
    class Lingering(FakeOS):
        """Attempt 1's rank outlives the SIGKILLs (an unkillable D-state process) until `freed`."""

        freed = False

        def job_pids(self, job, marker=None):
            if job.pid == 1000 and not self.freed:
                return [1001]
            return super().job_pids(job, marker)

    fos = Lingering()
    sup = _sup(tmp_path, fos)
    _training(sup)
    sb = sup.standby.current
    _crash(sup, fos)
    # Still there after the bounded wait (10 s of the fake clock): no gate, the standby is killed, cold launch.
    assert not sb.gate.exists() and not fos.is_alive(sb.job) and sup.job != sb.job
    assert "the previous attempt's processes are still alive" in _launch_reason(sup, 2)
    kills = [t for t, p, s in fos.signals if p == 1001 and s == signal.SIGKILL]
    assert len(kills) > 1 and kills[-1] - kills[0] >= 9.9  # retried, bounded

    fos2 = Lingering()
    sup2 = _sup(tmp_path / "freed", fos2)
    _training(sup2)
    sb2 = sup2.standby.current
    fos2.freed = True  # gone by the time the relaunch looks
    _crash(sup2, fos2)
    assert sb2.gate.exists() and sup2.job == sb2.job


def test_status_says_whether_a_standby_is_warm(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.start()
    assert sup.status_dict()["standby"] is None  # not before the attempt trains
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 3)
    sb = sup.standby.current
    got = sup.status_dict()["standby"]
    assert got["attempt"] == 2 and got["pid"] == sb.job.pid and got["ready_ranks"] == 0
    ready = sup.run_dir / "standby" / "attempt-2-rank-0.ready"
    ready.parent.mkdir(parents=True, exist_ok=True)  # the standby's rank writes it when warm
    ready.write_text(json.dumps({"pid": 1, "warm_s": 3.0}))
    assert sup.status_dict()["standby"]["ready_ranks"] == 1
