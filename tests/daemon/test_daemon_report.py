"""`ulyssesctl report`: the postmortem of a real supervised (fake-job) run with a crash and a rollback,
rendered by a real headless browser (Debian's chromium) when it is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.operator.report import analyse_telemetry, render_report, telemetry_path_of
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def crashed_and_rolled_back_run(tmp_path_factory):
    """SIGKILL at step 12 (restart from step 10), NaN at step 20 of attempt 2 (rollback), then completes.
    One real supervised run shared by the tests of this module (they only read it)."""
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.supervisor import Supervisor

    tmp = tmp_path_factory.mktemp("report-run")
    spec = load_run_spec(fake_spec(tmp, steps=30, interval=5, faults=[
        {"kind": "sigkill", "at_step": 12}, {"kind": "nan_loss", "at_step": 20, "attempts": [2]}],
        remediation={"known_good_steps": 2, "rollback_steps_back": 1, "skip_min_batches": 2, "skip_max_batches": 4}))
    store = open_store(spec.daemon.resolved_db_path())
    sup = Supervisor(spec, store, RealOS())
    sup.start()
    try:
        run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=90)
    finally:
        if sup.job is not None:  # no test may leave a job behind
            import signal

            sup.os.signal_pids(sup.os.job_pids(sup.job, sup.marker()), signal.SIGKILL)
        store.close()
    assert sup.state == RunState.COMPLETED
    return tmp / "state", sup.run_id


def test_report_of_a_real_run_and_its_goodput(crashed_and_rolled_back_run, tmp_path):
    state, run_id = crashed_and_rolled_back_run
    out = tmp_path / "report.html"
    assert main(["--state-dir", str(state), "report", run_id, "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for plot in ("plot-timeline", "plot-loss", "plot-throughput", "plot-memory", "plot-goodput"):
        assert f'id="{plot}"' in page
    assert page.count('class="series"') >= 3 * 3  # three curves, one path per attempt (3 attempts)
    store = open_store(state / "ulyssesd.db", readonly=True)
    try:
        incidents, actions = store.list_incidents(run_id=run_id), store.list_actions(run_id)
        assert {i.symptom.value for i in incidents} >= {"crash", "nan_loss"}
        for i in incidents:  # every incident and action is marked on each curve, and listed
            assert page.count(f"incident #{i.id} ") >= 3
        for a in actions:
            assert page.count(f"action #{a.id} ") >= 3
        assert "rollback_skip" in page and "data.skip_ranges" in page  # the action and its config diff
        assert "COMPLETED" in page and "RESTARTING" in page  # the state timeline
        run = store.get_run(run_id)
        _, good = analyse_telemetry(telemetry_path_of(run), store.list_attempts(run_id), actions)
    finally:
        store.close()
    # the crash at 12 redid steps 10-11 (restart); the NaN at 20 of attempt 2 rolled back over several steps
    assert good.productive_s > 0 and good.redone_restart_s > 0 and good.redone_rollback_s > 0
    assert good.restart_downtime_s > 0
    parts = good.productive_s + good.redone_restart_s + good.redone_rollback_s + good.restart_downtime_s
    assert parts <= good.wall_s + 1e-6 and good.other_s >= 0
    assert main(["--state-dir", str(state), "report", "no-such-run", "--out", str(out)]) == 4


def test_report_without_telemetry_says_so(crashed_and_rolled_back_run, tmp_path):
    state, run_id = crashed_and_rolled_back_run
    store = open_store(state / "ulyssesd.db", readonly=True)
    try:
        page = render_report(store, run_id, telemetry=tmp_path / "absent.jsonl")
    finally:
        store.close()
    assert "No step telemetry found" in page and 'class="series"' not in page


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(crashed_and_rolled_back_run, tmp_path):
    state, run_id = crashed_and_rolled_back_run
    out = tmp_path / "report.html"
    assert main(["--state-dir", str(state), "report", run_id, "--out", str(out)]) == 0
    # A page with a console error must be caught by the same check: prove the check can fail.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('boom'); undefinedFn();</script></body></html>")
    assert _console_errors(_chromium(bad, "--dump-dom")[1]), "the console check must see a broken page"
    dom, log = _chromium(out, "--dump-dom")
    assert not _console_errors(log), _console_errors(log)
    assert re.search(r'<body[^>]*data-plots="5"', dom), "the inline script ran and found 5 plots with curves"
    shot = Path(os.environ.get("ULYSSESD_REPORT_SCREENSHOT", tmp_path / "report.png"))
    _chromium(out, f"--screenshot={shot}", "--window-size=1100,2200")
    assert shot.is_file() and shot.stat().st_size > 20_000  # a real picture, not a blank page


def _chromium(page: Path, *args: str) -> tuple[str, str]:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--user-data-dir=" + str(page.parent / "chromium-profile"), "--enable-logging=stderr", "--v=0",
           *args, page.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=page.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def _console_errors(log: str) -> list[str]:
    """Console messages and uncaught exceptions chromium logs (its CONSOLE lines) for the page."""
    return [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def test_report_of_a_run_whose_last_losses_are_not_finite(crashed_and_rolled_back_run, tmp_path):
    """o28: `report --out` crashed on every NaN run (TypeError comparing a None loss with a float): records
    read from a job's log share a time, and the newest ones carry NaN/Inf losses. The page renders."""
    import json

    state, run_id = crashed_and_rolled_back_run
    store = open_store(state / "ulyssesd.db", readonly=True)
    try:
        assert any(i.symptom.value == "nan_loss" for i in store.list_incidents(run_id=run_id))
        real = telemetry_path_of(store.get_run(run_id))
        lines = [json.loads(x) for x in real.read_text().splitlines() if x.strip()]
        steps = [r for r in lines if r.get("type", "step") == "step" and r.get("loss") is not None]
        last = steps[-1]
        tail = [dict(last, step=last["step"] + k, loss=loss) for k, loss in
                enumerate([float("nan"), 0.5, float("inf"), float("nan")], start=1)]   # all at last's time
        path = tmp_path / "telemetry.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines + tail))
        page = render_report(store, run_id, telemetry=path)
    finally:
        store.close()
    assert page.startswith("<!DOCTYPE html>") and 'id="plot-loss"' in page
    assert "last loss not finite or not reported" in page
