"""`ulyssesd`: the supervisor daemon's entry point.

    ulyssesd run --spec RUN.toml [--state-dir DIR] [--run-id ID] [--no-preflight]
    ulyssesd demo [--work-dir DIR]      (the work dir is kept: its report and state outlive the demo)
    ulyssesd --version

Exit codes of `run`: 0 the run COMPLETED or was STOPPED, or the daemon detached on SIGTERM (the job keeps
running and the next daemon re-adopts it); 2 invalid spec / bad arguments; 10 the run ended FAILED (the
systemd unit lists 10 in RestartPreventExitStatus, so a failed run is not restarted into a new one);
11 preflight refused the run; 12 another daemon already supervises this state dir or this run (its lock
file, `{state_dir}/ulyssesd.lock` or `{run_dir}/supervisor.lock`, names its pid), or owns the socket;
13 the state dir needs an operator (run directories the database does not know; see the message).
All of 2, 10-13 are in the unit's RestartPreventExitStatus: restarting cannot help. 14 the database was
found damaged mid-run: the job keeps training and a restart (systemd: Restart=on-failure) restores it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import configure_logging, get_logger
from ulyssesd.daemon.job.config import write_json_atomic

DAEMON_INFO = "ulyssesd.daemon.json"

EXIT_OK, EXIT_SPEC, EXIT_FAILED, EXIT_PREFLIGHT, EXIT_BUSY, EXIT_STATE_DIR = 0, 2, 10, 11, 12, 13
#: The database was found damaged mid-run (a bad page behind a sound header): the daemon exits, the job keeps
#: training, and the next start restores the newest backup. NOT in RestartPreventExitStatus: systemd restarts.
EXIT_STORE_DAMAGED = 14


def _print_version(value: bool) -> None:
    if value:
        from ulyssesd.daemon.operator.version import version_line

        print(version_line("ulyssesd"))
        raise typer.Exit(EXIT_OK)


def build_app() -> typer.Typer:
    """`ulyssesd`'s commands, on the same CLI framework as ulyssesctl (plain help, same exit handling)."""
    from ulyssesd.cli_app import cli_app

    app = cli_app("Supervisor for long DeepSpeed ZeRO-3 + Ulysses runs.")

    @app.callback()
    def _global(_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                              help="print the version and exit")) -> None:
        pass

    @app.command("run")
    def run_cmd(
        spec: str = typer.Option(..., "--spec", metavar="RUN.toml", help="run spec TOML"),
        state_dir: str = typer.Option(None, "--state-dir", metavar="DIR",
                                      help="state directory (overrides [daemon].state_dir)"),
        run_id: str = typer.Option(None, "--run-id", metavar="ID", help="run id (re-adopts it if unfinished)"),
        no_preflight: bool = typer.Option(False, "--no-preflight",
                                          help="skip the preflight checks: the memory planner's and the checkpoint disk's "
                                               "(the budget is still checked before every save)"),
        log_level: str = typer.Option(None, "--log-level", metavar="LEVEL",
                                      help="debug, info, warning or error (default: info)"),
    ) -> None:
        """Supervise one run (create it, or re-adopt the unfinished one)."""
        configure_logging(level=log_level)
        raise typer.Exit(run_daemon(spec, state_dir=state_dir, run_id=run_id, preflight=not no_preflight))

    @app.command("demo")
    def demo_cmd(work_dir: str = typer.Option(None, "--work-dir", metavar="DIR",
                                              help="where to put the demo's state dir (default: a new temp dir, "
                                                   "kept afterwards)")) -> None:
        """Tiny 2-rank CPU run with scripted faults, live."""
        from ulyssesd.daemon.demo import run_demo

        raise typer.Exit(run_demo(work_dir=work_dir))

    @app.command("simulate")
    def simulate_cmd(
        seed: int = typer.Option(0, "--seed", help="first seed (runs use seed .. seed+runs-1)"),
        runs: int = typer.Option(100, "--runs", min=1, help="simulated runs"),
        days: float = typer.Option(7.0, "--days", min=0.01, max=366.0, help="simulated days per run"),
        jobs: int = typer.Option(1, "--jobs", min=1, help="worker processes"),
        out: str = typer.Option(None, "--out", metavar="DIR", help="write each violation's replayable trace here"),
        replay: str = typer.Option(None, "--replay", metavar="FILE", help="replay one violation's trace"),
    ) -> None:
        """Run the real supervisor, engine and store against a simulated clock, job and disk with seeded faults,
        checking invariants after every event (docs/SIMULATION.md). Exit 1 on any violation."""
        from ulyssesd.daemon.sim.cli import simulate

        raise typer.Exit(simulate(seed, runs, days, jobs, out, replay))

    return app


