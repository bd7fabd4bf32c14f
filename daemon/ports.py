"""The collaborators the supervisor's parts name: small typed interfaces, wired by the `Supervisor`.

No part of the loop (daemon/core, job, safety, host, telemetry) imports the `Supervisor`, not even for a
type. Each states what it uses of the run as a `Protocol` of its own, built from these blocks plus the few
members only it touches (`core/exits.ExitRun`, `job/standby.StandbyRun`, ...); the `Supervisor` is the one
class that has them all, and mypy checks that at every call that hands it over. The blocks:

- `RunFiles`: which run and attempt, where its files are, the spec, the progress line (`say`);
- `JobConfig`: the job's current config, its version and launcher env, and the one way to change them;
- `HostSide`: the OS seam (clock and process control, host/process.py) and the attempt's job handle;
- `Records`: the store, the incident log (core/incident_log.py) and the webhook alerts;
- `Lifecycle`: the run's state and the operations that move it (fail, stop, launch, terminate).

Types named here come only from modules that import no part of the loop, so no import circle, type-only
imports included (tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ulyssesd.daemon.clock import SteadyWall
from ulyssesd.daemon.core.incident_log import IncidentLog
from ulyssesd.daemon.core.termination import Termination, TerminationPlan
from ulyssesd.daemon.host.process import JobHandle, OSInterface
from ulyssesd.daemon.spec import DaemonSection, RunSpec
from ulyssesd.daemon.store.enums import RunState, Symptom


class RunFiles(Protocol):
    """Which run and attempt, and where its files are."""

    spec: RunSpec
    dcfg: DaemonSection  # spec.daemon
    run_id: str
    run_dir: Path
    attempt: int
    say: Callable[[str], None]  # the progress line (demo, tests); a no-op in the daemon

    @property
    def ckpt_dir(self) -> Path: ...
    @property
    def telemetry_path(self) -> Path: ...
    @property
    def log_path(self) -> Path: ...  # the current attempt's log
    @property
    def exit_file(self) -> Path: ...  # the current attempt's exit record (written by the job's wrapper)
    def marker(self) -> tuple[str, str]: ...  # the env marker every process of the current attempt carries


class JobConfig(Protocol):
    """The job's config as the next launch uses it."""

    config: dict[str, Any]
    config_version: int
    launch_env: dict[str, str]  # launcher.env.* overrides from remediation

    def new_config_version(self, patch: dict[str, Any], reason: str) -> tuple[int, dict[str, list[Any]]]: ...


class HostSide(Protocol):
    """The OS seam (clock + processes) and the current attempt's job."""

    os: OSInterface
    steady: SteadyWall  # the wall clock without its steps: intervals and the engine's `now` (daemon/clock.py)
    job: JobHandle | None


class Records(Protocol):
    """Where what happens is written: the store, the incident log, the webhook."""

    store: Any  # ulyssesd.daemon.store.Store (or a test's)
    incidents: IncidentLog

    def alert(self, event: str, text: str, **details: Any) -> None: ...


class Lifecycle(Protocol):
    """The run's state and the operations that move it."""

    state: RunState
    term: Termination | None  # the pending shutdown of the attempt and what follows its exit
    last_step: int | None
    latest_ckpt: tuple[str, int] | None

    def set_state(self, to: RunState, reason: str) -> None: ...
    def fail(self, reason: str, symptom: Symptom | None = None) -> None: ...
    def stop_run(self, reason: str, fail: bool = False, pause: bool = False) -> None: ...
    def launch(self, reason: str, rollback_to_step: int | None = None, incident_id: int | None = None) -> bool: ...
    def begin_termination(self, reason: str, plan: TerminationPlan, grace: float, dump_stacks: bool = False,
                          on_stacks: Callable[[str], None] | None = None) -> None: ...
