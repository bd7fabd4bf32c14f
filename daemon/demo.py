"""`ulyssesd demo` (what `make demo` runs): a tiny 2-rank CPU run under the real supervisor, with a
scripted series of faults, showing live what the daemon detects and does.

Fresh state dir in a temp (or given) work dir; the real training job (torchrun, 2 ranks, gloo, ZeRO-3 +
Ulysses SP=2); faults injected by the job itself (`[[faults]]`, each on a chosen attempt):

  attempt 1: loss spike (→ hot: gradient clipping 1.0 → 0.5 via control.json, no restart),
             slow rank (→ evidence recorded: per-rank step times, CPU hogs), memory spike (→ memory ladder: restart with a new config)
  attempt 2: crash (an exception in the step → diagnose the log → restart from the latest checkpoint)
  attempt 3: hang (→ stack dumps of both ranks → SIGTERM → SIGKILL → restart)
  attempt 4: NaN loss (→ roll back to a known-good checkpoint and skip the bad batches)
  attempt 5: trains to the final step.

Watchable live: the demo listens on its own control socket and writes `ulyssesd.daemon.json` into its state
dir as `ulyssesd run` does, and prints the `ulyssesctl --state-dir STATE status --watch` command that follows
it from another terminal (pause/resume/stop work there too).

Ends with the incidents table, goodput (productive training time / wall time) and the run's postmortem
report (`report-RUN.html` in the work dir, next to `state/`); exit code 0 only when the run completed and
the report was written (3: completed, report not written).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ulyssesd.daemon.clock import SYSTEM

DEMO_SPEC = """\
# ulyssesd demo: tiny 2-rank CPU run (gloo, ZeRO-3, Ulysses SP=2) with scripted faults.
[run]
name = "demo"

[launcher]
kind = "torchrun"
nproc_per_node = 2

[model]
preset = "tiny"

[parallel]
sequence_parallel_size = 2

[precision]
dtype = "fp32"

[train]
steps = 60
seq_len = 128
micro_batch_size = 2
lr = 1e-3
min_lr = 1e-4
warmup_steps = 5
gradient_clipping = 1.0
device = "cpu"

[deepspeed.config.zero_optimization]
stage = 3
stage3_param_persistence_threshold = 1e6
overlap_comm = false

[data]
kind = "synthetic"

[checkpoint]
interval_steps = 5
keep_last = 4
verify_checksums = true

[detectors]
warmup_steps = 4
window = 12
memory_min_delta_gib = 1.0
slow_step_min_consecutive = 2
hang_timeout_floor_s = 12.0
hang_step_multiplier = 10.0

[remediation]
mode = "act"
grace_steps = 2
verify_steps = 5
known_good_steps = 3
rollback_steps_back = 2
skip_min_batches = 4
skip_max_batches = 8
max_restarts_per_hour = 10
no_progress_restarts = 4

[daemon]
tick_s = 0.25
stop_grace_s = 60.0
hang_grace_s = 8.0
stack_dump_wait_s = 2.0
early_death_s = 5.0
preflight = false

# --- the script: each fault fires once, on the attempt it names -------------------------------
[[faults]]   # a loss spike that persists 3 steps: the loss ladder's first rung, applied hot
kind = "loss_spike"
at_step = 10
steps = 3
magnitude = 6.0
attempts = [1]

[[faults]]   # rank 1 sleeps 3 s per step for 3 steps: slow steps, evidence collected
kind = "slow_rank"
at_step = 17
steps = 3
rank = 1
magnitude = 3.0
attempts = [1]

[[faults]]   # +3 GiB held for 3 steps: the memory ladder (restart with a new config version)
kind = "memory_spike"
at_step = 24
steps = 3
magnitude = 3.0
attempts = [1]

[[faults]]   # an exception inside the training step
kind = "raise"
at_step = 31
attempts = [2]

[[faults]]   # rank 0 stops making progress
kind = "hang"
at_step = 38
attempts = [3]

