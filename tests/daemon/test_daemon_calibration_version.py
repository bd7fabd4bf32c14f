"""The calibration is a config version with its evidence (issue 39 item 2), on the fake OS and a real store:
the fit adds a version whose stored config holds the fitted thresholds (`detectors`) and their evidence
(`calibration`: sample size, fitted value, target rate) while configs/vN.json stays the pure job config; a
later action's version keeps them; a re-adopting daemon holds a pure job config and records no duplicate;
`ulyssesctl status` and `incident` say which thresholds are fitted and from what. And the healthy case it must
not touch: a run that never reaches a fit stays at v1."""

from __future__ import annotations

import json

from test_daemon_unit_fakeos import FakeOS, _emit, _sup

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.remediation.playbook import K_CLIP


def _steps(sup, a, b, dt=0.5):
    for s in range(a, b + 1):
        sup.os.advance(dt)
        _emit(sup, kind="step", step=s, loss=3.0 - 0.001 * s, step_time_s=dt * (1.0 + 0.02 * (s % 5)),
              samples=[s - 1, s])
        sup.tick()


def _calibrated(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=1000, interval=1000)
    sup.start()
    _emit(sup, kind="event", event="started", step=0, config_version=1)
    _steps(sup, 1, 110)
    return fos, sup


def test_a_run_that_never_fits_stays_at_v1(tmp_path):
    fos = FakeOS()
    sup = _sup(tmp_path, fos, steps=1000, interval=1000)
    sup.start()
    _emit(sup, kind="event", event="started", step=0, config_version=1)
    _steps(sup, 1, 90)
    assert sup.engine.calibration is None
    assert [v.version for v in sup.store.list_config_versions(sup.run_id)] == [1] and sup.config_version == 1


def _ctl(tmp_path, capsys, *args):
    capsys.readouterr()
    assert main(["--state-dir", str(tmp_path / "state"), *args]) in (0, None)
    return capsys.readouterr().out


def test_the_fit_is_a_config_version_with_its_evidence(tmp_path, capsys):
    fos, sup = _calibrated(tmp_path)
    assert sup.engine.calibration is not None
    versions = sup.store.list_config_versions(sup.run_id)
    assert [v.version for v in versions] == [1, 2] and sup.config_version == 2
    v1, v2 = versions
    fitted = v2.config["detectors"]
    assert fitted and fitted == {k: b for k, (_, b) in sup.engine.calibration["changed"].items()}
    assert fitted["hang_startup_timeout_s"] < 1800   # the run's own start-up, not the configured 30 minutes
    ev = v2.config["calibration"]
    assert ev["healthy_steps"] >= 100 and ev["false_alarm_rate_per_step"] == 1e-5
    assert ev["fitted"]["hang_startup_timeout_s"]["value"] == fitted["hang_startup_timeout_s"]
    assert "calibration at step" in v2.reason and "healthy steps" in v2.reason and "1e-05" in v2.reason
    # The job's part is unchanged and its file is a pure job config (the next launch reads it).
    assert {k: v for k, v in v2.config.items() if k not in ("detectors", "calibration")} == v1.config
    on_disk = json.loads((sup.run_dir / "configs" / "v2.json").read_text())
    assert "detectors" not in on_disk and "calibration" not in on_disk and on_disk == sup.config
    # The fitted values are the engine's thresholds now.
    assert sup.engine.config.hang_startup_timeout_s == fitted["hang_startup_timeout_s"]
    # status: the thresholds row names the version, what changed and from how many steps; the config diff
    # shows the fitted values (not the evidence).
    d = json.loads(_ctl(tmp_path, capsys, "status", "--json"))
    assert d["config_version"] == 2 and "detectors.hang_startup_timeout_s" in d["config_diff_from_v1"]
    assert not any(k.startswith("calibration.") for k in d["config_diff_from_v1"])
    text = " ".join(_ctl(tmp_path, capsys, "status").split())
    assert "config v2: fitted at step" in text and "hang_startup_timeout_s 1800.0 ->" in text
    assert "from 100 healthy steps (target 1e-05 false alarms/step)" in text
    # A refit over the same history moves nothing: no new version.
    sup.engine.calibrate(fos.time())
    sup.tick()
    _steps(sup, 111, 112)
    assert [v.version for v in sup.store.list_config_versions(sup.run_id)] == [1, 2]


def test_a_later_action_keeps_the_fitted_thresholds_and_readoption_is_clean(tmp_path):
    fos, sup = _calibrated(tmp_path)
    fitted = sup.store.get_config_version(sup.run_id, 2).config["detectors"]
    assert sup.new_config_version({K_CLIP: 0.5}, "loss_spike: clip (hot)")[0] == 3
    v3 = sup.store.get_config_version(sup.run_id, 3).config
    assert v3["detectors"] == fitted and v3["calibration"]["healthy_steps"] >= 100
    assert "detectors" not in json.loads((sup.run_dir / "configs" / "v3.json").read_text())

    sup2 = _sup(tmp_path, fos, steps=1000, interval=1000)
    sup2.start()   # the first daemon "died"; a new one adopts the live attempt
    assert sup2.config_version == 3 and "detectors" not in sup2.config and "calibration" not in sup2.config
    assert sup2.engine.config.hang_startup_timeout_s == fitted["hang_startup_timeout_s"]
    _steps(sup2, 111, 120)
    assert [v.version for v in sup2.store.list_config_versions(sup2.run_id)] == [1, 2, 3]


def test_a_finding_names_its_thresholds_fitted_and_from_what(tmp_path, capsys):
    fos, sup = _calibrated(tmp_path)
    # A 6x slowdown for 10 steps after the fit: slow_step, judged by the fitted ratio.
    for s in range(111, 122):
        fos.advance(3.0)
        _emit(sup, kind="step", step=s, loss=3.0, step_time_s=3.0, samples=[s - 1, s])
        sup.tick()
    inc = next(i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "slow_step")
    th = sup.store.get_incident(inc.id).evidence["thresholds"]
    assert th["fit"]["config_version"] == 2 and th["fit"]["healthy_steps"] >= 100
    text = " ".join(_ctl(tmp_path, capsys, "incident", str(inc.id)).split())
    assert "thresholds: slow_step_ratio" in text and "config v2" in text and "from 100 healthy steps" in text
