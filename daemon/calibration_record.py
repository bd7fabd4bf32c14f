"""The engine's fit of its detector thresholds to the run's healthy history, recorded: {run_dir}/calibration.json
(what `ulyssesctl status` shows, with its evidence) and a config version carrying the fitted thresholds
(remediation/learned/fit_version.py), so every later version an action makes keeps them."""

from __future__ import annotations

import json
from typing import Any, Protocol

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.ports import JobConfig, Records, RunFiles

log = get_logger("ulyssesd.supervisor")


class CalibrationRun(RunFiles, JobConfig, Records, Protocol):
    """What recording a fit uses of the run."""

    engine: Any  # the remediation engine (its `calibration` and `calibration_new`)


def save_calibration(sup: CalibrationRun) -> None:
    """The engine fitted its thresholds to the run's healthy history: kept in {run_dir}/calibration.json
    (what `ulyssesctl status` shows, with its evidence) and said in the daemon's log."""
    from ulyssesd.training.durable import atomic_write_text

    sup.engine.calibration_new = False
    fit = sup.engine.calibration
    record_fit_version(sup, fit)
    try:
        atomic_write_text(sup.run_dir / "calibration.json", json.dumps(fit, indent=1, default=str) + "\n")
    except OSError as exc:   # a full disk: the fit is in use all the same; only its record is missing
        log.warning("could not write calibration.json", run_id=sup.run_id, error=repr(exc))
    changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in (fit.get("changed") or {}).items())
    log.info("detector thresholds fitted to the run's healthy history", run_id=sup.run_id,
             steps=fit.get("steps"), changed=changed)
    sup.say(f"calibrated from {fit.get('steps')} healthy steps: {changed or 'no change'}")


def record_fit_version(sup: CalibrationRun, fit: dict[str, Any]) -> None:
    """The fit as a config version (remediation/learned/fit_version.py): the stored config gains the fitted
    thresholds and their evidence, configs/vN.json repeats the job config (the next launch reads it), and the
    version becomes current. None when the thresholds in force are already these (a re-adopting replay)."""
    from ulyssesd.remediation.learned.fit_version import fit_version

    try:
        built = fit_version(dict(sup.store.get_config_version(sup.run_id, sup.config_version).config), fit)
        if built is not None:
            stored, reason = built
            parent, version = sup.config_version, sup.config_version + 1
            jc.write_json_atomic(sup.run_dir / "configs" / f"v{version}.json", sup.config)
            sup.store.add_config_version(sup.run_id, stored, reason=reason, parent_version=parent, version=version)
            sup.config_version = version
            log.info("config version", run_id=sup.run_id, version=version, reason=reason)
            sup.say(f"config v{parent} -> v{version}: {reason}")
        fit["config_version"] = sup.config_version
    except Exception as exc:  # noqa: BLE001 - a full disk or a store error: the fit is in use all the same
        log.warning("could not record the calibration as a config version", run_id=sup.run_id, error=repr(exc))


def carried_fit(sup: CalibrationRun, parent: int) -> dict[str, Any]:
    """The calibration keys of config version `parent`, kept by the version an action makes from it."""
    from ulyssesd.remediation.learned.fit_version import carried

    try:
        return carried(sup.store.get_config_version(sup.run_id, parent).config)
    except Exception:  # noqa: BLE001 - a version the store lacks (a test's store): nothing to carry
        return {}
