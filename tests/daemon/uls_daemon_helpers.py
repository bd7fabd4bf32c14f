"""Helpers for the supervisor tests (imported by conftest and the tests): run specs around the fake job or the real one, and a bounded loop."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f'"{k}" = {toml_value(x)}' for k, x in v.items()) + "}"
    return repr(v)


def write_spec(path: Path, sections: dict, faults: list[dict] | None = None) -> Path:
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        for k, v in body.items():
            lines.append(f"{k} = {toml_value(v)}")
        lines.append("")
    for f in faults or []:
        lines.append("[[faults]]")
        for k, v in f.items():
            lines.append(f"{k} = {toml_value(v)}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def fake_spec(tmp: Path, *, steps=40, interval=10, faults=None, launcher=None, daemon=None, remediation=None,
              detectors=None, name="fake", step_s: float | None = None) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    sections = {
        "run": {"name": name},
        "launcher": {"kind": "local", "module": "fakejob_ulysses",
                     "env": {"PYTHONPATH": str(HERE), "FAKEJOB_STEP_S": str(step_s or os.environ.get("FAKEJOB_STEP_S", "0.05"))},
                     **(launcher or {})},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.1, "stop_grace_s": 5.0,
                   "hang_grace_s": 2.0, "stack_dump_wait_s": 0.5, "backoff_base_s": 0.2, "backoff_max_s": 1.0,
                   "early_death_s": 3.0, "preflight": False, **(daemon or {})},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 2.0, **(detectors or {})},
        "remediation": {**(remediation or {})},
        "train": {"steps": steps, "micro_batch_size": 1},
        "checkpoint": {"interval_steps": interval},
    }
    return write_spec(tmp / "run.toml", sections, faults)


def run_until(sup, pred, timeout: float = 60.0, tick: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.tick()
        if pred(sup):
            return True
        time.sleep(tick)
    raise AssertionError(f"condition not reached in {timeout}s; state={sup.state} step={sup.last_step}")




def wait_for(pred, timeout: float, what: str, poll: float = 0.2):
    """pred()'s first truthy value within `timeout` s (an exception counts as not yet: a database being
    written or recovered, a file appearing); AssertionError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = pred()
        except Exception:  # noqa: BLE001
            v = None
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")
