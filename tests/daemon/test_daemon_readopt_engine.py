"""A re-adopting daemon's remediation engine holds the configs the run really has (core/startup.py), on the
fake OS and a real store.

The telemetry replay walks a fresh engine through the findings and hot fixes again, but not through a
crash's fix (that comes from the exit handling, not from a record). After re-adoption the engine's `values`
are the newest config version and its `launched` values (lr_scale and reverts are relative to them) are the
version the live attempt runs, as its telemetry says; the memory re-planner is not run on replayed records.
"""

from __future__ import annotations

from test_daemon_unit_fakeos import FakeOS, _emit, _steps, _sup

from ulyssesd.daemon.core import startup
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.remediation.playbook import K_CLIP, ZERO

PERSIST = ZERO + "stage3_param_persistence_threshold"
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.96 GiB. GPU 0 has a total capacity "
       "of 79.1 GiB of which 1.2 GiB is free.\n")


def _second_attempt_after_an_oom(tmp_path):
    """Attempt 1 dies of a CUDA OOM; the memory ladder's fix is config v2; attempt 2 runs it."""
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=100, interval=10)
    sup.start()
    _emit(sup, kind="event", event="started", step=0, config_version=sup.config_version)
    _steps(sup, 1, 12)
    _emit(sup, kind="event", event="checkpoint_saved", step=10, tag="step-00000010")
    sup.tick()
    with open(sup.log_path, "a") as fh:
        fh.write(OOM)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(30):
        fos.advance(1.0)
        sup.tick()
        if sup.attempt == 2 and sup.job is not None:
            break
    assert sup.attempt == 2 and sup.config_version == 2
    _emit(sup, kind="event", event="started", step=10, config_version=2)
    _steps(sup, 11, 15)
    return fos, sup


def test_readopted_engine_holds_the_crash_fix_the_replay_cannot_walk_it_to(tmp_path):
    fos, sup = _second_attempt_after_an_oom(tmp_path)
    fixed = sup.engine.values[PERSIST]
    assert fixed != sup.engine.initial[PERSIST]  # the OOM's fix changed it (v1 -> v2)
    assert sup.engine.launched[PERSIST] == fixed  # attempt 2 was launched with it

    sup2 = _sup(tmp_path, fos, steps=100, interval=10)  # the first daemon "died"; a new one adopts
    sup2.start()
    assert sup2.attempt == 2 and sup2.job is not None and len(fos.spawns) == 2  # adopted, not relaunched
    eng = sup2.engine
    assert eng.values[PERSIST] == fixed and eng.launched[PERSIST] == fixed  # was v1's before the fix
    assert eng.initial[PERSIST] == sup.engine.initial[PERSIST]  # bounds stay relative to the run's start
    assert eng.replanner is not None


def test_readopted_engine_launched_is_the_version_the_attempt_runs_not_the_newest(tmp_path):
    # A hot fix made v3 while attempt 2 (launched with v2, its telemetry says so) trains on: the next attempt
    # launches v3, but what attempt 2 was launched with is v2 (lr_scale and a revert are relative to that).
    fos, sup = _second_attempt_after_an_oom(tmp_path)
    assert sup.new_config_version({K_CLIP: 0.5}, "loss_spike: clip (hot)")[0] == 3
    _steps(sup, 16, 17)  # the job still says config_version 2: hot changes do not relaunch it
    launched_clip = sup.engine.launched[K_CLIP]
    assert launched_clip != 0.5

    sup2 = _sup(tmp_path, fos, steps=100, interval=10)
    sup2.start()
    assert sup2.config_version == 3
    assert sup2.engine.values[K_CLIP] == 0.5
    assert sup2.engine.launched[K_CLIP] == launched_clip
    assert sup2.engine.launched[PERSIST] == sup.engine.values[PERSIST]  # v2's memory fix, still launched


def test_replayed_records_are_not_re_planned(tmp_path, monkeypatch):
    fos, sup = _second_attempt_after_an_oom(tmp_path)
    seen = {}
    real = startup.warm_engine

    def watched(s, attempt):
        seen["replanner during replay"] = s.engine.replanner
        return real(s, attempt)

    monkeypatch.setattr(startup, "warm_engine", watched)
    sup2 = _sup(tmp_path, fos, steps=100, interval=10)
    sup2.start()
    # Decisions of replayed records are dropped, and a planner may probe the GPUs: none during the replay.
    assert seen == {"replanner during replay": None}
    assert sup2.engine.replanner is not None  # live records are re-planned as before
