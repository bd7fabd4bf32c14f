"""Round-7 hostile probes' kit: a command job written by the probe, a real `ulyssesd run`, `ulyssesctl`.

Black-box only: everything goes through the two executables and the files the docs name. Each probe's job
carries `R7_PROBE=<its tmp dir>` in its environment, so teardown finds and kills exactly its own processes.
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
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
ULYSSESD = str(BIN / "ulyssesd")
ULYSSESCTL = str(BIN / "ulyssesctl")
REPO = Path(__file__).resolve().parents[2]

FINAL = {"COMPLETED", "FAILED", "STOPPED"}


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    """Poll `cond` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def job_spec(
    tmp: Path,
    script: str,
    *,
    total: int | None = None,
    job: str = "",
    telemetry: str = 'source = "stdout"',
    launcher: str = 'kind = "local"',
    daemon: str = "preflight = false",
    detectors: str = "warmup_steps = 3",
    extra: str = "",
    name: str = "r7",
) -> Path:
    """Write `job.py` (the probe's script) and `run.toml` for it under `tmp`; return the spec path."""
    (tmp / "job.py").write_text(textwrap.dedent(script))
    env = f'env = {{ R7_PROBE = "{tmp}", OMP_NUM_THREADS = "1" }}'
    total_line = f"total_steps = {total}" if total else ""
    spec = f"""
[run]
name = "{name}"

[job]
kind = "command"
command = ["job.py"]
{total_line}
{job}

[telemetry]
{telemetry}

[launcher]
{launcher}
{env}

[daemon]
{daemon}

[detectors]
{detectors}
{extra}
"""
    path = tmp / "run.toml"
    path.write_text(spec)
    return path


class Daemon:
    """One `ulyssesd run` process on a state dir, with the `ulyssesctl` calls a probe makes."""

    def __init__(self, spec: Path, state: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.spec, self.state = spec, state
        state.mkdir(parents=True, exist_ok=True)
        self.log = open(state.parent / f"daemon-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [ULYSSESD, "run", "--spec", str(spec), "--state-dir", str(state), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"ulyssesd run still running after {timeout:.0f}s; log:\n{self.output()[-3000:]}") from exc

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return ctl(self.state, *args, timeout=timeout)

    def status(self) -> dict[str, Any]:
        return status(self.state)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.log.close()


def ctl(state: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ULYSSESCTL, "--state-dir", str(state), *args], capture_output=True, text=True, timeout=timeout,
    )


def status(state: Path) -> dict[str, Any]:
    """`ulyssesctl status --json`, or {} when it answers nothing parseable."""
    p = ctl(state, "status", "--json")
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def incidents(state: Path) -> list[dict[str, Any]]:
    p = ctl(state, "incidents", "--json")
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return []
    return data if isinstance(data, list) else []


def state_of(state: Path) -> str | None:
    s = status(state).get("state")
    return s if isinstance(s, str) else None


def probe_pids(tmp: Path) -> list[int]:
    """Live processes whose environment carries this probe's R7_PROBE marker (its job and anything it left)."""
    marker = f"R7_PROBE={tmp}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            st = (d / "stat").read_text()
        except OSError:
            continue
        if marker in env.split(b"\0") and ") Z" not in st:
            found.append(int(d.name))
    return found


def kill_probe(tmp: Path) -> None:
    for pid in probe_pids(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def mount_tmpfs(path: Path, size: str, *opts: str) -> None:
    """A small tmpfs at `path` (root only); `umount_lazy` undoes it."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *opts]), "tmpfs", str(path)], check=True)


def umount_lazy(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
