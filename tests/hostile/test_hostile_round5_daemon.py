"""Hardening round 3's probes against the running supervisor, with a user's own stdlib training script
(tests/hostile/jobs/plain_job.py) as a `[job] kind = "command"` job read from its stdout: a hang that keeps
printing is restarted (the stack reader raised and the run ended FAILED), a script's own `exit 3` is a crash
that is retried unless the job declared ulyssesd's exit codes, and every number of a spec is bounded."""

from __future__ import annotations

import copy
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from uls_client_helpers import run_supervised  # noqa: E402

from ulyssesd.daemon.host.process import RealOS
from ulyssesd.daemon.spec import load_run_spec, run_spec_from_dict
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.supervisor import Supervisor
from ulyssesd.training.spec import SpecError, read_toml

JOB = Path(__file__).resolve().parent / "jobs" / "plain_job.py"
REPO = Path(__file__).resolve().parents[2]
DONE = (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


def _toml(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def command_spec(tmp: Path, args: list[str], job: dict | None = None, daemon: dict | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    sections = {
        "run": {"name": "plain"},
        "job": {"kind": "command", "command": [str(JOB), *args], **(job or {})},
        "telemetry": {"source": "stdout"},
        "launcher": {"kind": "local", "python": sys.executable},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.1, "stop_grace_s": 5.0,
                   "hang_grace_s": 2.0, "stack_dump_wait_s": 0.3, "backoff_base_s": 0.2, "backoff_max_s": 1.0,
                   "early_death_s": 0.5, "preflight": False, **(daemon or {})},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 3.0},
    }
    text = "\n".join(f"[{name}]\n" + "\n".join(f"{k} = {_toml(v)}" for k, v in body.items()) + "\n"
                     for name, body in sections.items())
    (tmp / "run.toml").write_text(text)
    return tmp / "run.toml"


def supervise(spec_path: Path, timeout: float = 120.0) -> tuple[Supervisor, list[str]]:
    return run_supervised(spec_path, timeout)   # the client tests' real-OS supervision loop


def test_a_hang_that_keeps_printing_is_restarted_and_the_run_completes(tmp_path):
    sup, say = supervise(command_spec(tmp_path, ["--steps", "25", "--sleep", "0.05", "--chatty-hang-at", "12"]))
    assert sup.state == RunState.COMPLETED, say
    hang = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(hang) == 1, say
    assert "could not be read" not in hang[0].summary and "cannot relaunch" not in " ".join(say)
    assert [a.number for a in sup.store.list_attempts(sup.run_id)] == [1, 2]


def test_a_scripts_own_exit_3_is_a_crash_retried_unless_the_job_declared_the_contract(tmp_path):
    args = ["--steps", "20", "--sleep", "0.05", "--exit3-at", "8"]
    sup, say = supervise(command_spec(tmp_path / "plain", args))
    assert sup.state == RunState.COMPLETED, say  # the probe: FAILED "no valid checkpoint left", no retry
    attempts = sup.store.list_attempts(sup.run_id)
    assert len(attempts) == 2 and attempts[0].returncode == 3
    crash = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "crash"]
    assert crash and "no valid checkpoint" not in crash[0].summary
    # A job that declares ulyssesd's exit codes still means "no valid checkpoint left" by 3.
    sup, say = supervise(command_spec(tmp_path / "declared", args, job={"exit_codes": "ulyssesd"}))
    assert sup.state == RunState.FAILED, say
    assert [i.symptom.value for i in sup.store.list_incidents(sup.run_id)] == ["checkpoint_corrupt"]
    assert len(sup.store.list_attempts(sup.run_id)) == 1


@pytest.mark.parametrize("section, key, value, says", [
    ("daemon", "backoff_base_s", float("inf"), "daemon.backoff_base_s = inf: not a finite number"),
    ("daemon", "stop_grace_s", 1e12, "daemon.stop_grace_s = 1e+12 is outside its physical range [0, 2.592e+06]"),
    ("train", "steps", 1e20, "train.steps = 1e+20 is outside its physical range [1, 1e+12]"),
    ("train", "steps", 10**30, "train.steps = a 31-digit integer is outside its physical range"),
    ("train", "lr", 1e300, "train.lr = 1e+300 is outside its physical range [0, 10]"),
    ("train", "gradient_clipping", float("inf"), "train.gradient_clipping = inf: not a finite number"),
    ("launcher", "nproc_per_node", 100000, "launcher.nproc_per_node = 100000 is outside its physical range [1, 1024]"),
    ("detectors", "hang_step_multiplier", float("inf"), "detectors.hang_step_multiplier = inf: not a finite"),
    ("remediation", "max_crash_restarts", 10**13, "remediation.max_crash_restarts = 1e+13 is outside"),
])
def test_every_number_of_a_spec_is_bounded_with_the_field_and_range_named(section, key, value, says):
    data = read_toml(REPO / "configs" / "tiny-cpu.toml")
    bad = copy.deepcopy(data)
    bad.setdefault(section, {})[key] = value
    with pytest.raises(SpecError) as err:
        run_spec_from_dict(bad, "probe.toml")
    assert any(says in p for p in err.value.problems), err.value.problems
    run_spec_from_dict(data, "probe.toml")  # the healthy spec loads


