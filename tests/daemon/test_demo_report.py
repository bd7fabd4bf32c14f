"""The demo's closing postmortem report: written next to the state dir on success; a failure to write it is
a clear error and a distinct exit code, not a traceback (the run itself is a real fake-job supervised run)."""

from __future__ import annotations

from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.demo import write_demo_report
from ulyssesd.daemon.store.enums import RunState


def test_demo_report_written_next_to_state_dir_and_failure_named(tmp_path, make_sup):
    sup = make_sup(fake_spec(tmp_path, steps=12, interval=5))
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=60)
    assert sup.state == RunState.COMPLETED

    path, error = write_demo_report(sup.store, sup.run_id, tmp_path)
    assert error is None
    assert path == (tmp_path / f"report-{sup.run_id}.html").resolve() and path.parent == (tmp_path / "state").parent
    page = path.read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html") and sup.run_id in page

    # The target cannot be written (a directory stands in its place): the cause is named, nothing raised.
    blocked = tmp_path / "blocked"
    (blocked / f"report-{sup.run_id}.html").mkdir(parents=True)
    path, error = write_demo_report(sup.store, sup.run_id, blocked)
    assert error is not None and "IsADirectoryError" in error and path.name == f"report-{sup.run_id}.html"
