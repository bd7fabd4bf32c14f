"""`ulyssesctl status` progress: step/total and %, elapsed, ETA from the recent step rate, last-step age, and
no literal None in the table (a real fake-job supervised run, read back with the daemon down)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.operator.ctl import EMPTY, main, progress_fields
from ulyssesd.daemon.store.enums import RunState

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _steps(attempt, first, n, t_start, dt):
    return [{"kind": "step", "attempt": attempt, "step": first + i, "time": t_start + i * dt} for i in range(n)]


def test_eta_uses_the_recent_rate_of_the_newest_attempt_only():
    start = T0.timestamp()
    # Attempt 1 ran 2 steps/s, then a 600 s restart gap; attempt 2 runs 1 step/s. The gap must not count.
    recent = _steps(1, 1, 5, start, 0.5) + _steps(2, 4, 10, start + 600, 1.0)
    now = datetime.fromtimestamp(recent[-1]["time"] + 3, timezone.utc)
    p = progress_fields(recent, 100, T0, None, now)
    assert p["step_rate_per_s"] == pytest.approx(1.0)
    assert p["eta_s"] == pytest.approx(100 - 13)  # step 13 of 100 at 1 step/s
    assert p["progress"] == pytest.approx(0.13) and p["last_step_age_s"] == pytest.approx(3.0)
    assert p["elapsed_s"] == pytest.approx((now - T0).total_seconds())


def test_no_eta_without_a_rate_or_after_the_end():
    one = _steps(1, 1, 1, T0.timestamp(), 1.0)
    p = progress_fields(one, 100, T0, None, T0 + timedelta(seconds=5))
    assert p["step_rate_per_s"] is None and p["eta_s"] is None and p["progress"] == pytest.approx(0.01)
    ended = progress_fields(_steps(1, 1, 5, T0.timestamp(), 1.0), 5, T0, T0 + timedelta(seconds=9),
                            T0 + timedelta(hours=1))
    assert ended["eta_s"] is None and ended["elapsed_s"] == pytest.approx(9.0)  # elapsed stops at the end
    empty = progress_fields([], None, T0, None, T0)
    assert empty["progress"] is None and empty["last_step_age_s"] is None and empty["total_steps"] is None


def test_status_shows_progress_and_never_prints_none(tmp_path, make_sup, capsys):
    sup = make_sup(fake_spec(tmp_path, steps=20, interval=5))
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=60)
    sd = ["--state-dir", str(tmp_path / "state")]
    capsys.readouterr()
    assert main([*sd, "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["step"] == 20 and st["total_steps"] == 20 and st["progress"] == pytest.approx(1.0)
    assert st["eta_s"] is None and st["elapsed_s"] > 0 and st["last_step_age_s"] >= 0
    assert st["step_rate_per_s"] and st["step_rate_per_s"] > 0
    assert main([*sd, "status"]) == 0
    table = capsys.readouterr().out
    assert "None" not in table
    assert "20 / 20 (100.0%)" in table and "ago" in table
    assert EMPTY in table  # the fake job reports no MFU: an em dash, not None
