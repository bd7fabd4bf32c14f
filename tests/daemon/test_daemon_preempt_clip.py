"""The pre-emptive clip under the daemon (issue 39 item 3), fake OS and a real store: with `[remediation]
early_warning_clip` on, a grad-norm early warning lowers the clip hot (control.json), recorded as an action with
the warning as its evidence and its own config version, then verified effective; off (the default), the same
run gets the warning and nothing else."""

from __future__ import annotations

import json
import math
import random

from test_daemon_unit_fakeos import FakeOS, _emit, _sup

from ulyssesd.remediation.playbook import K_CLIP


def _run(sup, a, b, blowup: int | None = None, seed: int = 0):
    rng = random.Random(seed + a)
    for s in range(a, b + 1):
        g = 0.3 * math.exp(rng.gauss(0, 0.1)) * (1.3 ** (s - blowup + 1) if blowup and s >= blowup else 1.0)
        sup.os.advance(0.5)
        _emit(sup, kind="step", step=s, loss=2.0 * math.exp(rng.gauss(0, 0.02)), grad_norm=g, step_time_s=0.5,
              samples=[s - 1, s])
        sup.tick()


def _start(tmp_path, **remediation):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=1000, interval=1000, remediation={"verify_steps": 30, **remediation})
    sup.start()
    _emit(sup, kind="event", event="started", step=0, config_version=1)
    return sup


def test_on_a_warning_lowers_the_clip_hot_records_the_action_and_verifies_it(tmp_path):
    sup = _start(tmp_path, early_warning_clip=True)
    _run(sup, 1, 60)
    _run(sup, 61, 65, blowup=61)
    acts = sup.store.list_actions(sup.run_id)
    assert len(acts) == 1, acts
    a = acts[0]
    assert a.kind.value == "hot_control" and a.incident_id is None and a.mode.value == "hot"
    assert a.parameters["rung"] == "preemptive_clip" and a.parameters["warning"]["signal"] == "grad_norm"
    new_clip = a.config_diff[K_CLIP][1]
    assert 0.1 <= new_clip < 1.0 and a.to_config_version == sup.config_version
    assert json.loads((sup.run_dir / "control.json").read_text())["gradient_clipping"] == new_clip
    assert sup.store.get_config_version(sup.run_id).config["train"]["gradient_clipping"] == new_clip
    _run(sup, 66, 100, seed=7)   # the grad norm back in its range: the window passes clean
    done = sup.store.list_actions(sup.run_id)[0]
    assert done.outcome.value == "effective" and "without a loss" in done.outcome_detail["why"]


def test_off_by_default_the_warning_alone(tmp_path):
    sup = _start(tmp_path)
    _run(sup, 1, 60)
    _run(sup, 61, 65, blowup=61)
    assert sup.engine.grad_watch.warnings and sup.store.list_actions(sup.run_id) == []
    assert sup.config_version == 1


def test_observe_mode_records_what_it_would_do_and_changes_nothing(tmp_path):
    sup = _start(tmp_path, early_warning_clip=True, mode="observe")
    _run(sup, 1, 60)
    _run(sup, 61, 65, blowup=61)
    (a,) = sup.store.list_actions(sup.run_id)
    assert a.observe_only and a.parameters["rung"] == "preemptive_clip" and a.config_diff == {}
    assert sup.config_version == 1
    ctl = sup.run_dir / "control.json"
    assert not ctl.exists() or "gradient_clipping" not in json.loads(ctl.read_text())
