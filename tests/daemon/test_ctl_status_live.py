"""`ulyssesctl status` on real fake-job supervised runs (the daemon loop in-process, ulyssesctl reading the
real SQLite store and run dir): throughput blanked while no job trains, restarts counted apart from operator
relaunches, open incidents listed, the last-step age flagged past the hang timeout of a really stalled job,
and `pause` saying where the run is going."""

from __future__ import annotations

import json
import signal

from uls_daemon_helpers import fake_spec, run_until, wait_for

from ulyssesd.daemon.operator.ctl import EMPTY, main
from ulyssesd.daemon.operator.ctl_control import outcome_line
from ulyssesd.daemon.operator.ctl_status import progress_bar
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState


def _status(capsys, sd) -> dict:
    capsys.readouterr()
    main([*sd, "status", "--json"])
    return json.loads(capsys.readouterr().out)


def _table(capsys, sd) -> str:
    capsys.readouterr()
    main([*sd, "status"])
    return capsys.readouterr().out


def _row(table: str, key: str) -> str:
    return next(line for line in table.splitlines() if f" {key} " in line)


def test_paused_run_shows_no_throughput_and_operator_relaunches_are_not_restarts(tmp_path, make_sup, capsys):
    sup = make_sup(fake_spec(tmp_path, steps=400, interval=4, faults=[{"kind": "sigkill", "at_step": 6}]))
    sup.start()
    run_until(sup, lambda s: s.attempt == 2 and (s.last_step or 0) >= 8, timeout=60)
    sd = ["--state-dir", str(tmp_path / "state")]
    st = _status(capsys, sd)
    assert st["state"] == "RUNNING" and st["tokens_per_s"] > 0  # a training job: its current throughput
    assert (st["restarts"], st["operator_relaunches"]) == (1, 0)  # the SIGKILL crash is a restart

    assert sup.handle_command({"cmd": "pause"})["ok"]
    run_until(sup, lambda s: s.state == RunState.PAUSED, timeout=30)
    st = _status(capsys, sd)
    assert st["state"] == "PAUSED" and st["tokens_per_s"] is None and st["mfu"] is None and st["loss"] is not None
    assert st["eta_s"] is None and st["step_rate_per_s"] > 0  # a paused run has no ETA, whatever its last rate
    assert EMPTY in _row(_table(capsys, sd), "tokens/s")  # not the last value the job printed before pausing

    assert sup.handle_command({"cmd": "resume"})["ok"]
    run_until(sup, lambda s: s.attempt == 3 and s.state == RunState.RUNNING, timeout=30)
    assert sup.handle_command({"cmd": "restart"})["ok"]
    # RUNNING comes with the job's first progress report; its throughput with its first step record (until
    # then the figure would be attempt 3's).
    run_until(sup, lambda s: s.attempt == 4 and s.state == RunState.RUNNING
              and _status(capsys, sd)["tokens_per_s"] is not None, timeout=30)
    st = _status(capsys, sd)
    assert st["tokens_per_s"] > 0 and (st["restarts"], st["operator_relaunches"]) == (1, 2)
    assert "1 / 2" in _row(_table(capsys, sd), "restarts / operator relaunches")
    assert sup.handle_command({"cmd": "stop"})["ok"]
    run_until(sup, lambda s: s.state == RunState.STOPPED, timeout=30)
    assert _status(capsys, sd)["tokens_per_s"] is None


