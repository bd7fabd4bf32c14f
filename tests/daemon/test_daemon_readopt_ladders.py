"""A re-adopting daemon's engine continues each remediation ladder where the dead daemon left it
(core/startup.restore_ladders), on the fake OS and a real store.

The telemetry replay walks a fresh engine through the findings again, but a crash's and a hang's decisions
come from the exit handling and the clock, not from a record: before the restore, a re-adopted run's next
segfault or hang started its ladder at rung 0 and got its `max_crash_restarts` afresh (a restart where the
same daemon would have stopped). Each case runs once without and once with re-adoptions between the faults:
the decisions must be the same.
"""

from __future__ import annotations

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _sup

from ulyssesd.daemon.core.startup import ladder_position
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.playbook import K_CLIP, LADDERS

SEGV = "Fatal Python error: Segmentation fault\n"


def _steps(sup, a, b, spike=(), dt=0.5):
    for s in range(a, b + 1):
        sup.os.advance(dt)
        loss = (3.0 - 0.01 * s) * (30.0 if s in spike else 1.0)
        _emit(sup, kind="step", step=s, loss=loss, step_time_s=dt, samples=[s - 1, s])
        sup.tick()


def _until_next_attempt_or_end(sup, fos):
    n = sup.attempt
    for _ in range(200):
        fos.advance(1.0)
        sup.tick()
        if (sup.attempt == n + 1 and sup.job is not None) or sup.state.value == "FAILED":
            return


def _rungs(sup):
    return [(a.parameters.get("ladder"), a.parameters.get("rung")) for a in sup.store.list_actions(run_id=sup.run_id)]


def _run(tmp_path, fault, faults, readopt, **kw):
    """Train, then `faults` times: the fault, the next attempt trains 5 steps; a new daemon re-adopts the run
    before each fault after the first when `readopt`. Returns the supervisor in charge at the end."""
    fos = FakeOS()
    kw = {"steps": 400, "interval": 10, **kw}
    sup = _sup(tmp_path, fos, **kw)
    sup.start()
    _emit(sup, kind="event", event="started", step=0, config_version=sup.config_version)
    _steps(sup, 1, 12)
    _emit(sup, kind="event", event="checkpoint_saved", step=10, tag="step-00000010")
    sup.tick()
    for n in range(faults):
        if readopt and n:
            sup = _sup(tmp_path, fos, **kw)  # the previous daemon "died"; this one adopts its live attempt
            sup.start()
            assert sup.job is not None and len(fos.spawns) == n + 1  # adopted, not relaunched
        fault(sup, fos)
        _until_next_attempt_or_end(sup, fos)
        if sup.state.value == "FAILED":
            return sup
        _emit(sup, kind="event", event="started", step=10, config_version=sup.config_version)
        _steps(sup, 11, 15)
    return sup


def _segfault(sup, fos):
    with open(sup.log_path, "a") as fh:
        fh.write(SEGV)
    fos.die(sup.job.pid, ExitStatus(-11, None, "wait"))


def _hang(sup, fos):
    pass  # no more steps: the hang detector's timeout runs out while the loop ticks


@pytest.mark.parametrize("readopt", [False, True], ids=["same daemon", "re-adopted between crashes"])
@pytest.mark.parametrize("budget", [1, 2])
def test_a_crash_after_readoption_uses_up_the_same_restart_bound(tmp_path, readopt, budget):
    sup = _run(tmp_path, _segfault, budget + 1, readopt, remediation={"max_crash_restarts": budget})
    # `budget` restarts, then the bound: stop (re-adopted: was a restart each time, without end)
    assert _rungs(sup) == [("restart", "restart")] * budget + [("restart", "stop_alert")], _rungs(sup)
    assert sup.state.value == "FAILED" and sup.attempt == budget + 1


@pytest.mark.parametrize("readopt", [False, True], ids=["same daemon", "re-adopted between hangs"])
def test_a_hang_after_readoption_goes_to_the_next_rung(tmp_path, readopt):
    sup = _run(tmp_path, _hang, 2, readopt, remediation={"max_crash_restarts": 1},
               detectors={"hang_timeout_floor_s": 10.0}, daemon={"stack_dump_wait_s": 0.5, "hang_grace_s": 1.0})
    # the second hang is past the hang ladder's one restart: the run ends (re-adopted: it was restarted again)
    assert sup.state.value == "FAILED" and sup.attempt == 2, (sup.state, sup.attempt, _rungs(sup))
    assert _rungs(sup) == [("hang", "hang_restart"), ("hang", "stop_alert")], _rungs(sup)  # the stop is recorded
    hangs = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert [i.status.value for i in hangs] == ["failed", "failed"]  # the first fix was never verified either
    assert "stop the run and alert" in hangs[-1].status_reason


@pytest.mark.parametrize("readopt", [False, True], ids=["same daemon", "re-adopted between spikes"])
def test_a_second_loss_spike_after_readoption_takes_the_next_rung_and_the_clip_stays_at_its_floor(tmp_path, readopt):
    fos = FakeOS()
    kw = {"steps": 400, "interval": 10, "remediation": {"grace_steps": 0}}
    sup = _sup(tmp_path, fos, **kw)
    sup.start()
    _emit(sup, kind="event", event="started", step=0, config_version=sup.config_version)
    _steps(sup, 1, 40, spike={30})
    assert _rungs(sup) == [("loss", "lower_clip")] and sup.engine.values[K_CLIP] == 0.5
    if readopt:
        sup = _sup(tmp_path, fos, **kw)
        sup.start()
        assert sup.engine.ladders["loss"].position == 0 and sup.engine.ladders["loss"].uses == 1
    _steps(sup, 41, 80, spike={60})
    assert _rungs(sup) == [("loss", "lower_clip"), ("loss", "fp32_layers")], _rungs(sup)
    assert sup.engine.values[K_CLIP] == 0.5  # not lowered a second time (its floor: once per ladder)


# ------------------------------------------------------------------------------------ the walk itself
POLICY = RemediationConfig(max_crash_restarts=3)


def _uses(action):
    return action.max_uses(POLICY)


def test_the_walk_counts_uses_moves_on_and_reads_a_repeated_rung_name_in_order():
    assert ladder_position("loss", [("lower_clip", 30)], 200, _uses, 40) == (0, 1, 190)
    assert ladder_position("loss", [("lower_clip", 30), ("fp32_layers", 60)], 200, _uses, 80) == (1, 1, 180)
    # the nan ladder has rollback_skip twice: the second one (after lower_lr) is position 4, not 0
    nan = [("rollback_skip", 5), ("lower_clip", 9), ("fp32_layers", 12), ("lower_lr", 20), ("rollback_skip", 25)]
    assert LADDERS["nan"][4].kind == "rollback_skip"
    assert ladder_position("nan", nan, 200, _uses, 30)[:2] == (4, 1)
    assert ladder_position("restart", [("restart", 10), ("restart", 20)], 200, _uses, 25) == (0, 2, 195)


def test_a_repeatable_rung_verified_since_is_fresh_and_an_unverified_one_is_not():
    # a restart 300 steps ago (verify window 200) was verified: uses 0, as the engine's window leaves it
    assert ladder_position("restart", [("restart", 10), ("restart", 20)], 200, _uses, 320) == (0, 0, 0)
    # two restarts 300 steps apart: the window between them passed, so they are not two in a row
    assert ladder_position("restart", [("restart", 10), ("restart", 310)], 200, _uses, 320) == (0, 1, 190)
    # a once-only rung stays used however long ago
    assert ladder_position("loss", [("lower_clip", 10)], 200, _uses, 5000) == (0, 1, 0)