[[faults]]   # NaN loss: roll back to known-good and skip the batches
kind = "nan_loss"
at_step = 46
attempts = [4]
"""


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(text)


def _console():
    from rich.console import Console

    con = Console()
    if not con.is_terminal:  # piped (CI logs): wide enough for the incidents table
        con = Console(width=140)
    return con


def run_demo(work_dir: str | None = None) -> int:
    from ulyssesd.daemon.host.logging import configure_logging
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.operator.ctl_records import incidents_table
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.supervisor import Supervisor

    con = _console()
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="ulyssesd-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    state = work / "state"
    spec_path = work / "run.toml"
    text = DEMO_SPEC.replace("[daemon]\n", f'[daemon]\nstate_dir = "{state}"\nsocket_path = "{work / "d.sock"}"\n', 1)
    spec_path.write_text(text)
    # The daemon's own structured log goes to a file; the console shows the story.
    log_file = open(work / "ulyssesd.log", "w")
    configure_logging(json=True, stream=log_file)
    spec = load_run_spec(spec_path)
    store = open_store(spec.daemon.resolved_db_path())
    t0 = SYSTEM.monotonic()

    def say(msg: str) -> None:
        limit = 200 if msg.startswith("INCIDENT") else 110
        if len(msg) > limit:
            msg = msg[:limit - 3] + "..."
        style = ("bold red" if msg.startswith("INCIDENT") else "yellow" if msg.lstrip().startswith("action")
                 else "magenta" if msg.startswith("[fault") else "cyan" if msg.startswith("state") else
                 "green" if "saved" in msg else "white")
        con.print(f"[dim]{SYSTEM.monotonic() - t0:6.1f}s[/dim] [{style}]{escape(msg)}[/{style}]", highlight=False)

    con.rule("[bold]ulyssesd demo[/bold]: tiny 2-rank CPU run, scripted faults")
    con.print(f"work dir: {work}\nspec:     {spec_path}\nfaults:   loss spike, slow rank, memory spike "
              f"(attempt 1) · crash (2) · hang (3) · NaN (4)\n")
    sup = Supervisor(spec, store, RealOS(), say=say)
    sup.start()
    server = open_live_view(spec, sup, state, con)
    last_shown = 0
    deadline = SYSTEM.monotonic() + 900
    try:
        while sup.state.value not in ("COMPLETED", "FAILED", "STOPPED") and SYSTEM.monotonic() < deadline:
            sup.tick()
            r = sup.last_step_record
            if r is not None and r.step >= last_shown + 5:
                last_shown = r.step
                con.print(f"[dim]{SYSTEM.monotonic() - t0:6.1f}s   step {r.step:3d}  loss {r.loss:.4f}  "
                          f"{(r.tokens_per_s or 0):,.0f} tok/s  mem {(r.mem_max_allocated_gib or 0):.2f} GiB[/dim]",
                          highlight=False)
            if server is not None:
                server.poll(spec.daemon.tick_s)  # the tick's sleep, answering ulyssesctl meanwhile
            else:
                SYSTEM.sleep(spec.daemon.tick_s)
    except KeyboardInterrupt:
        con.print("[yellow]interrupted: stopping the job[/yellow]")
        sup.handle_command({"cmd": "stop"})
        while sup.job is not None and SYSTEM.monotonic() < deadline:
            sup.tick()
            SYSTEM.sleep(0.2)
    finally:
        if server is not None:  # the run is over (or the demo is leaving): nothing to watch any more
            (state / DAEMON_INFO).unlink(missing_ok=True)
            server.close()
    wall = SYSTEM.monotonic() - t0
    con.rule("incidents")
    con.print(incidents_table(store.list_incidents(sup.run_id, with_actions=True)))
    good = goodput(sup.telemetry_path, wall)
    con.rule("result")
    con.print(f"run {sup.run_id}: [bold]{sup.state.value}[/bold] at step {sup.last_step} after "
              f"{len(store.list_attempts(sup.run_id))} attempts, config v{sup.config_version}")
    con.print(f"goodput: {good['productive_s']:.1f} s productive training / {wall:.1f} s wall = "
              f"[bold]{good['goodput']:.0%}[/bold]  ({good['unique_steps']} unique steps, "
              f"{good['steps_run']} steps run, {good['steps_run'] - good['unique_steps']} redone after rollbacks)")
    con.print(f"inspect: {ulyssesctl_command()} --state-dir {state} status | incidents | incident ID | config")
    report_path, report_error = write_demo_report(store, sup.run_id, work)
    if report_error is None:
        con.print(f"report:  {escape(str(report_path))}")
    else:
        con.print(f"[bold red]report: could not write {escape(str(report_path))}: {escape(report_error)}[/bold red]")
    configure_logging()  # back to stdout before the file goes away (the demo may run in-process)
    log_file.close()
    if sup.state.value != "COMPLETED":
        return DEMO_EXIT_RUN_NOT_COMPLETED
    return DEMO_EXIT_OK if report_error is None else DEMO_EXIT_REPORT_FAILED


#: The file `ulyssesctl` reads to find a live daemon (its pid, socket, run, database): `ulyssesd run` writes
#: the same one (daemon/cli.py); the demo cannot import it from there (the cli imports the demo).
DAEMON_INFO = "ulyssesd.daemon.json"


def open_live_view(spec, sup, state: Path, con):
    """The demo's control socket and daemon info file, as `ulyssesd run` has them, so that `ulyssesctl
    --state-dir STATE status --watch` follows the demo from another terminal. Prints that command. None
    (and says why) when the socket cannot be made: the demo runs on, without the live view."""
    import os

    from ulyssesd.daemon.control.protocol import ControlSocketError
    from ulyssesd.daemon.control.server import ControlServer
    from ulyssesd.daemon.job.config import write_json_atomic

    socket_path = spec.daemon.resolved_socket_path()
    try:
        server = ControlServer(socket_path, sup.handle_command, group=None)  # root and this uid may connect
    except (ControlSocketError, OSError) as exc:
        con.print(f"[yellow]no live view ({escape(str(exc))}); the demo runs on[/yellow]")
        return None
    write_json_atomic(state / DAEMON_INFO, {"pid": os.getpid(), "socket": str(socket_path), "run_id": sup.run_id,
                                            "db": str(spec.daemon.resolved_db_path()), "started": SYSTEM.time()})
    con.print(f"watch live (another terminal): [bold]{escape(watch_command(state))}[/bold]\n", highlight=False)
    return server


def watch_command(state: Path) -> str:
    """The exact command that follows the demo's run live."""
    import shlex

    return f"{ulyssesctl_command()} --state-dir {shlex.quote(str(state))} status --watch"


def ulyssesctl_command() -> str:
    """How a shell calls this installation's ulyssesctl: its bare name when PATH finds it, else its full path
    (`make demo` runs .venv/bin/ulyssesd without activating the venv: a bare `ulyssesctl` is not found)."""
    import shlex
    import shutil
    import sys

    mine = Path(sys.executable).parent / "ulyssesctl"  # not resolved: a venv's python is a symlink
    found = shutil.which("ulyssesctl")
    if not mine.exists() or (found is not None and Path(found).resolve() == mine.resolve()):
        return "ulyssesctl"
    return shlex.quote(str(mine))


#: Demo exit codes: the run completed and its report was written · the run did not complete ·
#: the run completed but its postmortem report could not be written.
DEMO_EXIT_OK, DEMO_EXIT_RUN_NOT_COMPLETED, DEMO_EXIT_REPORT_FAILED = 0, 1, 3


def write_demo_report(store, run_id: str, work: Path) -> tuple[Path, str | None]:
    """Write the run's postmortem page (what `ulyssesctl report` writes) as `work/report-RUN.html`, next to
    the state dir. Returns (path, None) on success, (path, why) when rendering or writing failed: the demo
    reports that as its own error instead of a traceback that would hide the run's result above it."""
    from ulyssesd.daemon.operator.report import render_report

    target = work / f"report-{run_id}.html"
    try:
        page = render_report(store, run_id)
        target.write_text(page, encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - any failure is reported with its cause; the run is already over
        return target, f"{type(exc).__name__}: {exc}"
    return target.resolve(), None


def goodput(telemetry: Path, wall_s: float) -> dict[str, float]:
    """Productive time = step time of the steps in the final trajectory (the last record of each step);
    steps redone after a restart or rollback count once."""
    last: dict[int, float] = {}
    run = 0
    try:
        lines = telemetry.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("kind") == "step" and isinstance(d.get("step_time_s"), int | float):
            last[int(d["step"])] = float(d["step_time_s"])
            run += 1
    productive = sum(last.values())
    return {"productive_s": productive, "wall_s": wall_s, "goodput": productive / wall_s if wall_s else 0.0,
            "unique_steps": len(last), "steps_run": run}