def test_a_restarting_or_finished_run_shows_no_stale_throughput(tmp_path, make_sup, capsys):
    """Between a crash and the new attempt's first step (RESTARTING, BACKOFF, STARTING) and once the run is
    COMPLETED no job trains: the last attempt's tokens/s would read as a live figure (it did on make demo)."""
    sup = make_sup(fake_spec(tmp_path, steps=30, interval=5, faults=[{"kind": "sigkill", "at_step": 8}]))
    sup.start()
    sd = ["--state-dir", str(tmp_path / "state")]
    run_until(sup, lambda s: s.state == RunState.RUNNING and (s.last_step or 0) >= 4, timeout=60)
    assert _status(capsys, sd)["tokens_per_s"] > 0  # training: its current figure
    run_until(sup, lambda s: s.attempt == 2 and s.state == RunState.STARTING, timeout=60)  # ticks stop: frozen
    st = _status(capsys, sd)
    assert st["state"] == "STARTING" and st["tokens_per_s"] is None and st["mfu"] is None and st["loss"] is not None
    assert EMPTY in _row(_table(capsys, sd), "tokens/s")
    run_until(sup, lambda s: s.state == RunState.RUNNING and (s.last_step or 0) >= 12, timeout=60)
    assert _status(capsys, sd)["tokens_per_s"] > 0  # attempt 2 trains: a figure again
    run_until(sup, lambda s: s.state == RunState.COMPLETED, timeout=60)
    st = _status(capsys, sd)
    assert st["tokens_per_s"] is None and st["step"] == 30 and st["loss"] is not None


def test_open_incidents_are_listed_and_closed_ones_are_not(tmp_path, make_sup, capsys):
    sup = make_sup(fake_spec(tmp_path, steps=10, interval=5))
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=60)
    with open_store(tmp_path / "state" / "ulyssesd.db") as store:  # what a daemon records mid-remediation
        hang = store.record_incident(sup.run_id, attempt=1, symptom="hang", step=7, severity="critical",
                                     summary="no step for 93 s; rank 1 in allreduce")
        done = store.record_incident(sup.run_id, attempt=1, symptom="loss_spike", step=3,
                                     summary="loss 9.1 vs median 2.0")
        store.update_incident_status(done, "resolved", "loss back within 2 MAD")
    sd = ["--state-dir", str(tmp_path / "state")]
    st = _status(capsys, sd)
    assert st["open_incidents"] == 1 and [i["id"] for i in st["open_incident_list"]] == [hang]
    table = _table(capsys, sd)
    assert f"#{hang} hang" in table and "rank 1 in allreduce" in table
    assert "loss_spike" not in table


def test_last_step_age_is_flagged_once_a_stalled_job_passes_the_hang_timeout(tmp_path, make_sup, capsys):
    sup = make_sup(fake_spec(tmp_path, steps=4000, interval=1000))
    sup.start()
    run_until(sup, lambda s: (s.last_step or 0) >= 12, timeout=60)
    sd = ["--state-dir", str(tmp_path / "state")]
    healthy = _status(capsys, sd)
    assert healthy["state"] == "RUNNING" and healthy["hang_timeout_s"] >= 2.0  # the spec's floor
    assert healthy["last_step_overdue"] is False and "past the hang timeout" not in _table(capsys, sd)
    # The daemon stops ticking (as if it were down) and the job freezes: the store still says RUNNING.
    pids = sup.os.job_pids(sup.job, sup.marker())
    sup.os.signal_pids(pids, signal.SIGSTOP)
    try:
        st = wait_for(lambda: (d := _status(capsys, sd))["last_step_overdue"] and d, 30, "an overdue last step")
        assert st["last_step_age_s"] > st["hang_timeout_s"]
        row = _row(_table(capsys, sd), "last step")
        assert f"past the hang timeout {st['hang_timeout_s']:.0f}s" in row
        assert "OVERDUE" in _watch_line(capsys, sd)
    finally:
        sup.os.signal_pids(pids, signal.SIGCONT)


def _watch_line(capsys, sd) -> str:
    from ulyssesd.daemon.operator.ctl_status import status_line

    return status_line(_status(capsys, sd))


def test_pause_names_the_state_the_run_goes_to_never_stopping():
    assert outcome_line("pause", "STOPPING") == "pause: ok (pausing… the run will be PAUSED)"
    assert outcome_line("pause", "PAUSED") == "pause: ok (run is PAUSED)"
    assert "STOPPING" not in outcome_line("stop", "STOPPING")
    assert progress_bar(0.5, 10) == "█████░░░░░" and progress_bar(None) == "" and progress_bar(1.7, 4) == "████"
