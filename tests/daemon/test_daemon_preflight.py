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
