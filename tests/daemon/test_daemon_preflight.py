"""The launch preflight fails closed: a planner that raises refuses the run (nothing launched); a planner that
says the run fits lets it run to the end."""

from __future__ import annotations

from uls_daemon_helpers import fake_spec

from ulyssesd.daemon import cli
from ulyssesd.daemon.operator import ctl_plan


def _planner_bug(run_spec, cluster=None):
    raise RuntimeError("cost model exploded")


def test_planner_error_refuses_the_run_and_launches_nothing(tmp_path, monkeypatch, capsys):
    spec = fake_spec(tmp_path, steps=5, interval=5, daemon={"preflight": True})
    monkeypatch.setattr(ctl_plan, "preflight", _planner_bug)
    assert cli.run_daemon(str(spec)) == cli.EXIT_PREFLIGHT
    err = capsys.readouterr().err
    assert "preflight refused the run" in err and "cost model exploded" in err
    runs = tmp_path / "state" / "runs"
    assert not runs.exists() or not any(runs.iterdir())  # no run directory: nothing was launched


def test_planner_that_fits_lets_the_run_complete(tmp_path, monkeypatch):
    spec = fake_spec(tmp_path, steps=5, interval=5, daemon={"preflight": True})
    calls = []

    def fits(run_spec, cluster=None):
        calls.append(run_spec.run.name)
        return True, ctl_plan.SkippedPlan(["test: fits"])

    monkeypatch.setattr(ctl_plan, "preflight", fits)
    assert cli.run_daemon(str(spec)) == cli.EXIT_OK
    assert calls == ["fake"]


def _oom_once_spec(tmp_path):
    """A CUDA OOM at step 3: the memory ladder patches the config (v2) and relaunches."""
    return fake_spec(tmp_path, steps=8, interval=2, daemon={"preflight": True},
                     faults=[{"kind": "cuda_oom", "at_step": 3}])


def test_every_relaunch_is_preflighted_with_the_patched_config(tmp_path, monkeypatch):
    seen = []

    def fits(run_spec, cluster=None):
        seen.append(run_spec.job.model_dump(mode="json"))
        return True, ctl_plan.SkippedPlan(["test: fits"])

    monkeypatch.setattr(ctl_plan, "preflight", fits)
    spec = _oom_once_spec(tmp_path)
    assert cli.run_daemon(str(spec)) == cli.EXIT_OK
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store

    store = open_store(load_run_spec(spec).daemon.resolved_db_path())
    (run,) = store.list_runs()
    (v2,) = [a.config_version for a in store.list_attempts(run.id)][1:]
    # the first launch with the spec's config, the relaunch with the memory ladder's patched config
    assert len(seen) == 2 and seen[0] != seen[1] and v2 == 2
    assert seen[1] == {k: v for k, v in store.get_config_version(run.id, 2).config.items() if k != "launcher"}


def test_a_relaunch_the_planner_refuses_fails_the_run_with_its_reason(tmp_path, monkeypatch):
    calls = []

    def fits_once(run_spec, cluster=None):
        calls.append(run_spec.job.model_dump(mode="json"))
        if len(calls) == 1:
            return True, ctl_plan.SkippedPlan(["test: fits"])
        raise RuntimeError("planner broke on the patched config")

    monkeypatch.setattr(ctl_plan, "preflight", fits_once)
    spec = _oom_once_spec(tmp_path)
    assert cli.run_daemon(str(spec)) == cli.EXIT_FAILED
    assert len(calls) == 2
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store

    store = open_store(load_run_spec(spec).daemon.resolved_db_path())
    (run,) = store.list_runs()
    refused = [i for i in store.list_incidents(run.id) if i.symptom.value == "launch_failure"]
    assert refused and "preflight refused config v" in refused[-1].summary, refused
    assert "planner broke on the patched config" in refused[-1].summary
    assert len(store.list_attempts(run.id)) == 1  # the refused relaunch was never started
