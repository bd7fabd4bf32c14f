"""Launcher abstraction: the command line that starts one attempt of the job.

Multi-node always goes through an existing launcher, never a home-made agent:
- `torchrun` (default): `--standalone` on one node, c10d rendezvous (`--rdzv-endpoint`) across nodes;
- `deepspeed`: the DeepSpeed launcher with a hostfile (pdsh/ssh fan-out);
- `srun`: Slurm starts one task per rank inside the allocation;
- `local`: one process, no launcher (world size 1; fakes and debugging).
Every attempt runs under `ulyssesd.daemon.job.wrapper`, which records the exit status for re-adoption.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulyssesd.daemon.coexist import modes as coexist
from ulyssesd.daemon.spec import LauncherSection

JOB_MARKER_ENV = "ULYSSESD_JOB_ID"


def job_marker(run_id: str, run_dir: Path, attempt: int) -> tuple[str, str]:
    """The environment marker every process of an attempt carries (the no-orphan scan and the rank watch find
    ranks by it). The run directory's hash keeps two daemons apart whose runs share a name and a start second
    (run ids are name + UTC second): with `run_id:attempt` alone each would kill the other's ranks."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]  # noqa: S324 - not security
    return (JOB_MARKER_ENV, f"{run_id}:{attempt}:{digest}")


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: Path
    exit_file: Path
    marker: tuple[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(launcher: LauncherSection, config_path: Path, run_dir: Path, attempt: int,
                 config_version: int, standby_gate: Path | None = None) -> list[str]:
    """The per-rank program and its arguments (after the launcher's own flags). A warm standby gets its gate
    instead of a config: the gate names the config once it opens (daemon/job/standby.py)."""
    if standby_gate is not None:
        return ["-m", launcher.module, "--standby-gate", str(standby_gate), "--run-dir", str(run_dir),
                "--attempt", str(attempt)]
    return ["-m", launcher.module, "--config", str(config_path), "--run-dir", str(run_dir),
            "--attempt", str(attempt), "--config-version", str(config_version)]


def build_launch(launcher: LauncherSection, *, run_id: str, run_dir: Path, attempt: int, config_version: int,
                 base_env: dict[str, str] | None = None, job: Any = None,
                 rollback_to_step: int | None = None, standby_gate: Path | None = None,
                 slurm: Any = None, resume: Path | None | bool = True) -> LaunchPlan:
    """`job`: the spec's `[job]` section; kind=command runs the user's program (daemon/job/command.py), whose
    {resume} is bounded by `rollback_to_step` on a rollback (`resume`: the checkpoint the launch chose; True: pick it). `standby_gate`: a warm standby of the built-in job."""
    python = launcher.python or sys.executable
    # `slurm`: the spec's `[slurm]`; mode="submit" makes the attempt a Slurm job that daemon/job/slurm_watch.py
    # submits and watches (docs/SLURM.md); lost nodes ({run_dir}/slurm/exclude.json) are excluded either way.
    from ulyssesd.daemon.job import slurm as sl

    submit = launcher.kind == "srun" and slurm is not None and slurm.mode == "submit"
    excluded = list(dict.fromkeys([*(slurm.exclude if slurm is not None else []), *sl.read_exclusions(run_dir)])) \
        if launcher.kind == "srun" else []
    config_path = run_dir / "configs" / f"v{config_version}.json"
    prog = rank_command(launcher, config_path, run_dir, attempt, config_version, standby_gate)
    kind = launcher.kind
    # What each launcher starts: `direct` is exec'd as is (local, srun); torchrun and deepspeed are given a
    # script (+ args) or a module, and add the interpreter themselves.
    direct = [python, *prog]
    via_torchrun = prog
    via_deepspeed = ["--module", launcher.module, *prog[2:]]
    if job is not None and job.kind == "command":
        from ulyssesd.daemon.job.command import render_command

        user = render_command(job, run_dir=run_dir, attempt=attempt, config_version=config_version,
                              rollback_to_step=rollback_to_step, resume=resume)
        script = user[0].endswith(".py")
        # A non-Python program: the launchers' own "do not prepend python" switches.
        direct = [python, *user] if script else user
        via_torchrun = user if script else ["--no-python", *user]
        via_deepspeed = user if script else ["--no_python", *user]
    if kind == "local":
        cmd = direct
    elif kind == "torchrun":
        # torchrun, or NVRx's ft_launcher, with the inner restarts of [launcher] inner_restarts (daemon/coexist/).
        cmd = [*coexist.launcher_argv(coexist.resolve(launcher), python), f"--nnodes={launcher.nnodes}",
               f"--nproc-per-node={launcher.nproc_per_node}"]
        if launcher.nnodes == 1 and not launcher.rdzv_endpoint:
            port = launcher.master_port or free_port()
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}-{attempt}"]
        else:
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launcher.rdzv_endpoint}", f"--rdzv-id={run_id}-{attempt}"]
        cmd += [*launcher.extra_args, *via_torchrun]
    elif kind == "deepspeed":
        cmd = [python, "-m", "deepspeed.launcher.runner", f"--num_nodes={launcher.nnodes}",
               f"--num_gpus={launcher.nproc_per_node}"]
        if launcher.hostfile:
            cmd += [f"--hostfile={launcher.hostfile}"]
        if launcher.master_port:
            cmd += [f"--master_port={launcher.master_port}"]
        cmd += [*launcher.extra_args, *via_deepspeed]
    elif kind == "srun" and submit:
        cmd = [python, "-m", "ulyssesd.daemon.job.slurm_watch", "--plan",
               str(run_dir / sl.SLURM_DIR / f"attempt-{attempt}.plan.json")]
    elif kind == "srun":
        # Inside an allocation (salloc / sbatch of the daemon): one task per rank; lost nodes excluded.
        cmd = ["srun", f"--nodes={launcher.nnodes}", f"--ntasks-per-node={launcher.nproc_per_node}",
               "--kill-on-bad-exit=1", *([f"--exclude={','.join(excluded)}"] if excluded else []),
               *(slurm.srun_args if slurm is not None else []), *launcher.extra_args, *direct]
    else:  # pragma: no cover - the spec's Literal forbids it
        raise ValueError(f"launcher.kind={kind!r} is not supported")
    exit_file = run_dir / "attempts" / f"{attempt}.exit"
    log_path = run_dir / "logs" / f"attempt-{attempt}.log"
    argv = [python, "-m", "ulyssesd.daemon.job.wrapper", "--exit-file", str(exit_file), "--", *cmd]
    marker = job_marker(run_id, run_dir, attempt)
    env = dict(base_env if base_env is not None else os.environ)
    env.update(launcher.env)
    if kind == "torchrun":
        env.update(coexist.launcher_env(coexist.resolve(launcher), env))
    env.update({
        "ULYSSESD_RUN_DIR": str(run_dir),
        "ULYSSESD_ATTEMPT": str(attempt),
        "ULYSSESD_CONFIG_VERSION": str(config_version),
        marker[0]: marker[1],
        "PYTHONUNBUFFERED": "1",
        # torchrun would otherwise set OMP_NUM_THREADS=1 with a warning; keep it explicit and quiet.
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    if kind == "local":
        env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launcher.master_port or free_port())})
    elif kind == "srun" and not submit:
        # Every attempt in one allocation has the same job id: the port the ranks derive from it would be the
        # previous attempt's (maybe still in TIME_WAIT); a port per attempt instead. The first node is the
        # rendezvous (SLURM_STEP_NODELIST, training/__main__.py).
        env["MASTER_PORT"] = str(launcher.master_port or sl.port_for_job(run_id, attempt))
    (run_dir / "attempts").mkdir(parents=True, exist_ok=True)
    if submit:
        _write_submit_plan(launcher, slurm, run_id=run_id, run_dir=run_dir, attempt=attempt, env=env,
                           marker=marker, rank_argv=[*launcher.extra_args, *direct], exclude=excluded,
                           log_path=log_path)
    return LaunchPlan(argv=argv, env=env, cwd=str(run_dir), log_path=log_path, exit_file=exit_file, marker=marker)


