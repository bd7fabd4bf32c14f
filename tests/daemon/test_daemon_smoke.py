from __future__ import annotations

from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.store.enums import RunState


def test_fake_run_completes(tmp_path, make_sup):
    events: list[str] = []
    sup = make_sup(fake_spec(tmp_path, steps=20, interval=5), events)
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=30)
    assert sup.state == RunState.COMPLETED, events
    assert sup.last_step == 20
    atts = sup.store.list_attempts(sup.run_id)
    assert len(atts) == 1 and atts[0].returncode == 0
