"""The supervisor loop against the contract-faithful fake job: real processes, signals, files, SQLite."""

from __future__ import annotations

import json
import math
import signal

import psutil
from fakejob_ulysses import loss_at
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState

DONE = (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


def _final_loss(sup):
    return sup.last_step_record.loss


def test_sigkill_rank_restarts_from_latest_and_completes(tmp_path, make_sup):
    ev: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=30, interval=5,
                             faults=[{"kind": "sigkill", "at_step": 12}]), ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=60)
    assert sup.state == RunState.COMPLETED, ev
    atts = sup.store.list_attempts(sup.run_id)
    assert [a.number for a in atts] == [1, 2]
    assert atts[0].signal == signal.SIGKILL or atts[0].returncode not in (0, None)
    assert atts[1].resumed_from == "step-00000010"
    incs = sup.store.list_incidents(sup.run_id)
    crash = [i for i in incs if i.symptom.value == "crash"]
    assert len(crash) == 1 and crash[0].step == 11
    assert crash[0].status.value == "resolved"
    assert math.isclose(_final_loss(sup), loss_at(30))


def test_hang_dumps_stacks_kills_group_and_resumes(tmp_path, make_sup):
    ev: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=25, interval=5, faults=[{"kind": "hang", "at_step": 8}]), ev)
    sup.start()
    run_until(sup, lambda s: s.attempt >= 2 or s.state in DONE, timeout=60)
    first_pid = sup.store.list_attempts(sup.run_id)[0].pid
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
    # No process of attempt 1 survives (environment marker scan, not just the group).
    from ulyssesd.daemon.host.process import JobHandle
    from ulyssesd.daemon.job.launcher import job_marker
    assert sup.os.job_pids(JobHandle(first_pid, 0.0), job_marker(sup.run_id, sup.run_dir, 1)) == []
    run_until(sup, lambda s: s.state in DONE, timeout=60)
    assert sup.state == RunState.COMPLETED, ev
    hang = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    assert len(hang) == 1, ev
    inc = sup.store.get_incident(hang[0].id)
    assert "Current thread" in inc.evidence["stacks"] and "fakejob_ulysses" in inc.evidence["stacks"], inc.evidence
    assert any(a.kind.value == "restart" for a in inc.actions)
    assert sup.store.list_attempts(sup.run_id)[1].resumed_from == "step-00000005"
    assert math.isclose(_final_loss(sup), loss_at(25))


def test_crash_at_start_every_time_fails_after_budget_with_backoff(tmp_path, make_sup):
    ev: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=10, faults=[{"kind": "exit_at_start", "attempts": list(range(1, 50))}],
                             remediation={"max_restarts_per_hour": 4, "no_progress_restarts": 10}), ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=60)
    assert sup.state == RunState.FAILED, ev
    atts = sup.store.list_attempts(sup.run_id)
    assert 3 <= len(atts) <= 6, [a.number for a in atts]
    gaps = [(b.started_at - a.ended_at).total_seconds() for a, b in zip(atts, atts[1:], strict=False)]
    assert gaps[-1] > gaps[0], gaps  # exponential backoff between early deaths
    states = [t.to_state.value for t in sup.store.list_transitions(sup.run_id)]
    assert "BACKOFF" in states
    incs = sup.store.list_incidents(sup.run_id)
    # Every early death is on record, and the last one says why the run was given up.
    assert len(incs) == len(atts) and incs[-1].status.value == "failed", [(i.symptom.value, i.status.value) for i in incs]
    # everything kept: logs of every attempt
    assert all((sup.run_dir / "logs" / f"attempt-{a.number}.log").exists() for a in atts)


def test_corrupt_newest_checkpoint_falls_back_and_incident_says_so(tmp_path, make_sup):
    ev: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=30, interval=5, faults=[{"kind": "hang", "at_step": 13}],
                             daemon={"hang_grace_s": 1.0}), ev)
    sup.start()
    run_until(sup, lambda s: s.latest_ckpt is not None and s.latest_ckpt[1] == 10, timeout=60)
    shard = sup.ckpt_dir / "step-00000010" / "state.json"
    shard.write_text(shard.read_text().replace("10", "99"))  # same size, different bytes
    run_until(sup, lambda s: s.state in DONE, timeout=60)
    assert sup.state == RunState.COMPLETED, ev
    atts = sup.store.list_attempts(sup.run_id)
    assert atts[1].resumed_from == "step-00000005"
    corrupt = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "checkpoint_corrupt"]
    assert len(corrupt) == 1
    ev_text = json.dumps(corrupt[0].evidence)
    assert "step-00000010" in ev_text and "sha256" in ev_text and corrupt[0].evidence["resumed_from"] == "step-00000005"
    assert any(p.name.startswith("step-00000010.corrupt-") for p in sup.ckpt_dir.iterdir())


def test_garbage_telemetry_line_is_counted_not_fatal(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=30, interval=10))
    sup.start()
    run_until(sup, lambda s: (s.last_step or 0) >= 5, timeout=30)
    with open(sup.telemetry_path, "a") as fh:
        fh.write("this is not json {\n")
    run_until(sup, lambda s: s.state in DONE, timeout=60)
    assert sup.state == RunState.COMPLETED
    assert sup.reader.garbage_lines >= 1
    assert sup.store.list_incidents(sup.run_id) == []


def test_operator_pause_resume_stop(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=400, interval=50))
    sup.start()
    run_until(sup, lambda s: (s.last_step or 0) >= 5, timeout=30)
    assert sup.handle_command({"cmd": "pause"})["ok"]
    run_until(sup, lambda s: s.state == RunState.PAUSED, timeout=30)
    step_at_pause = sup.last_step
    assert sup.latest_ckpt[1] == step_at_pause  # SIGTERM = finish the step, save, exit 0
    assert sup.handle_command({"cmd": "pause"})["ok"] is False
    assert sup.handle_command({"cmd": "resume"})["ok"]
    run_until(sup, lambda s: (s.last_step or 0) > step_at_pause + 2, timeout=30)
    assert sup.store.list_attempts(sup.run_id)[-1].resumed_from == f"step-{step_at_pause:08d}"
    assert sup.handle_command({"cmd": "stop"})["ok"]
    run_until(sup, lambda s: s.state in DONE, timeout=30)
    assert sup.state == RunState.STOPPED


def test_single_spike_that_recovers_costs_nothing_and_is_closed(tmp_path, make_sup):
    ev: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=40, interval=5,
                             faults=[{"kind": "loss_spike", "at_step": 15, "steps": 1, "magnitude": 30.0}],
                             remediation={"grace_steps": 5}), ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=60)
    assert sup.state == RunState.COMPLETED, ev
    incs = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id)]
    assert [i.symptom.value for i in incs] == ["loss_spike"]
    assert incs[0].status.value == "resolved" and "recovered by itself" in incs[0].status_reason
    assert incs[0].actions == () and len(sup.store.list_attempts(sup.run_id)) == 1
    assert sup.config_version == 1
