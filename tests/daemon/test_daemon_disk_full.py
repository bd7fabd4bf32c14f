"""Disk full, read-only file system and a job that rejects its config, with a fake OS and a fake clock
(real files, real checkpoint manifests, real SQLite). The real 2-rank job versions are at the end (slow)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _make_tag, _steps, _sup

from ulyssesd.daemon.core import relaunch
from ulyssesd.daemon.host import disk
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.training import checkpoint as ck

S = RunState

# torchrun's real failure report (torch 2.13) for two ranks that exited with `code`.
TORCHRUN_REPORT = """\
E1201 19:52:37.547000 7240 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {code}) local_rank: 0 (pid: 7245) of binary: /venv/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
ulyssesd.training FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_19:52:37
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 7246)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_19:52:37
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 7245)
  error_file: <N/A>
============================================================
"""


def _log(fos, sup, text: str) -> None:
    with open(fos.jobs[sup.job.pid]["log"], "a") as fh:
        fh.write(text)


def _running(tmp_path, steps=(1, 40), **kw):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, **kw)
    sup.start()
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, *steps)
    return fos, sup


def _save_fails(fos, sup, errno_name: str, tag: str = "step-00000040") -> None:
    """What the job does when a save fails: the event, the exiting event, exit 4 per rank (torchrun: 1)."""
    _emit(sup, kind="event", event="checkpoint_save_failed", step=40, errno=errno_name, tag=tag,
          path=str(sup.ckpt_dir / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"), bytes_free=0,
          error=f"OSError: [Errno 28] {os.strerror(28)}", rank=0, failed_ranks=[0, 1])
    _emit(sup, kind="event", event="exiting", step=40, reason="checkpoint_save_failed")
    _log(fos, sup, "basic_ios::clear: iostream error\n" + TORCHRUN_REPORT.format(code=4))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()


def _tags_with_a_partial_one(sup) -> dict[str, int]:
    for s in (10, 20, 30):
        _make_tag(sup.ckpt_dir, s)
    partial = sup.ckpt_dir / "step-00000040"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 4096)  # half a save, no manifest
    (sup.ckpt_dir / "step-00000005.corrupt-1").mkdir()  # quarantined evidence: kept within the set-aside cap
    return {t: ck.tag_bytes(sup.ckpt_dir / t) for t in ("step-00000020", "step-00000040")}


def test_rank_exit_codes_and_refusal_lines_from_real_launcher_text():
    assert disk.rank_exit_codes(TORCHRUN_REPORT.format(code=2)) == [2, 2]
    assert disk.rank_exit_codes("failed (exitcode: 3) local_rank: 0 (pid: 1) of binary: python") == [3]
    assert disk.rank_exit_codes("Traceback ...\nRuntimeError: boom\n") == []
    text = ("[rank0] noise\nulysses-train: invalid run spec launcher: 1 problem(s)\n"
            "  - parallel.world_size=4 but the launcher started 2 ranks\n"
            "ulysses-train: invalid run spec launcher: 1 problem(s)\n"
            "  - parallel.world_size=4 but the launcher started 2 ranks\nE1201 other\n  - not a problem line\n")
    assert disk.refusal_lines(text) == ["ulysses-train: invalid run spec launcher: 1 problem(s)",
                                        "- parallel.world_size=4 but the launcher started 2 ranks"]


def test_enospc_removes_the_failed_partial_and_resumes_from_newest_when_that_makes_room(tmp_path):
    # The filesystem has room again once the failed save's partial is gone: nothing else is removed (the
    # stated order beyond it, on a disk that stays short: tests/daemon/test_daemon_ckpt_disk.py).
    fos, sup = _running(tmp_path)
    sizes = _tags_with_a_partial_one(sup)
    doomed = {"step-00000040": sizes["step-00000040"]}
    sup.store.upsert_checkpoint(sup.run_id, "step-00000010", step=10, known_good=True)  # the rollback anchor
    _save_fails(fos, sup, "ENOSPC")
    left = sorted(p.name for p in sup.ckpt_dir.iterdir() if not p.name.startswith("latest"))
    assert left == ["step-00000005.corrupt-1", "step-00000010", "step-00000020", "step-00000030"]
    assert sup.attempt == 2 and sup.state == S.STARTING
    assert sup.store.list_attempts(sup.run_id)[1].resumed_from == "step-00000030"
    incs = sup.store.list_incidents(sup.run_id)
    assert [i.symptom.value for i in incs] == ["disk_full"]  # never checkpoint_corrupt
    assert incs[0].summary.startswith("checkpoint save of step-00000040 failed: ENOSPC (0 bytes free)")
    inc = sup.store.get_incident(incs[0].id)
    assert inc.evidence["checkpoint_save_failed"]["errno"] == "ENOSPC"
    assert inc.evidence["diagnosis"] == "disk_full" and inc.evidence["rank_exit_codes"] == [4, 4]
    prune = next(a for a in inc.actions if a.kind.value == "prune")
    assert sorted(prune.parameters["removed"]) == sorted(doomed)
    assert prune.parameters["bytes_freed"] == sum(doomed.values())
    assert prune.parameters["kept_newest_valid"] == "step-00000030"


def test_a_plain_crash_prunes_nothing(tmp_path):
    fos, sup = _running(tmp_path)
    _tags_with_a_partial_one(sup)
    _log(fos, sup, "Traceback (most recent call last):\nRuntimeError: boom\n" + TORCHRUN_REPORT.format(code=1))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.attempt == 2
    names = {p.name for p in sup.ckpt_dir.iterdir()}
    assert {"step-00000010", "step-00000020", "step-00000030"} <= names
    assert any(n.startswith("step-00000040.corrupt-") for n in names)  # quarantined as usual, not deleted
    assert "disk_full" not in [i.symptom.value for i in sup.store.list_incidents(sup.run_id)]


def test_disk_full_with_nothing_prunable_fails_once_with_a_clear_incident(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    _make_tag(sup.ckpt_dir, 30)  # the newest valid tag: never pruned
    monkeypatch.setattr(ck, "bytes_free", lambda path: 1024)  # the filesystem really is full
    _save_fails(fos, sup, "EDQUOT")
    assert sup.state == S.FAILED and sup.attempt == 1
    assert (sup.ckpt_dir / "step-00000030" / ck.MANIFEST_NAME).is_file()
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert inc.symptom.value == "disk_full" and inc.status.value == "failed"
    assert "cannot hold the newest valid tag plus one more" in sup.store.get_run(sup.run_id).state_reason


def test_read_only_stops_cleanly_and_deletes_nothing(tmp_path):
    fos, sup = _running(tmp_path)
    _tags_with_a_partial_one(sup)
    before = sorted(p.name for p in sup.ckpt_dir.iterdir())
    _save_fails(fos, sup, "EROFS")
    assert sup.state == S.FAILED and sup.attempt == 1
    assert sorted(p.name for p in sup.ckpt_dir.iterdir()) == before
    assert "run directory is read-only" in sup.store.get_run(sup.run_id).state_reason
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert "read-only" in inc.summary and inc.status.value == "failed"


def test_daemon_own_write_enospc_backs_off_prunes_and_launches_later_never_checkpoint_corrupt(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    _make_tag(sup.ckpt_dir, 30)
    real_probe = relaunch.probe_run_dir
    full = {"left": 2}

    def probe(run_dir: Path) -> None:
        if full["left"]:
            full["left"] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir / ".write-probe"))
        real_probe(run_dir)

    monkeypatch.setattr(relaunch, "probe_run_dir", probe)
    # `latest` cannot be rewritten either (its temp file): a warning, not a corrupt checkpoint.
    monkeypatch.setattr(ck, "point_latest_to", lambda *a: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "latest")))
    _log(fos, sup, "RuntimeError: boom\n")
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.state == S.BACKOFF and sup.attempt == 1
    for _ in range(40):
        fos.advance(1.0)
        sup.tick()
        if sup.attempt == 2:
            break
    assert sup.attempt == 2 and sup.state == S.STARTING
    symptoms = [i.symptom.value for i in sup.store.list_incidents(sup.run_id)]
    assert "checkpoint_corrupt" not in symptoms and symptoms.count("disk_full") == 1
    assert sup.store.list_attempts(sup.run_id)[1].resumed_from == "step-00000030"


def test_daemon_own_write_failures_are_bounded_then_fail(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    monkeypatch.setattr(relaunch, "probe_run_dir", lambda d: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(d))))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(400):
        fos.advance(1.0)
        sup.tick()
        if sup.state == S.FAILED:
            break
    assert sup.state == S.FAILED and sup.attempt == 1
    assert sup.counters.own_write_failures == relaunch.OWN_WRITE_RETRIES
    (inc,) = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "disk_full"]
    assert inc.status.value == "failed"


def test_daemon_write_on_a_read_only_run_dir_stops_cleanly(tmp_path, monkeypatch):
    fos, sup = _running(tmp_path)
    monkeypatch.setattr(relaunch, "probe_run_dir", lambda d: (_ for _ in ()).throw(
        OSError(errno.EROFS, os.strerror(errno.EROFS), str(d))))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.state == S.FAILED and sup.attempt == 1
    assert "run directory is read-only" in sup.store.get_run(sup.run_id).state_reason


def test_a_hot_fix_whose_control_write_fails_leaves_the_job_running(tmp_path, monkeypatch):
    from ulyssesd.daemon.core import decisions
    from ulyssesd.daemon.job import config as jc
    from ulyssesd.remediation.engine import Decision

    fos, sup = _running(tmp_path)
    dec = Decision(action_kind="lower_clip", symptom="loss_spike", apply="hot", reason="clip 1.0 -> 0.5",
                   ladder="loss", ladder_step=0, step=40, hot_control={"gradient_clipping": 0.5})
    monkeypatch.setattr(jc, "write_control", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "control.json")))
    decisions.handle_outputs(sup, [dec], 40)  # no exception out of the tick
    assert sup.state == S.RUNNING and fos.is_alive(sup.job) and not fos.signals
    monkeypatch.setattr(jc, "write_control", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    # Only storage errors degrade quietly; a bug still shows: recorded on an incident as the failed action
    # (escalated, alerted), never a skipped record (issue 39), and the job keeps running unchanged.
    decisions.handle_outputs(sup, [dec], 41)
    failed = [a for i in sup.store.list_incidents(sup.run_id, with_actions=True) for a in i.actions
              if a.parameters.get("not_applied")]
    assert failed and failed[-1].parameters["failed"] == "ValueError: a bug"
    assert sup.state == S.RUNNING and fos.is_alive(sup.job)


@pytest.mark.parametrize("code, fails", [(2, True), (3, True), (1, False)])
def test_a_rank_exit_2_or_3_behind_torchrun_1_fails_at_once_with_the_problem_lines(tmp_path, code, fails):
    fos, sup = _running(tmp_path, steps=(1, 2))
    _log(fos, sup, "ulysses-train: invalid run spec launcher: 1 problem(s)\n"
                   "  - parallel.world_size=4 but the launcher started 2 ranks\n" * 2
         + TORCHRUN_REPORT.format(code=code))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    if not fails:  # a plain crash (exit 1 everywhere): restarted
        assert sup.attempt == 2 and sup.state != S.FAILED
        return
    assert sup.state == S.FAILED and sup.attempt == 1
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert inc.status.value == "failed" and "launcher exited 1" in inc.summary
    ev = sup.store.get_incident(inc.id).evidence
    assert ev["problems"] == ["ulysses-train: invalid run spec launcher: 1 problem(s)",
                              "- parallel.world_size=4 but the launcher started 2 ranks"]
    if code == 2:
        assert "parallel.world_size=4 but the launcher started 2 ranks" in inc.summary


# ---------------------------------------------------------------------- the real 2-rank job (slow)
DONE = (S.COMPLETED, S.FAILED, S.STOPPED)


@pytest.mark.slow
def test_real_job_that_rejects_its_config_fails_after_exactly_one_attempt_with_its_message(tmp_path, make_sup):
    from test_daemon_e2e_real import real_spec
    from uls_daemon_helpers import run_until

    spec = real_spec(tmp_path, steps=4)
    # Valid for the spec loader, refused by the job on a CPU (it checks the device at start): exit 2 per rank.
    with open(spec, "a") as fh:
        fh.write('\n[attention]\nbackend = "cudnn"\n')
    ev: list[str] = []
    sup = make_sup(spec, ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=180, tick=0.2)
    assert sup.state == S.FAILED, ev
    assert len(sup.store.list_attempts(sup.run_id)) == 1
    (inc,) = sup.store.list_incidents(sup.run_id)
    evidence = sup.store.get_incident(inc.id).evidence
    assert evidence["returncode"] == 1 and 2 in evidence["rank_exit_codes"]
    assert any("attention.backend='cudnn' needs a CUDA device" in line for line in evidence["problems"]), evidence
    assert "needs a CUDA device" in inc.summary and inc.status.value == "failed"


@pytest.mark.slow
def test_real_job_disk_full_mid_save_is_pruned_and_the_run_completes(tmp_path, make_sup):
    from test_daemon_e2e_real import real_spec
    from uls_daemon_helpers import run_until

    ev: list[str] = []
    sup = make_sup(real_spec(tmp_path, steps=8, interval=2, faults=[{"kind": "disk_full", "at_step": 6}]), ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=300, tick=0.2)
    assert sup.state == S.COMPLETED, ev
    attempts = sup.store.list_attempts(sup.run_id)
    assert len(attempts) == 2 and attempts[1].resumed_from == "step-00000004"
    incs = sup.store.list_incidents(sup.run_id)
    assert [i.symptom.value for i in incs] == ["disk_full"], [(i.symptom.value, i.summary) for i in incs]
    inc = sup.store.get_incident(incs[0].id)
    assert inc.evidence["checkpoint_save_failed"]["errno"] == "ENOSPC"
    prune = next(a for a in inc.actions if a.kind.value == "prune")
    # The half-written step 6 went (the disk then had room: nothing else); step 4 was resumed from.
    assert prune.parameters["removed"] == ["step-00000006"]
    assert prune.parameters["bytes_freed"] > 0 and prune.parameters["kept_newest_valid"] == "step-00000004"
    for tag in ("step-00000004", "step-00000006", "step-00000008"):
        assert ck.validate_tag(sup.ckpt_dir / tag, verify_checksums=True) == (True, "ok"), tag


def test_a_failed_atomic_write_leaves_neither_a_temp_file_nor_a_changed_target(tmp_path):
    from ulyssesd.daemon.job import config as jc

    target = tmp_path / "control.json"
    jc.write_json_atomic(target, {"version": 1})
    with pytest.raises(TypeError):
        jc.write_json_atomic(target, {"version": 2, "z": object()})  # fails half-way through the dump
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control.json"]
    assert jc.read_control(tmp_path) == {"version": 1}


def test_a_pause_whose_final_save_failed_says_so_and_resume_uses_the_previous_tag(tmp_path):
    fos, sup = _running(tmp_path)
    _make_tag(sup.ckpt_dir, 30)
    sup.handle_command({"cmd": "pause", "peer": {"uid": 0}})
    assert sup.state == S.STOPPING
    _save_fails(fos, sup, "ENOSPC")  # the SIGTERM save ran out of room
    assert sup.state == S.PAUSED and "final save failed" in sup.store.get_run(sup.run_id).state_reason
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert inc.symptom.value == "disk_full" and "resumes from the previous valid tag" in inc.summary
    sup.handle_command({"cmd": "resume", "peer": {"uid": 0}})
    assert sup.attempt == 2 and sup.store.list_attempts(sup.run_id)[1].resumed_from == "step-00000030"


def test_a_launch_whose_log_file_cannot_be_created_is_retried_later_with_the_same_attempt_number(
        tmp_path, monkeypatch):
    import tenacity

    fos, sup = _running(tmp_path)
    real_spawn = fos.spawn
    full = {"left": sup.dcfg.launch_retries + 1}  # every spawn try of the first relaunch

    def spawn(argv, env, cwd, log_path):
        if full["left"]:
            full["left"] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(log_path))
        return real_spawn(argv, env, cwd, log_path)

    fos.spawn = spawn
    monkeypatch.setattr(tenacity.nap, "sleep", lambda s: None)  # the bounded spawn retries' own waits
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.state == S.BACKOFF and sup.attempt == 1 and len(sup.store.list_attempts(sup.run_id)) == 1
    for _ in range(40):
        fos.advance(1.0)
        sup.tick()
        if sup.state == S.STARTING:
            break
    assert sup.attempt == 2 and [a.number for a in sup.store.list_attempts(sup.run_id)] == [1, 2]
    assert "launch_failure" not in [i.symptom.value for i in sup.store.list_incidents(sup.run_id)]


def test_the_wrapper_survives_an_exit_file_it_cannot_write(tmp_path, capsys):
    from ulyssesd.daemon.job.wrapper import write_exit_file

    write_exit_file(str(tmp_path / "missing-dir" / "1.exit"), 0, None)  # ENOENT stands in for ENOSPC: no raise
    assert "cannot write the exit file" in capsys.readouterr().err
    assert not (tmp_path / "missing-dir").exists()


def test_a_refusal_whose_rank_then_aborted_still_fails_at_once_from_the_jobs_exiting_event(tmp_path):
    # Seen with the real job: rank 1 printed its refusal, then died by SIGABRT in the process group's teardown
    # ("terminate called without an active exception"); torchrun reported -6 and -15, not 2.
    fos, sup = _running(tmp_path, steps=(1, 2))
    _emit(sup, kind="event", event="exiting", step=2, reason="config_rejected",
          error="SpecError: invalid run spec attention.backend: 1 problem(s)",
          problems=["attention.backend='cudnn' needs a CUDA device; use 'auto' or 'math' on CPU"])
    _log(fos, sup, "ulysses-train: invalid run spec attention.backend: 1 problem(s)\n"
                   "  - attention.backend='cudnn' needs a CUDA device; use 'auto' or 'math' on CPU\n"
                   "terminate called without an active exception\n"
         + TORCHRUN_REPORT.format(code=-6).replace("exitcode  : -6 (pid: 7246)", "exitcode  : -15 (pid: 7246)"))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()
    assert sup.state == S.FAILED and sup.attempt == 1
    (inc,) = sup.store.list_incidents(sup.run_id)
    assert "needs a CUDA device" in inc.summary
    assert sup.store.get_incident(inc.id).evidence["rank_exit_codes"] == [-15, -6]
