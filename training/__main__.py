"""`ulysses-train` / `python -m ulyssesd.training`: the job's command line (docs/CONTRACTS.md).

Exit codes: 0 completed or stopped by SIGTERM after saving; 2 spec/config invalid; 3 no checkpoint to
resume from; 5 a warm standby whose gate did not open in time (training/standby.py); anything else a crash (the traceback is on stderr for the daemon's log diagnosis).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import typer  # the shared CLI framework (ulyssesd.cli_app); a base dependency, no torch

EXIT_OK, EXIT_CRASH, EXIT_SPEC, EXIT_NO_CHECKPOINT = 0, 1, 2, 3


def build_app(parsed: list[SimpleNamespace]) -> typer.Typer:
    """The job's command line on the CLI framework every ulyssesd executable shares (ulyssesd.cli_app;
    no daemon import). Parsing appends the flags to `parsed`; main() runs the job with them."""
    from ulyssesd.cli_app import cli_app

    app = cli_app("The training job (one process per rank).", no_args_is_help=False)  # help: train's docstring

    @app.command()
    def train(
        ctx: typer.Context,
        config: str = typer.Option(None, "--config", metavar="JSON",
                                   help="effective job config JSON (JobSpec.to_json(), written by the daemon)"),
        spec: str = typer.Option(None, "--spec", metavar="RUN.toml",
                                 help="run spec TOML (manual use; daemon sections are ignored)"),
        standby_gate: str = typer.Option(None, "--standby-gate", metavar="GATE",
                                         help="warm standby (the daemon's): warm up, wait until this gate file "
                                              "opens, then read the config it names (training/standby.py)"),
        run_dir: str = typer.Option(None, "--run-dir", metavar="DIR", envvar="ULYSSESD_RUN_DIR",
                                    help="run directory: telemetry.jsonl, control.json, checkpoints/ "
                                         "(default $ULYSSESD_RUN_DIR or .)"),
        attempt: int = typer.Option(1, "--attempt", metavar="N", envvar="ULYSSESD_ATTEMPT",
                                    help="attempt number (faults fire on attempt 1 by default; recorded in "
                                         "telemetry)"),
        config_version: int = typer.Option(None, "--config-version", metavar="V", envvar="ULYSSESD_CONFIG_VERSION",
                                           help="config version recorded in telemetry and checkpoints"),
    ) -> None:
        """Run the ZeRO-3 + Ulysses GPT training job, one process per rank (launched by torchrun, deepspeed or
        srun; the daemon passes --config, --run-dir, --attempt, --config-version). Exactly one of --config,
        --spec, --standby-gate."""
        given = [flag for flag, value in (("--config", config), ("--spec", spec), ("--standby-gate", standby_gate))
                 if value is not None]
        if len(given) != 1:
            ctx.fail("exactly one of --config, --spec, --standby-gate is required"
                     + (f" (got {' and '.join(given)})" if given else ""))
        parsed.append(SimpleNamespace(config=config, spec=spec, standby_gate=standby_gate, run_dir=run_dir,
                                      attempt=attempt, config_version=config_version))

    return app


def _parse_args(argv: list[str] | None) -> SimpleNamespace | int:
    """The parsed flags, or the exit status when there is nothing to run: 0 after --help, 2 on a usage error
    (unknown flag, none or two of --config/--spec/--standby-gate), as argparse exited."""
    from ulyssesd.cli_app import run_cli

    parsed: list[SimpleNamespace] = []
    code = run_cli(build_app(parsed), argv, "ulysses-train")
    return parsed[0] if parsed else code


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist (`n[3-4,7],m1` -> `n3`); the job cannot import the daemon's parser."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[:nodelist.index("]") + 1]
    if "[" not in head:
        return head.strip()
    prefix, ranges = head.split("[", 1)
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]


def rank_env_from_slurm(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Under `srun` (no torchrun), the rank's identity comes from Slurm: RANK=SLURM_PROCID,
    WORLD_SIZE=SLURM_NTASKS, LOCAL_RANK=SLURM_LOCALID, LOCAL_WORLD_SIZE=the step's tasks on this node,
    MASTER_ADDR=the step's first node, MASTER_PORT=29500 + job id mod 20000. What a launcher already set wins.
    Returns (and sets) what it filled in."""
    if "SLURM_PROCID" not in env or "RANK" in env:
        return {}
    filled = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS", "1"),
              "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or ""
    if per_node:
        filled["LOCAL_WORLD_SIZE"] = per_node.split(",")[0].split("(")[0]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if "MASTER_ADDR" not in env and nodelist:
        filled["MASTER_ADDR"] = _first_host(nodelist)
    if "MASTER_PORT" not in env and (env.get("SLURM_JOB_ID") or "").isdigit():
        filled["MASTER_PORT"] = str(29500 + int(env["SLURM_JOB_ID"]) % 20000)
    env.update(filled)
    return filled


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    # SIGUSR1 -> stacks on stderr until the run directory is known (then per rank, below).
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # stderr without a file descriptor (embedded use)
        logging.getLogger("ulyssesd.training").warning("SIGUSR1 stack dumps unavailable: stderr has no fileno")


