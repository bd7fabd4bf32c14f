"""Coexistence with an inner launcher (daemon/coexist/): the modes a spec resolves to, the launch command they
give, the evidence of an in-job restart (real torchrun and ft_launcher lines), each restart counted once
across sources and across a daemon restart (a real SQLite store), and the hang clock it restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ulyssesd.daemon.coexist.evidence import RestartLedger, parse_restart_line
from ulyssesd.daemon.coexist.modes import coexist_problems, launcher_argv, resolve
from ulyssesd.daemon.coexist.watch import InnerRestartWatch
from ulyssesd.daemon.job.launcher import build_launch
from ulyssesd.daemon.spec import LauncherSection
from ulyssesd.daemon.store import open_store
from ulyssesd.remediation.config import DetectorsConfig
from ulyssesd.remediation.detectors.hang import HangDetector
from ulyssesd.remediation.records import EventRecord, StepRecord

# Lines as torch 2.13's torchrun (LOGLEVEL=INFO) and nvidia-resiliency-ext 0.4.1's ft_launcher printed them.
TORCHRUN_LINE = ("I1207 15:12:25.213000 31850 torch/distributed/elastic/agent/server/api.py:942] [default] Worker "
                 "group FAILED. 2/2 attempts left; will restart worker group")
NVRX_LINE = ("[2026-12-07 15:13:44,853] [INFO] [ft_launcher998@vm] [default] Worker group FAILED. 1/2 attempts "
             "left; will restart worker group")
NVRX_MIN_HEALTHY = "[2026-12-07 15:13:44,853] [INFO] [ft_launcher998@vm] 2/3 restart attempts left; restarting worker group..."
HEALTHY_LINES = [
    "I1207 15:12:25.838000 31850 torch/distributed/elastic/agent/server/api.py:553]   restart_count=1",
    "[2026-12-07 15:14:00,429] [INFO] [ft_launcher998@vm] [default] worker group successfully finished.",
    "[INFO] [ft_launcher998@vm] 0/2 restart attempts left. Exiting...",
    "E1207 15:12:25.213000 31850 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3)",
]


def launcher(**kw) -> LauncherSection:
    return LauncherSection.model_validate({"kind": "torchrun", "nproc_per_node": 2, **kw})


def test_restart_lines_of_both_launchers_give_the_ordinal():
    assert parse_restart_line(TORCHRUN_LINE) == (1, 2, 2)
    assert parse_restart_line(NVRX_LINE) == (2, 1, 2)
    assert parse_restart_line(NVRX_MIN_HEALTHY) == (2, 2, 3)
    for line in HEALTHY_LINES:
        assert parse_restart_line(line) is None, line


def test_one_restart_seen_by_every_source_is_counted_once_in_any_order():
    step = lambda s: StepRecord(step=s, loss=1.0, attempt=1)  # noqa: E731
    started = EventRecord("started", attempt=1, fields={"restart_count": 1})
    # The old group's last step is always read before the new group's records (it was written first).
    orders = [[step(5), TORCHRUN_LINE, started, step(3)], [step(5), started, step(3), TORCHRUN_LINE],
              [step(5), started, TORCHRUN_LINE, step(4)], [step(5), step(2), TORCHRUN_LINE, started]]
    for order in orders:
        led = RestartLedger(attempt=1, max_restarts=2)
        found = []
        for item in order:
            found += led.line(item) if isinstance(item, str) else led.record(item)
        assert [r.ordinal for r in found] == [1], order
        assert led.left == 1


def test_step_going_back_is_a_restart_and_a_gap_is_filled():
    led = RestartLedger(attempt=1, max_restarts=3)
    assert led.record(StepRecord(step=7, loss=1.0)) == []
    assert led.record(StepRecord(step=8, loss=1.0)) == []  # healthy: forward
    back = led.record(StepRecord(step=5, loss=1.0))
    assert [(r.ordinal, r.source) for r in back] == [(1, "step went back")]
    later = led.line("[default] Worker group FAILED. 1/3 attempts left; will restart worker group")
    assert [(r.ordinal, r.source) for r in later] == [(2, "implied by a later restart"), (3, "launcher log")]
    assert led.left == 0


def test_modes_resolve_from_settings_and_command():
    assert resolve(launcher()).tool == "off"
    m = resolve(launcher(extra_args=["--max-restarts", "3"]))
    assert (m.tool, m.max_restarts) == ("torchrun", 3)
    assert resolve(launcher(extra_args=["--ft-rank-heartbeat-timeout=30"])).tool == "nvrx"
    assert resolve(launcher(inner_restarts="nvrx", inner_hang="nvrx", inner_hang_timeout_s=30)).hang_timeout_s == 30
    with pytest.raises(ValueError, match="inner_restarts='torchrun' or drop the flag"):
        resolve(launcher(inner_restarts="off", extra_args=["--max_restarts=2"]))
    with pytest.raises(ValueError, match="needs launcher.inner_hang_timeout_s"):
        resolve(launcher(inner_restarts="nvrx", inner_hang="nvrx"))
    with pytest.raises(ValueError, match="needs launcher.kind='torchrun'"):
        resolve(LauncherSection.model_validate({"kind": "local", "inner_restarts": "torchrun"}))


def test_the_daemon_hang_floor_must_wait_past_nvrx():
    lau = launcher(inner_restarts="nvrx", inner_hang="nvrx", inner_hang_timeout_s=60)
    bad = coexist_problems(lau, DetectorsConfig(hang_timeout_floor_s=60), standby=False)
    assert len(bad) == 1 and "at least 90" in bad[0] and "hang_timeout_floor_s" in bad[0]
    assert coexist_problems(lau, DetectorsConfig(hang_timeout_floor_s=90), standby=False) == []
    assert coexist_problems(launcher(), DetectorsConfig(hang_timeout_floor_s=10), standby=False) == []


def test_launch_command_per_mode(tmp_path):
    def plan(lau):
        return build_launch(lau, run_id="r", run_dir=tmp_path, attempt=1, config_version=1, base_env={})
    off = plan(launcher())
    assert "--max-restarts=0" in off.argv and "LOGLEVEL" not in off.env
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in off.env
    tr = plan(launcher(inner_restarts="torchrun", inner_max_restarts=2))
    assert "torch.distributed.run" in tr.argv and "--max-restarts=2" in tr.argv and tr.env["LOGLEVEL"] == "INFO"
    assert tr.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    nv = plan(launcher(inner_restarts="nvrx", inner_hang="nvrx", inner_hang_timeout_s=45))
    assert "nvidia_resiliency_ext.fault_tolerance.launcher" in nv.argv and "--ft-rank-heartbeat-timeout=45" in nv.argv
    assert launcher_argv(resolve(launcher(inner_restarts="torchrun")), "py")[:3] == ["py", "-m", "torch.distributed.run"]


def _watch(store, run_id="run-1"):
    return InnerRestartWatch(resolve(launcher(inner_restarts="torchrun", inner_max_restarts=2)), store, lambda: run_id)


def _record_into(store, watch, found, attempt=1):
    fed = []

    def incident(symptom, step, severity, summary, evidence, attempt=None):
        return store.record_incident("run-1", attempt=attempt, symptom=symptom, step=step, severity=severity,
                                     summary=summary, evidence=evidence)
    watch.record(found, step=5, incident=incident, feed_engine=fed.append, say=lambda s: None)
    return fed


def test_log_restarts_recorded_once_even_after_a_daemon_restart(tmp_path: Path):
    store = open_store(tmp_path / "state" / "ulyssesd.db")
    store.create_run("run-1", spec={}, run_dir=str(tmp_path))
    log = tmp_path / "attempt-1.log"
    half = TORCHRUN_LINE[:40]
    log.write_text("rank 0 step 4\n" + half)  # the launcher's line arrives in two writes
    w = _watch(store)
    assert w.defers_rank_watch(1)
    assert w.poll_log(1, log) == []
    log.write_text("rank 0 step 4\n" + TORCHRUN_LINE + "\nrank 0 step 5\n")
    found = w.poll_log(1, log)
    assert [r.ordinal for r in found] == [1]
    fed = _record_into(store, w, found)
    assert [r.event for r in fed] == ["inner_restart"]
    assert w.poll_log(1, log) == [], "a line is read once"
    assert w.defers_rank_watch(1), "one restart left"
    # A new daemon (re-adoption) reads the whole log again: the store says restart 1 is recorded.
    w2 = _watch(store)
    assert w2.poll_log(1, log) == []
    with log.open("a") as f:
        f.write(TORCHRUN_LINE.replace("2/2", "1/2") + "\n")
    found2 = w2.poll_log(1, log)
    assert [r.ordinal for r in found2] == [2]
    _record_into(store, w2, found2)
    assert not w2.defers_rank_watch(1), "torchrun has no restart left: the rank watch is the daemon's again"
    rows = store.list_incidents("run-1", symptom="inner_restart")
    assert sorted(r.evidence["ordinal"] for r in rows) == [1, 2]
    assert all("not a daemon restart" in r.summary for r in rows)
    assert w2.defers_rank_watch(2), "a new attempt starts with the launcher's full budget"
    store.close()


def test_an_off_mode_watch_does_nothing(tmp_path: Path):
    log = tmp_path / "a.log"
    log.write_text(TORCHRUN_LINE + "\n")
    w = InnerRestartWatch(resolve(launcher()), store=None, run_id=lambda: "r")
    assert w.poll_log(1, log) == [] and not w.defers_rank_watch(1)


def test_hang_clock_restarts_with_an_inner_restart():
    cfg = DetectorsConfig(hang_timeout_floor_s=12.0, hang_startup_timeout_s=600.0)
    for restarted in (False, True):
        h = HangDetector(cfg, start_time=0.0)
        for s in range(1, 6):
            h.observe(StepRecord(step=s, loss=1.0, step_time_s=0.5), float(s))
        if restarted:
            h.observe(EventRecord("inner_restart", attempt=1), 6.0)
        fired = h.check(40.0)  # 34 s of silence: over the training floor, inside the start-up allowance
        assert (fired is None) is restarted
