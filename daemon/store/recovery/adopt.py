"""Run directories the store does not know: adopt one (its row, the state its directory says, the
`store_damaged` incident), or refuse to start a fresh run beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..enums import IncidentStatus, RunState, Severity, Symptom
from .backups import BACKUP_DIR_NAME

if TYPE_CHECKING:
    from ..repository.store import Store


def adopt_run_dir(store: Store, run_dir: Path, run_id: str, *, spec_path: str | None) -> Any:
    """Create the store's row for a run directory it does not know (the database was emptied, restored
    from an older backup, or replaced): state RUNNING when its job still runs, else BACKOFF (the daemon
    relaunches from the newest valid checkpoint), STARTING when it never launched."""
    from ulyssesd.training.spec import SpecError, read_toml

    try:  # bounded and refuses a special file: a spec.toml that is a FIFO must not hang the daemon's start
        raw = read_toml(run_dir / "spec.toml")
    except SpecError:
        raw = {}
    store.create_run(run_id, spec=json.loads(json.dumps(raw, default=str)), run_dir=str(run_dir),
                     spec_path=spec_path or str(run_dir / "spec.toml"), state="STARTING",
                     reason="re-adopted from its run directory (the store did not know it)")
    return store.get_run(run_id)


def settle_adopted_state(store: Store, run: Any, what: dict[str, Any]) -> None:
    """A run row created by `adopt_run_dir` (STARTING) gets the state its directory says: RUNNING with a
    live job (re-adopted), BACKOFF when attempts ran but none is alive (relaunched from the newest valid
    checkpoint), STARTING when it never launched (launched)."""
    live = what.get("live_job")
    if live and live["attempt"] in what.get("attempts", []) and run.state not in (RunState.STARTING, RunState.RUNNING):
        # The backup predates the live attempt: the restart (or backoff, or stop) it recorded as in progress
        # is long over. Left as it is, re-adoption would "finish" that restart by killing the healthy job.
        store.set_run_state(run.id, RunState.RUNNING,
                            f"store restored: attempt {live['attempt']} (newer than the backup) is training")
        return
    if run.state != RunState.STARTING or not what.get("last_attempt"):
        return
    if what.get("completed"):
        store.set_run_state(run.id, RunState.COMPLETED, "re-adopted: its last attempt had completed the run")
    elif what.get("live_job"):
        store.set_run_state(run.id, RunState.RUNNING, "re-adopted: its job is still running")
    else:
        store.set_run_state(run.id, RunState.BACKOFF, "re-adopted: no live job; relaunch from the newest checkpoint")


def record_recovery(store: Store, run_id: str, what: dict[str, Any], summary: str) -> int:
    """The `store_damaged` incident of one run: what was restored and re-derived (resolved at once)."""
    iid = store.record_incident(run_id, attempt=int(what.get("last_attempt") or 0), symptom=Symptom.store_damaged,
                                step=int(what.get("last_step") or 0), severity=Severity.warning,
                                summary=summary[:500], evidence=json.loads(json.dumps(what, default=str)))
    store.update_incident_status(iid, IncidentStatus.resolved, "store recovered; supervision continues")
    return iid


class UnknownRunDirs(RuntimeError):
    """Run directories exist that the store does not know: starting a fresh run beside them would
    silently restart training from step 0 (typically the database was emptied or replaced)."""


def refuse_unknown_run_dirs(store: Store, state_dir: Path, new_run_id: str, spec_source: str | None) -> None:
    """Raise UnknownRunDirs naming them and saying how to adopt or archive them."""
    runs_root = state_dir / "runs"
    if not runs_root.is_dir():
        return
    known = {r.id for r in store.list_runs()}
    unknown = sorted(p.name for p in runs_root.iterdir() if p.is_dir() and p.name not in known)
    if not unknown:
        return
    spec = spec_source or "RUN.toml"
    shown = ", ".join(unknown[:10]) + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
    raise UnknownRunDirs(
        f"refusing to start run {new_run_id}: {runs_root} holds run directories the database does not know "
        f"({shown}); the database was probably emptied or replaced. To continue one of them: "
        f"`ulyssesd run --spec {spec} --state-dir {state_dir} --run-id {unknown[-1]}` (re-adopts it from its "
        f"directory: configs, checkpoints, telemetry). To start fresh instead, archive them first: "
        f"`mkdir -p {state_dir}/archive && mv {runs_root}/{unknown[-1]} {state_dir}/archive/`. Backups of the "
        f"database, if any, are in {state_dir / BACKUP_DIR_NAME}")