def test_every_numeric_field_has_a_finite_upper_bound():
    """The structure, not a list of probes: each numeric field of every section resolves to a finite range."""
    import math

    from ulyssesd.daemon import spec_bounds
    from ulyssesd.daemon.spec import _spec_sections

    seen = 0

    def walk(model, prefix):
        nonlocal seen
        for name, field in model.model_fields.items():
            subs = spec_bounds._models(field.annotation)
            if subs:
                walk(subs[0], f"{prefix}{name}.")
                continue
            import typing
            args = typing.get_args(field.annotation) or (field.annotation,)
            if int in args or float in args:
                _, hi = spec_bounds.bound_of(f"{prefix}{name}", field)
                assert hi is not None and math.isfinite(hi), f"{prefix}{name}"
                seen += 1

    for name, model in _spec_sections().items():
        walk(model, f"{name}.")
    assert seen > 100


def _stop_when(sup: Supervisor, step: int, timeout: float = 60.0) -> float:
    """Tick until the job reached `step`, then ask the run to stop (as a remediation or an operator does
    with the full stop grace); the monotonic time of the stop."""
    deadline = time.monotonic() + timeout
    while (sup.last_step or 0) < step:
        assert time.monotonic() < deadline, f"step {step} never reached: {sup.state}"
        sup.tick()
        time.sleep(0.05)
    sup.stop_run("operator stop")
    return time.monotonic()


def _until_done(sup: Supervisor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while sup.state not in DONE:
            assert time.monotonic() < deadline, f"state={sup.state}"
            sup.tick()
            time.sleep(0.05)
    finally:
        if sup.job is not None:
            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)


def test_a_hung_job_is_stopped_on_the_hang_timescale_not_after_the_full_stop_grace(tmp_path):
    # The job hangs at step 10 and ignores SIGTERM; the stop (not the hang detector's) has a 60 s grace.
    spec = command_spec(tmp_path / "hung", ["--steps", "400", "--sleep", "0.05", "--hang-at", "10", "--ignore-term"],
                        daemon={"stop_grace_s": 60.0, "hang_grace_s": 1.0})
    sup = Supervisor(load_run_spec(spec), open_store(tmp_path / "hung" / "state" / "ulyssesd.db"), RealOS())
    sup.start()
    t0 = _stop_when(sup, 9)
    _until_done(sup, 40)
    took = time.monotonic() - t0
    assert sup.state == RunState.STOPPED and took < 3.0 + 1.0 + 6.0, took  # hang timeout + hang grace + slack

    # The healthy case: a job that keeps making progress while it takes its time to exit gets its grace.
    spec = command_spec(tmp_path / "busy", ["--steps", "4000", "--sleep", "0.05", "--hang-at", "0",
                                            "--ignore-term"], daemon={"stop_grace_s": 6.0, "hang_grace_s": 1.0})
    sup = Supervisor(load_run_spec(spec), open_store(tmp_path / "busy" / "state" / "ulyssesd.db"), RealOS())
    sup.start()
    t0 = _stop_when(sup, 5)
    _until_done(sup, 40)
    took = time.monotonic() - t0
    assert sup.state == RunState.STOPPED and took >= 6.0, took


def test_a_running_jobs_log_is_rotated_past_its_cap_without_losing_a_step_line(tmp_path):
    # 12 MiB of noise, then steps slow enough that the per-tick rotation sees the log while the job runs.
    sup, say = supervise(command_spec(tmp_path, ["--steps", "60", "--sleep", "0.05", "--junk-mib", "12"],
                                      daemon={"attempt_log_max_mib": 4}), timeout=240)
    assert sup.state == RunState.COMPLETED and sup.last_step == 60, (sup.last_step, say[-5:])
    logs = sup.run_dir / "logs"
    # Rotated while it ran (attempt-1.log.1 holds the previous half), or, on a loaded box where the job ended
    # before a tick saw its log over the cap, trimmed at its end: bounded either way.
    rotated = logs / "attempt-1.log.1"
    assert (not rotated.exists() or rotated.stat().st_size <= 2 << 20) and (logs / "attempt-1.log").stat().st_size <= 4 << 20
    recs = [json.loads(x) for x in (sup.run_dir / "telemetry-stdout.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("kind") == "step"] == list(range(1, 61))


def test_much_output_before_the_step_lines_is_read_to_the_end_and_the_attempt_log_stays_bounded(tmp_path):
    """The probe: 100 MiB on stdout before the step lines; the pump read 4 MiB per tick and the run ended
    "COMPLETED at step None"; the attempt log had no cap. Here 40 MiB, a 8 MiB cap, then 20 steps and exit 0."""
    sup, say = supervise(command_spec(tmp_path, ["--steps", "20", "--sleep", "0.01", "--junk-mib", "40"],
                                      daemon={"attempt_log_max_mib": 8}), timeout=240)
    assert sup.state == RunState.COMPLETED and sup.last_step == 20, (sup.last_step, say[-5:])
    logs = sup.run_dir / "logs"
    live, rotated = logs / "attempt-1.log", logs / "attempt-1.log.1"
    assert live.stat().st_size <= 8 << 20 and (not rotated.exists() or rotated.stat().st_size <= 4 << 20)
    assert live.read_text().rstrip().endswith("done") and "step=20 loss=" in live.read_text()  # the tail kept
    recs = [json.loads(x) for x in (sup.run_dir / "telemetry-stdout.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("kind") == "step"] == list(range(1, 21))
