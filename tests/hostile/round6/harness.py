"""Round 6 of the hostile probes: a real `ulyssesd run` over a small pure-Python command job.

Only the documented surfaces are used: the run spec (docs/CLIENT.md), `ulyssesd run`, `ulyssesctl --json`
and the files of the run directory (docs/CONTRACTS.md). The job scripts are written per probe; none imports
torch, so a run costs a second or two of CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
ULYSSESD = str(BIN / "ulyssesd")
ULYSSESCTL = str(BIN / "ulyssesctl")

FINAL = {"COMPLETED", "FAILED", "STOPPED"}

BASE_SPEC = """\
[run]
name = "h31"

[job]
kind = "command"
command = ["job.py"]
{job_extra}

[telemetry]
{source_line}
{telemetry_extra}

[launcher]
kind = "local"

[daemon]
preflight = false
tick_s = 0.25
stop_grace_s = {stop_grace_s}
hang_grace_s = 3
{daemon_extra}

[detectors]
warmup_steps = 3
hang_timeout_floor_s = {hang_floor_s}
{detectors_extra}
"""


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll `cond` until it returns a truthy value; fail naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@dataclass
class Run:
    """One supervised run: its spec folder, state dir and the `ulyssesd run` process."""

    root: Path
    state: Path
    spec: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    # -- the daemon -----------------------------------------------------------------------------------
    def start(self, *extra: str, preexec: Callable[[], None] | None = None) -> Run:
        out = open(self.root / "daemon.out", "ab")  # noqa: SIM115 - the daemon owns it for its life
        self.proc = subprocess.Popen(
            [ULYSSESD, "run", "--spec", str(self.spec), "--state-dir", str(self.state), *extra],
            stdout=out, stderr=subprocess.STDOUT, env=self.env or None, cwd=self.root,
            preexec_fn=preexec,
        )
        out.close()
        return self

    def daemon_output(self) -> str:
        p = self.root / "daemon.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def wait_daemon(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"ulyssesd did not exit within {timeout:.0f} s; status: {self.status()}\n"
                f"daemon output tail:\n{self.daemon_output()[-3000:]}") from None

    def signal_daemon(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    # -- ulyssesctl -----------------------------------------------------------------------------------
    def ctl(self, *args: str, timeout: float = 30) -> tuple[int, Any]:
        cmd = [ULYSSESCTL, "--state-dir", str(self.state), *args, "--json"]
        try:
            p = subprocess.run(cmd, capture_output=True, timeout=timeout, env=self.env or None)
        except subprocess.TimeoutExpired:
            return -1, {"error": f"ulyssesctl {' '.join(args)} hung for {timeout} s"}
        text = p.stdout.decode(errors="replace").strip()
        for candidate in (text, text.splitlines()[-1] if text else ""):
            try:
                return p.returncode, json.loads(candidate) if candidate else {}
            except json.JSONDecodeError:
                continue
        return p.returncode, {"raw": text, "stderr": p.stderr.decode(errors="replace")}

    def status(self) -> dict[str, Any]:
        _, st = self.ctl("status")
        return st if isinstance(st, dict) else {"raw": st}

    def state_name(self) -> str | None:
        st = self.status()
        s = st.get("state")
        return s if isinstance(s, str) else None

    def incidents(self) -> list[dict[str, Any]]:
        _, inc = self.ctl("incidents")
        if isinstance(inc, dict):
            for key in ("incidents", "items"):
                if isinstance(inc.get(key), list):
                    return list(inc[key])
            return []
        return list(inc) if isinstance(inc, list) else []

    def wait_state(self, states: set[str], timeout: float) -> str:
        return str(wait_for(lambda: (s := self.state_name()) in states and s, timeout,
                            f"state in {sorted(states)}"))

    def wait_step(self, at_least: int, timeout: float) -> int:
        def step() -> int | None:
            s = self.status().get("step")
            return s if isinstance(s, int) and s >= at_least else None
        return int(wait_for(step, timeout, f"step >= {at_least}"))

    def run_dir(self) -> Path:
        runs = self.state / "runs"
        dirs = wait_for(lambda: [d for d in runs.iterdir() if d.is_dir()] if runs.is_dir() else [], 60,
                        "a run directory")
        return Path(dirs[0])

    def stop(self) -> None:
        """Best-effort teardown: stop the run, then the daemon, then any job process left with our marker."""
        if self.proc is not None and self.proc.poll() is None:
            self.ctl("stop", timeout=15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        for pid in job_pids(self.state):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_pids(state: Path) -> list[int]:
    """Processes whose environment carries a ULYSSESD_JOB_ID and whose cwd/cmdline is under `state`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if b"ULYSSESD_JOB_ID=" not in env:
            continue
        if f"ULYSSESD_RUN_DIR={state}".encode() in env:
            found.append(int(d.name))
    return found


def make_run(tmp: Path, job: str, *, source: str | None = "stdout", job_extra: str = "", telemetry_extra: str = "",
             daemon_extra: str = "", detectors_extra: str = "", hang_floor_s: float = 60,
             stop_grace_s: float = 10, state: Path | None = None) -> Run:
    """Write job.py and run.toml under `tmp`; the state dir is `tmp/state` unless given."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "job.py").write_text(textwrap.dedent(job))
    spec = tmp / "run.toml"
    source_line = f'source = "{source}"' if source else ""
    spec.write_text(BASE_SPEC.format(job_extra=job_extra, source_line=source_line, telemetry_extra=telemetry_extra,
                                     daemon_extra=daemon_extra, detectors_extra=detectors_extra,
                                     hang_floor_s=hang_floor_s, stop_grace_s=stop_grace_s))
    env = dict(os.environ)
    env.pop("ULYSSESD_STATE_DIR", None)
    return Run(root=tmp, state=state or tmp / "state", spec=spec, env=env)


def final_state(run: Run, timeout: float = 90) -> str:
    """Wait for the daemon to exit and return the run's final state."""
    run.wait_daemon(timeout)
    return str(run.state_name())


def telemetry_health(run: Run) -> dict[str, Any]:
    p = run.run_dir() / "telemetry-stdout.health.json"
    try:
        return dict(json.loads(p.read_text()))
    except (OSError, ValueError):
        return {}
