"""One diagnosis per attempt: the daemon asks the host about a bare SIGKILL (cgroup memory.events, kernel log),
records what it decided, and `ulyssesctl diagnose` of that attempt's log gives the same label and reason.

Real parts: a real Supervisor and SQLite store over the fake OS of the daemon unit tests, real files for the
cgroup counter, Typer's CliRunner for the CLI.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from typer.testing import CliRunner

from ulyssesd.daemon.core.attempt_diagnosis import (
    diagnose_attempt,
    read_record,
    record_for_log,
    record_path,
    write_record,
)
from ulyssesd.daemon.host.host_oom import HostOomProbe, read_kernel_oom_lines, read_oom_kill
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.operator.ctl_diagnose import register_diagnose

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup  # noqa: E402


def _events(d: Path, kills: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills}\noom_group_kill 0\n")
    return d


def test_cgroup_counter_delta_is_per_attempt_and_unreadable_files_say_none(tmp_path):
    cg = _events(tmp_path / "cg", 0)
    probe = HostOomProbe(tmp_path / "host_oom.json", cgroup_dir=cg, kmsg=tmp_path / "no-kmsg")
    first = probe.evidence(0.0)
    assert first.oom_kills == 0 and first.kernel_lines is None and "kernel log unreadable" in first.detail
    _events(cg, 2)
    assert probe.evidence(0.0).oom_kills == 2  # two new kills since the last attempt's end
    assert probe.evidence(0.0).oom_kills == 0  # none since
    fresh = HostOomProbe(tmp_path / "other.json", cgroup_dir=cg, kmsg=tmp_path / "no-kmsg")
    assert fresh.evidence(0.0).oom_kills is None  # 2 kills but no earlier count: maybe before the attempt
    assert read_oom_kill(tmp_path / "missing" / "memory.events") is None
    assert read_kernel_oom_lines(0.0, tmp_path / "no-kmsg") is None


def test_kernel_log_read_is_bounded_and_finds_nothing_stamped_in_the_future():
    t0 = time.monotonic()
    lines = read_kernel_oom_lines(time.monotonic() + 1e6)  # /dev/kmsg when readable here, else None
    assert lines in (None, []) and time.monotonic() - t0 < 2.0


class _Probe:
    def __init__(self, kills, lines):
        self.kills, self.lines, self.calls = kills, lines, 0

    def evidence(self, since):
        from ulyssesd.daemon.host.host_oom import HostOomEvidence

        self.calls += 1
        return HostOomEvidence(self.kills, self.lines, "test probe")


def _sigkilled_attempt(tmp_path, probe):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.host_oom_probe = probe
    sup.start()
    job = sup.job
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 6)
    fos.advance(1.0)
    fos.die(job.pid, ExitStatus(None, 9, "wait"))  # SIGKILL, nothing in the log about it
    sup.tick()
    return sup, sup.store.list_attempts(sup.run_id)[0]


def test_daemon_calls_a_bare_sigkill_killed_when_the_host_counted_no_oom_kill(tmp_path):
    probe = _Probe(0, [])
    sup, att = _sigkilled_attempt(tmp_path, probe)
    assert probe.calls == 1 and att.diagnosis == "killed"
    rec = read_record(record_path(sup.run_dir, 1))
    assert rec["decided_by"] == "log" and rec["host"]["oom_kills"] == 0 and rec["diagnosis"]["label"] == "killed"


def test_daemon_keeps_host_oom_killed_high_when_the_cgroup_counted_a_kill(tmp_path):
    sup, att = _sigkilled_attempt(tmp_path, _Probe(1, ["Out of memory: Killed process 4242 (python)"]))
    assert att.diagnosis == "host_oom_killed"
    rec = read_record(record_path(sup.run_dir, 1))
    assert rec["diagnosis"]["confidence"] == "high" and "oom_kill" in rec["diagnosis"]["reason"]


def _cli(*args):
    app = typer.Typer()
    register_diagnose(app)

    @app.command("version")
    def version() -> None:
        pass

    return CliRunner().invoke(app, list(args))


def test_ctl_diagnose_of_an_attempt_log_gives_the_daemons_label_and_reason(tmp_path):
    sup, att = _sigkilled_attempt(tmp_path, _Probe(0, []))
    log = sup.run_dir / "logs" / "attempt-1.log"
    assert record_for_log(log) == record_path(sup.run_dir, 1)
    r = _cli("diagnose", str(log), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    rec = read_record(record_path(sup.run_dir, 1))
    assert out["label"] == att.diagnosis == "killed" and out["reason"] == rec["diagnosis"]["reason"]
    assert out["decided_by"] == "log" and out["signal"] == 9
    plain = _cli("diagnose", str(log), "--signal", "9", "--json")  # an explicit status: the log alone decides
    assert json.loads(plain.output)["label"] == "host_oom_killed"


def test_ctl_diagnose_of_a_hang_killed_attempt_reports_the_stack_diagnosis_not_healthy(tmp_path):
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "attempt-3.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"step={s}, skipped=0, lr=[0.001]\n" for s in range(1, 50)))  # progress, then silence
    assert _cli("diagnose", str(log), "--json").exit_code == 0
    assert json.loads(_cli("diagnose", str(log), "--json").output)["label"] == "healthy"  # no record yet
    from ulyssesd.remediation.diagnosis import Diagnosis

    write_record(record_path(run_dir, 3), Diagnosis("nccl_timeout", ["rank 1 waits in all_reduce"], "high",
                                                    "nccl_timeout: the daemon's hang path ended this attempt."),
                 None, 15, None, "hang stacks")
    out = json.loads(_cli("diagnose", str(log), "--json").output)
    assert out["label"] == "nccl_timeout" and out["decided_by"] == "hang stacks"


def test_a_broken_record_is_an_error_naming_the_file(tmp_path):
    log = tmp_path / "run" / "logs" / "attempt-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("step=1\n")
    rp = record_path(tmp_path / "run", 1)
    rp.parent.mkdir(parents=True)
    rp.write_text("{not json")
    r = _cli("diagnose", str(log))
    assert r.exit_code == 2 and "diagnosis record" in r.output and str(rp) in r.output


def test_diagnose_attempt_is_the_log_diagnosis_plus_the_host_evidence():
    assert diagnose_attempt("step=1\n", None, 9, None).label == "host_oom_killed"
    assert diagnose_attempt("step=1\n", None, 9, {"oom_kills": 0, "kernel_lines": []}).label == "killed"


def _attempt_ending_with(tmp_path, lines: str, status: ExitStatus):
    fos = FakeOS()
    sup = _sup(tmp_path, fos)
    sup.host_oom_probe = _Probe(None, None)
    sup.start()
    job = sup.job
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 4)
    with open(fos.jobs[job.pid]["log"], "a") as fh:
        fh.write(lines)
    fos.advance(1.0)
    fos.die(job.pid, status)
    sup.tick()
    return sup


def test_a_scheduler_time_limit_stops_the_run_instead_of_restarting(tmp_path):
    from ulyssesd.daemon.store.enums import RunState

    sup = _attempt_ending_with(tmp_path, "slurmstepd: error: *** STEP 494583.0 ON n1 CANCELLED AT "
                               "2024-04-20T09:09:37 DUE TO TIME LIMIT ***\n", ExitStatus(None, 15, "wait"))
    assert sup.state == RunState.FAILED and sup.attempt == 1
    att = sup.store.list_attempts(sup.run_id)[0]
    assert att.diagnosis == "killed"
    assert any("scheduler ended attempt 1" in (i.summary or "") for i in sup.store.list_incidents(sup.run_id))


def test_an_operator_kill_restarts_within_the_budget(tmp_path):
    sup = _attempt_ending_with(tmp_path, "W0409 07:28:49.530000 1359 torch/distributed/elastic/agent/server/api.py:719]"
                               " Received 15 death signal, shutting down workers\n", ExitStatus(1, None, "wait"))
    assert sup.store.list_attempts(sup.run_id)[0].diagnosis == "killed"
    assert sup.attempt == 2 or sup.state.value == "BACKOFF"


def test_a_refused_deepspeed_config_fails_the_run_at_once_with_the_problem(tmp_path):
    from ulyssesd.daemon.store.enums import RunState

    sup = _attempt_ending_with(tmp_path, "[rank0]: AssertionError: Check batch related parameters. train_batch_size "
                               "is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 != 2 * 1 * 1\n",
                               ExitStatus(1, None, "wait"))
    assert sup.state == RunState.FAILED and sup.attempt == 1
    assert sup.store.list_attempts(sup.run_id)[0].diagnosis == "config_rejected"