def main(argv: list[str] | None = None) -> int:
    from ulyssesd.cli_app import exit_code_of

    try:
        build_app()(args=argv, prog_name="ulyssesd")
    except SystemExit as exc:  # the framework exits with the command's code
        return exit_code_of(exc)
    return EXIT_OK


def run_daemon(spec_path: str, *, state_dir: str | None = None, run_id: str | None = None, preflight: bool = True,
               say=None, os_=None) -> int:
    from ulyssesd.daemon.spec import load_run_spec, run_id_problem
    from ulyssesd.training.spec import SpecError

    log = get_logger("ulyssesd")
    if run_id is not None and (bad_id := run_id_problem(run_id)):  # it becomes a directory name: check first
        print(f"ulyssesd: --run-id refused: {bad_id}; nothing was started or changed", file=sys.stderr)
        return EXIT_SPEC
    try:
        spec = load_run_spec(spec_path)
    except SpecError as exc:
        print(f"ulyssesd: {exc}", file=sys.stderr)
        return EXIT_SPEC
    except OSError as exc:
        print(f"ulyssesd: cannot read run spec {spec_path}: {exc}", file=sys.stderr)
        return EXIT_SPEC
    if state_dir:
        spec.daemon.state_dir = state_dir
    problem = _checkpoint_dir_problem(spec)
    if problem:
        print(f"ulyssesd: {problem}; nothing was started or changed", file=sys.stderr)
        return EXIT_SPEC
    from ulyssesd.daemon.host.locks import InstanceLocks, LockHeld
    from ulyssesd.daemon.store.permissions import private_dir

    try:
        state = private_dir(spec.daemon.state_dir)
        locks = InstanceLocks(state, {"state_dir": str(state), "socket": str(spec.daemon.resolved_socket_path())})
        locks.lock_state_dir()  # before anything else is touched; held until this process ends
    except LockHeld as exc:
        print(f"ulyssesd: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except OSError as exc:  # not ours to write (permissions, read-only file system, ...)
        print(f"ulyssesd: cannot use state dir {spec.daemon.state_dir}: {exc}", file=sys.stderr)
        return EXIT_STATE_DIR
    if preflight and spec.daemon.preflight:  # the checkpoint disk, for every kind of job
        from ulyssesd.daemon.host.disk_budget import preflight_disk

        verdict = preflight_disk(spec, predict=spec.job_section.kind == "builtin")
        if verdict is not None:
            print(f"ulyssesd: preflight refused the run: {verdict}\n(use --no-preflight to override)", file=sys.stderr)
            locks.release()
            return EXIT_PREFLIGHT
    preflight = preflight and spec.daemon.preflight and spec.job_section.kind == "builtin"  # built-in GPT only
    if preflight:
        verdict = _preflight(spec, spec_path)
        if verdict is not None:
            print(f"ulyssesd: preflight refused the run: {verdict}\n(use --no-preflight to override)", file=sys.stderr)
            locks.release()
            return EXIT_PREFLIGHT

    from ulyssesd.daemon.control.protocol import ControlSocketError
    from ulyssesd.daemon.control.server import ControlServer
    from ulyssesd.daemon.core.housekeeping import LoopScheduler
    from ulyssesd.daemon.host.metrics import Metrics
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.host.sdnotify import SdNotifier
    from ulyssesd.daemon.store.recovery import (
        BACKUP_DIR_NAME,
        UnknownRunDirs,
        open_daemon_store,
        write_backup,
    )
    from ulyssesd.daemon.supervisor import Supervisor

    # The narration repeats the structured lines (one line per event): debug only, unless a caller prints it.
    say = say or (lambda m: log.debug("narration", msg=m))

    def say_store(msg: str) -> None:
        """The store's recovery story has no structured line of its own: a warning, never hidden at debug."""
        say(msg)
        log.warning("store recovered", detail=msg)

    from ulyssesd.daemon.store.errors import StoreError

    try:
        store = open_daemon_store(spec.daemon.resolved_db_path(), state, spec_source=spec.source,
                                  say=say_store).store
    except (StoreError, OSError) as exc:  # e.g. the database is not readable by this uid
        print(f"ulyssesd: cannot open the store {spec.daemon.resolved_db_path()}: {exc}", file=sys.stderr)
        locks.release()
        return EXIT_STATE_DIR
    notifier = SdNotifier()
    metrics = Metrics(spec.daemon.prometheus_port, host=spec.daemon.prometheus_address)
    metrics.start()
    alerts = None
    if spec.daemon.webhook_url:
        from ulyssesd.daemon.host.alerts import AlertConfig, AlertSender

        secret_env = spec.daemon.webhook_secret_env
        alerts = AlertSender(AlertConfig(url=spec.daemon.webhook_url, events=tuple(spec.daemon.webhook_events),
                                         secret=os.environ.get(secret_env) if secret_env else None))
        if secret_env and not alerts.config.secret:
            log.warning("webhook_secret_env names an unset variable; alerts go unsigned", variable=secret_env)
    sup = Supervisor(spec, store, os_ or RealOS(), run_id=run_id, notifier=notifier, scheduler=LoopScheduler(),
                     say=say, metrics=metrics, alerts=alerts, run_lock=locks.lock_run,
                     preflight=(lambda config: _preflight_config(spec, config)) if preflight else None)
    try:
        group = spec.daemon.socket_group if spec.daemon.socket_group is not None else "ulyssesd"
        server = ControlServer(spec.daemon.resolved_socket_path(), sup.handle_command, group=group)
    except ControlSocketError as exc:
        print(f"ulyssesd: {exc}", file=sys.stderr)
        store.close()
        locks.release()
        return EXIT_BUSY
    # Signal handlers only enqueue (and wake the poll); the loop does the work.
    # SIGUSR1/2 too: a stray `kill -USR1` meant for a rank must not kill the daemon by its default action.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: sup.enqueue("signal", signum))
    try:
        signal.set_wakeup_fd(server.wakeup_fileno, warn_on_full_buffer=False)
    except (ValueError, AttributeError):
        pass
    info = state / DAEMON_INFO
    supervising = False  # set once this daemon owns a run: only then is a shutdown backup its business
    try:
        try:
            sup.start()
            supervising = True
        except LockHeld as exc:  # another daemon supervises this run (other state dir or socket path)
            print(f"ulyssesd: {exc}", file=sys.stderr)
            return EXIT_BUSY
        except UnknownRunDirs as exc:
            print(f"ulyssesd: {exc}", file=sys.stderr)
            return EXIT_STATE_DIR
        except RuntimeError as exc:  # e.g. --run-id of a run that already ended
            print(f"ulyssesd: {exc}", file=sys.stderr)
            return EXIT_SPEC
        # Tells ulyssesctl where this daemon listens (the spec may put the socket anywhere).
        try:
            write_json_atomic(info, {"pid": os.getpid(), "socket": str(spec.daemon.resolved_socket_path()),
                                     "run_id": sup.run_id, "db": str(spec.daemon.resolved_db_path()),
                                     "started": SYSTEM.time()})
        except OSError as exc:  # e.g. a directory at its path: ulyssesctl then finds the default socket
            log.warning("could not write the daemon info file", path=str(info), error=repr(exc))
        try:
            final = sup.run_forever(poll=server.poll)
        except Exception as exc:  # a damaged page found by a write: restart into the start-up recovery
            from ulyssesd.daemon.store.errors import CorruptStoreError, classify

            if not isinstance(classify(exc, store.path), CorruptStoreError):
                raise
            supervising = False  # no shutdown backup of a damaged database
            print(f"ulyssesd: {classify(exc, store.path)}; the job keeps training; exiting {EXIT_STORE_DAMAGED} "
                  f"so that the next start restores the store (systemd restarts the daemon)", file=sys.stderr)
            log.error("store damaged mid-run; exiting for recovery", error=repr(exc)[:500])
            return EXIT_STORE_DAMAGED
    finally:
        try:
            signal.set_wakeup_fd(-1)  # before the pipe closes: a later signal must not hit a reused fd
        except ValueError:
            pass
        # Each step on its own: one that raises (a directory at the info file's path, a closed socket) must not
        # turn the run's own exit code into a traceback and 1, which systemd's Restart=on-failure would answer.
        _quietly("control socket", server.close)
        _quietly("daemon info file", lambda: info.unlink(missing_ok=True))
        _quietly("metrics", metrics.close)
        if alerts is not None:
            _quietly("alerts", alerts.close)
        _quietly("sd_notify", lambda: notifier.stopping("ulyssesd exiting"))
        if supervising and store.file_problem() is None:  # the clean-shutdown backup (never of a lost file)
            _quietly("shutdown backup", lambda: write_backup(store, state / BACKUP_DIR_NAME,
                                                             keep=spec.daemon.backups_keep))
        _quietly("store", store.close)
        _quietly("locks", locks.release)
    log.info("daemon exiting", run_id=sup.run_id, state=final.value, detached=sup.detach)
    if sup.detach:
        return EXIT_OK
    return EXIT_FAILED if final.value == "FAILED" else EXIT_OK


def _quietly(what: str, step: Callable[[], object]) -> None:
    """One step of the daemon's shutdown: its failure is logged, never raised over the run's exit code."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - the exit code is the run's; the log says what was left undone
        get_logger("ulyssesd").warning("shutdown step failed", step=what, error=repr(exc))


def _checkpoint_dir_problem(spec) -> str | None:
    """A configured checkpoint dir that exists but cannot be used is refused before anything starts."""
    d = spec.job.checkpoint.dir
    if not d:
        return None
    p = Path(d)
    if not p.exists():
        return None
    if not p.is_dir():
        return f"checkpoint.dir {p} exists but is not a directory"
    if not os.access(p, os.R_OK | os.W_OK | os.X_OK):
        return f"checkpoint.dir {p} is not readable and writable by uid {os.geteuid()}"
    try:
        next(iter(os.scandir(p)), None)
    except OSError as exc:
        return f"checkpoint.dir {p} cannot be listed: {exc}"
    return None


def _preflight_config(spec, config: dict) -> str | None:
    """`_preflight` for a patched job config (the supervisor's configs/vN.json before a relaunch)."""
    from ulyssesd.training.spec import JobSpec

    try:
        job = {k: v for k, v in config.items() if k != "launcher"}  # the stored version also holds launcher.env
        patched = spec.model_copy(update={"job": JobSpec.model_validate(job)})
    except Exception as exc:  # noqa: BLE001 - a config the planner cannot read is not launched either
        return f"the patched config is invalid: {exc}"
    return _preflight(patched)


def _preflight(spec, spec_path: str | None = None) -> str | None:
    """None if the planner says the run fits, else why it refused. Fails closed: a planner that cannot be
    imported or raises refuses the run with its error (the operator overrides with --no-preflight)."""
    from ulyssesd.daemon.operator.ctl_plan import preflight

    try:
        ok, plan = preflight(spec)
    except Exception as exc:  # noqa: BLE001 - a planner that cannot decide must not let an unplanned run start
        get_logger("ulyssesd").warning("preflight errored; refusing the run", error=repr(exc))
        return f"the planner failed: {exc!r}"
    if ok:
        if getattr(plan, "unknown", False):   # unknown is loud: a GPU run without a plan is said, not passed
            note = "; ".join(plan.notes)
            get_logger("ulyssesd").warning("preflight: memory plan skipped", reason=note)
            print(f"ulyssesd: WARNING: {note}", file=sys.stderr)
        return None
    problems = getattr(plan, "problems", None)
    said = "; ".join(str(p) for p in problems) if problems else (
        plan.render() if hasattr(plan, "render") else str(plan))
    fixes = getattr(plan, "fixes", None)
    if fixes:   # what `ulyssesctl plan` lists first: the cheapest fix that keeps the experiment and the hardware
        said += (f"\nfirst fix that fits: {fixes[0].describe()}\n(overrides: {fixes[0].overrides}; "
                 f"`ulyssesctl plan --spec {spec_path or 'SPEC'}` lists every fix)")
    else:
        said += f"\n(`ulyssesctl plan --spec {spec_path or 'SPEC'}` shows the memory plan and what would fit)"
    return said

if __name__ == "__main__":
    sys.exit(main())
