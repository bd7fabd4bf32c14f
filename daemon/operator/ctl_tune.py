"""`ulyssesctl tune [RUN]`: fit the detector thresholds to a run's own healthy history, on demand.

Reads the run's telemetry (the daemon may be down), fits what remediation/learned/fit.py fits (step time,
hang, checkpoint and start-up timeouts; the per-source loss bands' residual scales), prints the fit with its
evidence and the `[detectors]` lines that set it, and with `--write` keeps it as {run_dir}/calibration.json
(what `ulyssesctl status` shows). The daemon fits the same way by itself after `calibrate_after_steps`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ulyssesd.daemon.operator.ctl_common import CTX, EXIT_NOT_FOUND, current_run, die, open_ro_store, out
from ulyssesd.daemon.safety.regular_file import open_regular
from ulyssesd.daemon.telemetry.log_source import telemetry_file_of


def tune_run(telemetry: Path, spec: Path | None, rate: float | None, write_to: Path | None,
             as_json: bool) -> dict:
    from ulyssesd.daemon.operator.ctl_offline import load_configs, read_records
    from ulyssesd.remediation.engine import RemediationEngine

    det, pol, job = load_configs(spec)
    if rate is not None:
        det.calibrate_false_alarm_rate = rate
    det.calibrate = False   # the replay below is the history; the fit is asked for once, at its end
    eng = RemediationEngine(det, pol, job)
    bad: list = []
    recs = list(read_records(telemetry, bad))
    for r in recs:
        eng.observe(r, r.time or 0.0)
    fit = eng.calibrate(None, recs)
    assert fit is not None
    fit["telemetry"] = str(telemetry)
    if bad:
        fit["bad_lines"] = len(bad)
    if write_to is not None:
        from ulyssesd.training.durable import atomic_write_text

        atomic_write_text(write_to, json.dumps(fit, indent=1, default=str) + "\n")
    return fit


def register_tune(app: typer.Typer) -> None:
    @app.command("tune")
    def tune(run_id: str | None = typer.Argument(None, metavar="RUN", help="run id (default: --run, else the newest)"),
             telemetry: Path | None = typer.Option(None, "--telemetry", help="a telemetry.jsonl instead of a run"),
             spec: Path | None = typer.Option(None, "--spec", help="run spec TOML whose [detectors] the fit starts from"),
             rate: float | None = typer.Option(None, "--rate", help="false alarms per step to target (default 1e-5)"),
             write: bool = typer.Option(False, "--write", help="keep the fit as calibration.json in the run directory"),
             json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
        """Fit detector thresholds to the run's own healthy history (bounded) and show them with their evidence."""
        run_dir: Path | None = None
        if telemetry is None:
            if run_id:
                CTX.run = run_id
            store = open_ro_store(json_out)
            run = current_run(store, json_out)
            run_dir = Path(run.run_dir)
            # Where the daemon reads the run's records: telemetry-stdout.jsonl for a job that prints its logs.
            telemetry = telemetry_file_of(run_dir, run.spec)
        try:
            open_regular(telemetry).close()  # never blocks: a FIFO or a device is named, not read
        except FileNotFoundError:
            die(f"telemetry file {telemetry} does not exist", EXIT_NOT_FOUND, json_out)
        except OSError as exc:  # NotRegularFile: "is a FIFO, not a regular file; not read"
            die(f"telemetry file {telemetry} {exc.strerror or exc}: give a telemetry .jsonl file", 2, json_out)
        try:
            fit = tune_run(telemetry, spec, rate, (run_dir or telemetry.parent) / "calibration.json" if write else None,
                           json_out)
        except ValueError as exc:
            die(f"cannot fit: {exc}", 2, json_out)
        if json_out:
            out(fit, True)
            return
        w = sys.stdout.write
        w(f"fit from {fit['steps']} step records of {telemetry}, target {fit['false_alarm_rate_per_step']:g} "
          f"false alarms per step\n")
        for key, why in (fit.get("not_fitted") or {}).items():
            w(f"  not fitted: {key}: {why}\n")
        for key, val in fit["values"].items():
            w(f"  {key} = {val}    # {json.dumps(fit['evidence'].get(key, {}), default=str)}\n")
        for band in (fit["evidence"].get("loss_bands") or {}).get("per_source", []):
            w(f"  loss band {band['source']}: level {band['level']}, relative sigma {band['sigma_rel']}, "
              f"threshold {band['threshold']} (first {band['first']}, {band['observations']} observations)\n")
        if fit["values"]:
            w("\n[detectors]\n" + "".join(f"{k} = {v}\n" for k, v in fit["values"].items()))
        if write:
            w(f"\nwritten to {(run_dir or telemetry.parent) / 'calibration.json'}\n")