_stack_file = None  # kept open for the process's life: faulthandler writes to its fd from a C signal handler


def _register_stack_dumps(run_dir: Path, attempt: int) -> None:
    """SIGUSR1 -> every thread's stack (the daemon's hang diagnosis); does not stop the job.

    Each rank writes its own file, `{run_dir}/stacks/attempt-{A}-rank-{R}.txt`: on one shared stderr the
    ranks' dumps interleave mid-line (seen on 2×H200) and cannot be told apart. stderr is the fallback."""
    from .control import stack_dump_path

    global _stack_file
    rank = os.environ.get("RANK", "0")
    try:
        path = stack_dump_path(run_dir, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        _stack_file = open(path, "a")  # noqa: SIM115 - must outlive this function
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)
    except (OSError, ValueError) as exc:
        logging.getLogger("ulyssesd.training").warning("per-rank stack file unavailable (%s); dumps go to stderr", exc)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if isinstance(args, int):
        return args  # --help, or a usage error (printed)
    rank_env_from_slurm()  # before logging: its format names the rank
    _setup_logging()
    # DeepSpeed's ZeRO-3 calls torch's renamed collectives every step; keep the log readable.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    preload = None
    if args.standby_gate:  # a warm standby: everything config-free first, the config once the gate opens
        from .standby import EXIT_STANDBY, StandbyError, wait_at_gate

        try:
            gate, preload = wait_at_gate(Path(args.standby_gate), Path(args.run_dir or ".").resolve(), args.attempt)
        except StandbyError as exc:
            print(f"ulysses-train: {exc}", file=sys.stderr)
            return EXIT_STANDBY
        args.config, args.attempt, args.config_version = str(gate.config), gate.attempt, gate.config_version
        if gate.config_version is not None:
            os.environ["ULYSSESD_CONFIG_VERSION"] = str(gate.config_version)
    from .spec import SpecError, load_job_spec

    try:
        spec = load_job_spec(args.config or args.spec)
    except SpecError as exc:
        print(f"ulysses-train: {exc}", file=sys.stderr)
        return EXIT_SPEC
    try:
        if spec.train.device == "cpu" or (spec.train.device == "auto" and not _cuda_available()):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported
        from .train import Trainer
        from .train_checkpoints import CheckpointLoadError
    except ModuleNotFoundError as exc:  # an operator-only install (`pip install ulyssesd`) has no torch
        traceback.print_exc()  # the daemon's log diagnosis reads "No module named" (launcher_error)
        print(f"ulysses-train: the training stack is not installed ({exc}): pip install 'ulyssesd[train]'",
              file=sys.stderr)
        return EXIT_CRASH

    run_dir = Path(args.run_dir or ".").resolve()
    _register_stack_dumps(run_dir, args.attempt)
    try:
        trainer = Trainer(spec, run_dir, args.attempt, args.config_version)
        trainer.preload = preload  # a standby's checkpoint bytes in host memory (TrainerCheckpoints._resume)
        return trainer.run()
    except SpecError as exc:
        print(f"ulysses-train: {exc}", file=sys.stderr)
        return EXIT_SPEC
    except CheckpointLoadError as exc:
        print(f"ulysses-train: checkpoint load failed: {exc}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return EXIT_CRASH


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _leave(code: int) -> None:
    """Exit with `code`, the job's contract with the daemon (0 done, 2 config rejected, 4 save failed, …). The
    process-group teardown at interpreter exit can abort in C++ ("terminate called without an active
    exception": gloo threads still joinable), on a failing rank and now and then on a finishing one too, and
    turn the code into SIGABRT. So a rank flushes what it wrote (the trainer has closed its telemetry and waited
    for its saves) and leaves without running destructors."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
