"""Every step of the supervisor's tick is guarded (core/housekeeping.StepGuard), on the fake OS and a real store.

A step that raises once is logged with its traceback, recorded as one `internal_error` incident naming the step, and the
run goes on (the incident is resolved when the step runs cleanly again). A step that keeps raising is bounded:
after `[daemon] step_error_limit` ticks in a row the run ends FAILED "internal error in <step>: <exc>", its job
stopped (with the stop grace when the stop can work, killed when the broken step is the stop itself), with one
incident and a handful of log lines, not one per tick. The daemon answers `status` throughout.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs
from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup

from ulyssesd.daemon.core import commands, decisions, housekeeping, termination
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.store.enums import RunState

S = RunState
LIMIT = 3


class Injected(RuntimeError):
    pass


def _raiser(real, times):
    """`real`, except that its first `times` calls raise (times=None: every call)."""
    calls = {"n": 0}

    def body(*a, **kw):
        calls["n"] += 1
        if times is None or calls["n"] <= times:
            raise Injected("injected fault")  # the same error each time: one distinct error
        return real(*a, **kw)

    body.calls = calls
    return body


def _running(tmp_path):
    fos = FakeOS()
    fos.term_behaviour = "exit0"  # a SIGTERM'd job saves and exits 0
    sup = _sup(tmp_path, fos, daemon={"step_error_limit": LIMIT})
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 3)
    assert sup.state == S.RUNNING
    return fos, sup


def _in_backoff(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, daemon={"step_error_limit": LIMIT})
    sup.start()
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))  # dies at once, no progress: an early death
    sup.tick()
    assert sup.state == S.BACKOFF and sup.job is None
    return fos, sup


def _stopping(tmp_path):
    fos, sup = _running(tmp_path)
    fos.term_behaviour = "ignore"  # the job takes its time to save: the termination advances every tick
    assert sup.handle_command({"cmd": "stop", "peer": {"uid": 1000}})["ok"]
    assert sup.state == S.STOPPING and sup.term is not None and sup.term.termed_at is not None
    return fos, sup


def _inject(step, sup, fos, monkeypatch, times):
    """Make the code behind `step` raise; returns the raiser (its .calls counts the calls)."""
    if step == "store_check":
        target, name = housekeeping, "check_store_file"
    elif step == "commands":
        target, name = commands, "drain_events"
    elif step == "standby":
        target, name = sup.standby, "tick"
    elif step == "telemetry":
        target, name = decisions, "read_telemetry"
    elif step == "engine":
        target, name = sup.engine, "tick"
    elif step == "termination":
        target, name = termination, "advance"
    elif step == "exit_check":
        target, name = fos, "exit_status"
    elif step == "rank_watch":
        target, name = sup.rank_watch, "observe"
    elif step == "relaunch":
        target, name = sup, "launch"
    elif step == "publish":
        target, name = sup, "_publish"
    else:
        raise AssertionError(step)
    fake = _raiser(getattr(target, name), times)
    monkeypatch.setattr(target, name, fake)
    return fake


SETUP = {"store_check": _running, "commands": _running, "standby": _running, "telemetry": _running,
         "engine": _running, "termination": _stopping, "exit_check": _running, "rank_watch": _running,
         "relaunch": _in_backoff, "publish": _running}


def _tick(sup, fos, n, dt=0.5):
    for _ in range(n):
        fos.advance(dt)
        if sup.job is not None and sup.state in (S.RUNNING, S.STARTING):
            _emit(sup, kind="step", step=(sup.last_step or 0) + 1, loss=2.9, step_time_s=dt)
        sup.tick()  # never raises
        assert sup.handle_command({"cmd": "status"})["ok"]  # the daemon answers throughout


def _internal(sup, step):
    return [i for i in sup.store.list_incidents(sup.run_id) if i.summary.startswith(f"internal error in {step}:")]


@pytest.mark.parametrize("step", sorted(SETUP))
def test_a_step_that_raises_once_is_one_incident_and_the_run_goes_on(tmp_path, monkeypatch, step):
    fos, sup = SETUP[step](tmp_path)
    state_before = sup.state
    fake = _inject(step, sup, fos, monkeypatch, times=1)
    with capture_logs() as logs:
        _tick(sup, fos, 8)
    assert fake.calls["n"] >= 2, "the step ran again after its error"
    incs = _internal(sup, step)
    assert len(incs) == 1, [i.summary for i in sup.store.list_incidents(sup.run_id)]
    inc = sup.store.get_incident(incs[0].id)
    assert inc.symptom.value == "internal_error" and "Injected: injected fault" in inc.summary
    assert "Traceback" in inc.evidence["internal_error"] and inc.evidence["step"] == step
    assert inc.status.value == "resolved"  # the step ran cleanly again
    failed = [e for e in logs if e["event"] == "tick step failed"]
    assert len(failed) == 1 and failed[0]["step"] == step and failed[0].get("exc_info")
    assert sup.state not in (S.FAILED, S.STOPPED)
    if state_before == S.RUNNING:
        assert sup.state == S.RUNNING and sup.attempt == 1 and fos.jobs[sup.job.pid]["alive"]
    elif state_before == S.BACKOFF:
        assert sup.state in (S.STARTING, S.RUNNING) and sup.attempt == 2  # relaunched on the next tick
    assert sup.status_dict()["tick_step_errors"] == {step: 1}


@pytest.mark.parametrize("step", sorted(SETUP))
def test_a_step_that_keeps_raising_ends_the_run_failed_with_its_reason(tmp_path, monkeypatch, step):
    fos, sup = SETUP[step](tmp_path)
    first_pid = sup.job.pid if sup.job is not None else None
    _inject(step, sup, fos, monkeypatch, times=None)
    ticks = 0
    with capture_logs() as logs:
        while sup.state != S.FAILED and ticks < 60:
            _tick(sup, fos, 1)
            ticks += 1
    assert sup.state == S.FAILED, (sup.state, [i.summary for i in sup.store.list_incidents(sup.run_id)])
    reason = sup.store.get_run(sup.run_id).state_reason
    assert reason.startswith(f"internal error in {step}: Injected: injected fault"), reason
    assert "None" not in reason and reason.count("internal error") == 1
    assert len(_internal(sup, step)) == 1  # one incident per distinct error, not one per tick
    lines = [e for e in logs if e.get("step") == step and e["event"].startswith("tick step")]
    # The traceback once, then at 2, 4, 8, ... and the line that ends the run: not a line every tick.
    assert 1 <= len(lines) <= 2 + ticks.bit_length() and (ticks <= LIMIT + 1 or len(lines) < ticks), (ticks, lines)
    if first_pid is not None:  # the job was stopped, not left running under a daemon that let go of it
        assert not fos.jobs[first_pid]["alive"]
    assert sup.job is None or not fos.jobs[sup.job.pid]["alive"]
    assert len(fos.spawns) == 1  # nothing relaunched after the internal error
    assert sup.handle_command({"cmd": "status"})["status"]["state"] == "FAILED"


def test_an_orderly_end_saves_first_when_the_stop_can_work(tmp_path, monkeypatch):
    # The engine keeps raising: the job gets SIGTERM (it saves and exits 0), not an immediate SIGKILL.
    fos, sup = _running(tmp_path)
    _inject("engine", sup, fos, monkeypatch, times=None)
    _tick(sup, fos, LIMIT + 3)
    assert sup.state == S.FAILED
    sigs = [sig for _, _, sig in fos.signals]
    assert 15 in sigs and 9 not in sigs
    assert sup.store.list_attempts(sup.run_id)[0].returncode == 0


def test_a_healthy_run_records_no_internal_error(tmp_path):
    # The negative control: ticks, an operator pause, a resume and a stop record nothing and count nothing.
    fos, sup = _running(tmp_path)
    _tick(sup, fos, 5)
    assert sup.handle_command({"cmd": "pause", "peer": {"uid": 0}})["ok"]
    _tick(sup, fos, 3)
    assert sup.state == S.PAUSED
    assert sup.handle_command({"cmd": "resume"})["ok"]
    _tick(sup, fos, 3)
    assert sup.handle_command({"cmd": "stop"})["ok"]
    _tick(sup, fos, 3)
    assert sup.state == S.STOPPED
    assert sup.store.list_incidents(sup.run_id) == []
    assert sup.status_dict()["tick_step_errors"] == {}


def test_a_paused_run_is_already_safe_and_stays_paused(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    assert sup.handle_command({"cmd": "pause"})["ok"]
    _tick(sup, fos, 3)
    assert sup.state == S.PAUSED
    _inject("publish", sup, fos, monkeypatch, times=None)
    _tick(sup, fos, LIMIT * 3)
    assert sup.state == S.PAUSED and len(_internal(sup, "publish")) == 1
    assert sup.handle_command({"cmd": "resume"})["ok"]  # the operator can still act


@pytest.mark.slow
def test_a_real_daemon_with_a_persistent_bug_answers_status_and_ends_the_run_failed(tmp_path):
    # A real `ulyssesd` process (the fake job, the control socket, `ulyssesctl` as a process) whose engine
    # step raises on every tick once the flag file exists: it keeps answering status, records one incident,
    # stops the job with SIGTERM (it saves), keeps every checkpoint and ends the run FAILED with the reason.
    import json
    import subprocess
    import sys
    from pathlib import Path

    from uls_daemon_helpers import fake_spec, wait_for

    from ulyssesd.daemon.control.client import send_request
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store

    ctl = Path(sys.executable).parent / "ulyssesctl"
    spec = fake_spec(tmp_path, steps=3000, interval=10, step_s=0.05, daemon={"step_error_limit": 100})  # 10 s of failing ticks to watch
    sock = load_run_spec(spec).daemon.resolved_socket_path()
    state, flag = tmp_path / "state", tmp_path / "bug.flag"

    def status() -> dict:
        res = subprocess.run([str(ctl), "--state-dir", str(state), "status", "--json"], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res
        return json.loads(res.stdout)

    env = {**__import__("os").environ, "ULS_BUG_TARGET": "ulyssesd.daemon.core.decisions:handle_outputs",
           "ULS_BUG_FLAG": str(flag)}
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, str(Path(__file__).parent / "ulyssesd_with_a_bug.py"), "run",
                               "--spec", str(spec)], stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    try:
        st = wait_for(lambda: (s := status())["daemon"] == "running" and s["latest_checkpoint"] and s, 90,
                      "a checkpoint")
        ckpt_dir = Path(st["run_dir"]) / "checkpoints"
        before = {p.name for p in ckpt_dir.iterdir() if p.is_dir()}
        job_pid = send_request(sock, {"cmd": "status"})["status"]["pid"]
        flag.touch()
        live = wait_for(lambda: (a := send_request(sock, {"cmd": "status"})["status"])["tick_step_errors"]
                        .get("engine", 0) >= 3 and a, 30, "the engine step failing")
        assert live["state"] == "RUNNING"  # failing, not yet at the limit: the daemon answers meanwhile
        st = status()
        assert st["daemon"] == "running"
        assert [i["summary"] for i in st["open_incident_list"]] == ["internal error in engine: RuntimeError: planted bug"]
        assert daemon.wait(90) == 10  # the run ended FAILED (ulyssesd's exit code for it)
    finally:
        if daemon.poll() is None:
            daemon.kill()
        log.close()
    store = open_store(state / "ulyssesd.db")
    run = store.get_run(st["run_id"])
    assert run.state.value == "FAILED" and run.state_reason.startswith("internal error in engine: RuntimeError: planted bug")
    internal = [i for i in store.list_incidents(run.id) if i.summary.startswith("internal error")]
    assert len(internal) == 1 and "Traceback" in store.get_incident(internal[0].id).evidence["internal_error"]
    attempt = store.list_attempts(run.id)[-1]
    assert attempt.ended_at is not None and attempt.returncode == 0  # SIGTERM: it saved and exited
    assert not Path(f"/proc/{job_pid}").exists()
    def step_of(tag: str) -> int:
        return int("".join(c for c in tag if c.isdigit()) or -1)

    after = {p.name for p in ckpt_dir.iterdir() if p.is_dir()}
    newest = max(before, key=step_of)
    # Nothing lost: the job went on saving while the engine failed, and keep_last retention (on every
    # checkpoint_saved since the checkpoint budget) removed older tags; the newest valid one is always newer.
    assert after and max(map(step_of, after)) >= step_of(newest), (before, after)
    text = (tmp_path / "daemon.log").read_text()
    assert text.count('"tick step failed"') == 1 and text.count("tick step still failing") <= 7  # not per tick


def test_a_control_request_that_keeps_raising_is_one_incident_and_never_ends_the_run(tmp_path, monkeypatch):
    # The operator's call, not the loop spinning: answered `internal` each time, logged and recorded once.
    fos, sup = _running(tmp_path)
    monkeypatch.setattr(sup.store, "ack_incident", _raiser(sup.store.ack_incident, None))
    with capture_logs() as logs:
        for _ in range(LIMIT * 3):
            resp = sup.handle_command({"cmd": "ack", "args": {"id": 1}})
            assert resp["code"] == "internal" and "Injected" in resp["error"]
            _tick(sup, fos, 1)
    assert sup.state == S.RUNNING
    assert len(_internal(sup, "control_request")) == 1
    assert len([e for e in logs if e["event"] == "tick step failed"]) == 1
    assert sup.status_dict()["tick_step_errors"] == {"control_request:ack": LIMIT * 3}


def test_a_control_socket_poll_that_raises_still_sleeps_and_the_run_goes_on(tmp_path):
    fos, sup = _running(tmp_path)
    calls = {"n": 0}

    def poll(timeout):
        calls["n"] += 1
        if calls["n"] > LIMIT * 2:
            sup.detach = True  # enough: leave the loop as on SIGTERM
            return 0
        raise OSError(9, "Bad file descriptor")

    t0 = fos.time()
    assert sup.run_forever(poll=poll) == S.RUNNING
    assert fos.time() - t0 >= LIMIT * 2 * sup.dcfg.tick_s - 1e-6  # it slept instead of spinning
    assert len(_internal(sup, "control_socket")) == 1 and fos.jobs[sup.job.pid]["alive"]


def test_the_guard_survives_its_own_console_callback_failing(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    _inject("engine", sup, fos, monkeypatch, times=None)

    def say(msg):
        if msg.startswith("INTERNAL ERROR"):
            raise BrokenPipeError(32, "Broken pipe")

    sup.say = say
    _tick(sup, fos, LIMIT + 4)
    assert sup.state == S.FAILED and sup.store.get_run(sup.run_id).state_reason.startswith("internal error in engine")


def test_an_internal_error_never_swallows_the_jobs_crash_at_the_same_step(tmp_path, monkeypatch):
    # Incidents are unique on (run, attempt, symptom, step): the daemon's bug has its own symptom, so the job's
    # crash right after it (no step in between) is still its own incident with its own diagnosis.
    fos, sup = _running(tmp_path)
    _inject("publish", sup, fos, monkeypatch, times=1)
    sup.tick()
    with open(fos.jobs[sup.job.pid]["log"], "a") as fh:
        fh.write("Traceback (most recent call last):\nRuntimeError: boom\n")
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    incs = [i for i in sup.store.list_incidents(sup.run_id) if i.attempt == 1]
    assert sorted(i.symptom.value for i in incs) == ["crash", "internal_error"], [i.summary for i in incs]
    assert len({i.step for i in incs}) == 1  # the same step: only the symptom keeps them apart
    assert sup.attempt == 2