def _write_submit_plan(launcher: LauncherSection, slurm: Any, *, run_id: str, run_dir: Path, attempt: int,
                       env: dict[str, str], marker: tuple[str, str], rank_argv: list[str], exclude: list[str],
                       log_path: Path) -> None:
    """The batch script and the watcher's plan of a submit-mode attempt ({run_dir}/slurm/attempt-N.*)."""
    from ulyssesd.daemon.job import slurm as sl
    from ulyssesd.daemon.job.slurm_watch import WatchPlan

    sdir = run_dir / sl.SLURM_DIR
    sdir.mkdir(parents=True, exist_ok=True)
    script = sdir / f"attempt-{attempt}.sbatch"
    port = launcher.master_port or sl.port_for_job(run_id, attempt)
    script.write_text(sl.batch_script(rank_argv, nodes=launcher.nnodes, ntasks_per_node=launcher.nproc_per_node,
                                      mark_path=sdir / sl.TIME_LIMIT_MARK.format(attempt=attempt),
                                      master_port=port, srun_args=slurm.srun_args))
    script.chmod(0o700)
    # The ranks run on other hosts, where the daemon's marker scan cannot see them: they do not carry it.
    job_env = {k: v for k, v in env.items() if k != marker[0]}
    WatchPlan(run_dir=str(run_dir), attempt=attempt, script=str(script),
              sbatch_args=sl.sbatch_args(slurm, job_name=run_id, nodes=launcher.nnodes,
                                         ntasks_per_node=launcher.nproc_per_node, exclude=exclude,
                                         log_path=log_path, run_dir=run_dir),
              env=job_env, ntasks_per_node=launcher.nproc_per_node, poll_s=slurm.poll_s,
              command_timeout_s=slurm.command_timeout_s, cancel_grace_s=slurm.cancel_grace_s,
              bin_dir=slurm.bin_dir).write(sdir / f"attempt-{attempt}.plan.json")
