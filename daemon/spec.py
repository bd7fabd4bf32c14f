"""The whole run spec: the job's sections (ulyssesd.training.spec) plus the daemon's own.

`load_run_spec(path)` is the one entry point; it raises `SpecError` with one message per problem.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from ulyssesd.daemon.coexist.modes import coexist_problems
from ulyssesd.daemon.host.gpu_health import GpuHealthConfig
from ulyssesd.daemon.telemetry.framework_files import file_source_problems
from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.job import job_values
from ulyssesd.training.spec import (
    DAEMON_SECTIONS,
    JobSpec,
    SpecError,
    format_validation_error,
    job_spec_from_dict,
    read_toml,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def default_state_dir() -> str:
    """$ULYSSESD_STATE_DIR, else $XDG_STATE_HOME/ulyssesd, else ~/.local/state/ulyssesd (no root, no /etc)."""
    if os.environ.get("ULYSSESD_STATE_DIR"):
        return os.environ["ULYSSESD_STATE_DIR"]
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(xdg) / "ulyssesd")


# A run id names a directory under {state_dir}/runs: letters, digits, ".", "_", "-", starting with a letter
# or digit, so "..", ".", "", "a/b" and hidden names can never point outside (or at) the runs directory.
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
_RUN_ID_RE = re.compile(RUN_ID_PATTERN)


def run_id_problem(run_id: str) -> str | None:
    """None for a valid run id, else why it is refused (for --run-id and the spec's run.run_id)."""
    if _RUN_ID_RE.fullmatch(run_id):
        return None
    shown = run_id if len(run_id) <= 40 else run_id[:37] + "..."
    why = "is empty" if not run_id else f"is {len(run_id)} characters (at most 96)" if len(run_id) > 96 else (
        "must start with a letter or digit and hold only letters, digits, '.', '_' and '-' (no '/', no '..')")
    return f"run id {shown!r} {why}"


class RunSection(_Section):
    name: str = Field("run", pattern=RUN_NAME_PATTERN, description="Run name; the run id is derived from it.")
    run_id: str | None = Field(None, pattern=RUN_ID_PATTERN, description="Fixed run id (default: name + timestamp).")


class LauncherSection(_Section):
    kind: Literal["torchrun", "deepspeed", "srun", "local"] = Field(
        "torchrun", description="Existing launcher that starts the ranks (local = one process, no launcher).")
    nnodes: int = Field(1, ge=1, description="Nodes.")
    nproc_per_node: int = Field(1, ge=1, description="Ranks per node (GPUs per node).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile (kind=deepspeed, multi-node).")
    rdzv_endpoint: str | None = Field(None, description="torchrun c10d rendezvous host:port for multi-node.")
    master_port: int | None = Field(None, ge=1024, le=65535, description="Fixed rendezvous port (default: a free one).")
    python: str | None = Field(None, description="Python interpreter of the ranks (default: the daemon's).")
    extra_args: list[str] = Field(default_factory=list, description="Extra launcher arguments, verbatim.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the ranks.")
    module: str = Field("ulyssesd.training", description="Python module each rank runs (tests swap in a fake job).")
    # Restarts made inside one attempt by the launcher itself (docs/COEXISTENCE.md; daemon/coexist/).
    inner_restarts: Literal["auto", "off", "torchrun", "nvrx"] = Field(
        "auto", description="Who restarts failed workers inside an attempt: off = only the daemon; torchrun = torchrun "
        "--max-restarts; nvrx = NVRx ft_launcher; auto = torchrun when extra_args carry --max-restarts > 0, nvrx when "
        "they carry --ft-* flags, else off.")
    inner_max_restarts: int = Field(2, ge=1, le=100, description="Worker-group restarts the inner launcher makes per "
                                    "attempt before it gives up and the daemon takes over (its --max-restarts).")
    inner_hang: Literal["daemon", "nvrx"] = Field(
        "daemon", description="Who acts on a hang: the daemon (stack dumps, ends the attempt), or NVRx's rank "
        "heartbeat monitor (the daemon waits past inner_hang_timeout_s before it acts itself).")
    inner_hang_timeout_s: float | None = Field(None, gt=0, le=86400, description="inner_hang = 'nvrx': NVRx's rank "
                                               "heartbeat timeout, passed to ft_launcher (--ft-rank-heartbeat-timeout).")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @model_validator(mode="after")
    def _check(self) -> LauncherSection:
        if self.kind == "deepspeed" and self.nnodes > 1 and not self.hostfile:
            raise ValueError("launcher.hostfile is required for launcher.kind='deepspeed' with launcher.nnodes > 1")
        if self.kind == "torchrun" and self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("launcher.rdzv_endpoint is required for launcher.kind='torchrun' with launcher.nnodes > 1")
        return self


_SLURM_TIME = r"^(?:\d+|\d+:\d{2}(?::\d{2})?|\d+-\d{1,2}(?::\d{2}(?::\d{2})?)?)$"


class SlurmSection(_Section):
    """`[slurm]`: run the job through Slurm (docs/SLURM.md). Nodes and ranks per node are launcher.nnodes and
    launcher.nproc_per_node; launcher.kind must be "srun"."""

    mode: Literal["off", "submit", "allocation"] = Field(
        "off", description="submit = the daemon sbatch'es each attempt as a Slurm job and watches it; allocation = "
        "the daemon runs inside an allocation (salloc/sbatch) and starts the ranks with srun; off = no Slurm.")
    partition: str | None = Field(None, min_length=1, description="sbatch --partition (default: the cluster's default).")
    gres: str | None = Field(None, min_length=1, description="sbatch --gres per node, e.g. gpu:8.")
    time: str | None = Field(None, pattern=_SLURM_TIME, description="sbatch --time of each allocation "
                             "(MM, HH:MM:SS or D-HH:MM); the run continues in a new allocation when it is reached.")
    time_limit_signal_s: int = Field(120, ge=5, le=65535, description="Seconds before the time limit the job "
                                     "gets SIGUSR2 (--signal=B:USR2@N) to save a checkpoint and exit.")
    exclude: list[str] = Field(default_factory=list, description="Nodes never used (sbatch --exclude); lost nodes are added.")
    max_excluded: int | None = Field(None, ge=0, description="At most this many excluded nodes (default: as many as "
                                     "leave enough nodes in the partition for the job); beyond it the run stops.")
    on_node_loss: Literal["shrink", "stop"] = Field(
        "shrink", description="A lost node with no spare left: shrink = continue on the remaining nodes when the "
        "global batch can be kept (gradient accumulation) and the memory planner says the model fits; stop = the run "
        "stops FAILED with the explanation.")
    min_nnodes: int = Field(1, ge=1, description="shrink never goes below this many nodes (the run stops instead).")
    grow_back: StrictBool = Field(False, description="After a shrink, the next relaunch goes back to launcher.nnodes "
                                  "once every lost node is in service again (operator option).")
    plan_gpu_mem_gib: float | None = Field(None, gt=0, description="GPU memory per rank (GiB) the shrink's memory "
                                           "re-plan uses where the daemon's host has no GPU (a login node); "
                                           "default: measured on the daemon's host.")
    sbatch_args: list[str] = Field(default_factory=list, description="Extra sbatch arguments, verbatim (--account=…, --qos=…).")
    srun_args: list[str] = Field(default_factory=list, description="Extra srun arguments for the ranks, verbatim.")
    job_name: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$", description="sbatch --job-name (default: the run id).")
    poll_s: float = Field(2.0, gt=0, le=300, description="How often the watcher asks scontrol about the job and its nodes.")
    command_timeout_s: float = Field(20.0, gt=0, le=600, description="Timeout of one Slurm command (retried, bounded).")
    cancel_grace_s: float = Field(60.0, gt=0, description="After SIGTERM to the ranks (scancel --signal=TERM), "
                                  "seconds before the job is cancelled outright (scancel).")
    bin_dir: str | None = Field(None, description="Directory of the Slurm commands (default: $PATH).")


class RestartSection(_Section):
    """`[restart]`: how the next attempt starts (docs/DAEMON.md "Warm standby")."""

    standby: StrictBool = Field(False, description="Keep the next attempt's ranks warm (imported, CUDA context, checkpoint "
                          "preloaded) once an attempt trains; a relaunch opens their gate instead of a cold start.")
    standby_timeout_s: float = Field(86400.0, gt=0, description="A standby whose gate stays closed this long exits "
                                     "(code 5) and is replaced by a fresh one.")
    standby_preload: StrictBool = Field(True, description="The standby reads its ranks' shards of the latest valid "
                                  "checkpoint into host memory (checked against the manifest) while it waits.")
    standby_max_failures: int = Field(3, ge=0, le=100, description="Standbys that may die (not time out) in a run "
                                      "before the daemon stops starting them (every relaunch is then cold).")


class JobSection(_Section):
    """`[job]`: what the ranks run (docs/CLIENT.md "Supervise your own training script")."""

    kind: Literal["builtin", "command"] = Field(
        "builtin", description="builtin = ulyssesd's GPT job (the model/train/... sections); command = any program.")
    command: list[str] = Field(default_factory=list, description="kind=command: the program and its arguments the "
                               "launcher starts on every rank; placeholders {run_dir} {attempt} {config_version} "
                               "{ds_config} {checkpoint_dir} {resume}.")
    ds_config: str | None = Field(None, description="kind=command: the job's own DeepSpeed config JSON, copied to "
                                  "{run_dir}/ds_config.json ({ds_config}) on the first launch.")
    checkpoint_dir: str | None = Field(None, description="kind=command: where the job saves checkpoints "
                                       "({checkpoint_dir}; default {run_dir}/checkpoints); watched: the daemon "
                                       "finds its checkpoints there, whatever the job prints.")
    resume_requires: list[str] = Field(default_factory=list, description="kind=command: files a checkpoint "
                                       "directory must also hold to count as complete (besides its format's own "
                                       "marker and a stable size).")
    checkpoint_pattern: str | None = Field(None, min_length=1, description="kind=command: a glob, relative to "
                                           "checkpoint_dir, of the job's checkpoints when they are not its direct "
                                           "entries (e.g. 'lightning_logs/*/checkpoints/*.ckpt'); each name carries "
                                           "its step.")
    checkpoint_settle_s: float = Field(2.0, gt=0, le=600, description="kind=command: a checkpoint is complete when "
                                       "its size is the same in two looks this far apart (and its format's "
                                       "completion marker is there).")
    checkpoint_unknown_after_s: float = Field(900.0, gt=0, description="kind=command: running this long with "
                                              "no checkpoint recognised in a non-empty checkpoint_dir opens an "
                                              "incident naming the setting to give.")
    resume_first: StrictBool = Field(False, description="kind=command: fill {resume} on the first attempt too "
                               "(continue a run whose checkpoints already exist).")
    total_steps: int | None = Field(None, ge=1, description="kind=command: the run's length in optimizer steps, "
                                    "for ulyssesctl status's total and ETA when the job's telemetry does not "
                                    "report one (unknown otherwise; [train] steps is the built-in job's).")
    exit_codes: Literal["none", "ulyssesd"] = Field(
        "none", description="kind=command: what the job's exit codes mean. none = any non-zero exit is a crash "
        "(retried); ulyssesd = the job follows ulyssesd's contract, 2 = config rejected and 3 = no valid "
        "checkpoint left, both end the run without a retry (the client's `exiting` event declares it too).")

    @model_validator(mode="after")
    def _check(self) -> JobSection:
        from ulyssesd.daemon.job.command import placeholder_problems

        if self.kind == "command" and not self.command:
            raise ValueError("command is required for kind='command' (the program and its arguments)")
        if self.kind == "command" and not self.command[0].strip():
            raise ValueError(f"command's program (its first element) is empty ({self.command[0]!r}): give the "
                             f"program to run, e.g. command = [\"train.py\", \"--resume\", \"{{resume}}\"]")
        if self.kind == "builtin" and self.command:
            raise ValueError("command is only used with kind='command'")
        if self.kind == "builtin" and self.exit_codes != "none":
            raise ValueError("exit_codes is only used with kind='command' (the built-in job follows the contract)")
        if self.kind == "builtin" and self.total_steps is not None:
            raise ValueError("total_steps is only used with kind='command' (the built-in job's is [train] steps)")
        if self.checkpoint_pattern is not None and (self.checkpoint_pattern.startswith("/")
                                                    or ".." in Path(self.checkpoint_pattern).parts):
            raise ValueError(f"checkpoint_pattern {self.checkpoint_pattern!r} must be relative to checkpoint_dir "
                             f"(no leading '/', no '..'): e.g. 'lightning_logs/*/checkpoints/*.ckpt'")
        problems = placeholder_problems(self.command)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class DaemonSection(_Section):
    state_dir: str = Field(default_factory=default_state_dir, description="Runs, database and socket live here.")
    db_path: str | None = Field(None, description="SQLite file; default {state_dir}/ulyssesd.db.")
    socket_path: str | None = Field(None, description="Control socket; default {state_dir}/ulyssesd.sock.")
    tick_s: float = Field(1.0, gt=0, le=60, description="Main-loop tick.")
    stop_grace_s: float = Field(120.0, gt=0, description="SIGTERM -> SIGKILL grace for the job's process group.")
    launch_retries: int = Field(3, ge=0, le=20, description="Retries of a launch that fails to start (tenacity).")
    preflight: StrictBool = Field(True, description="Refuse a run the memory planner says cannot fit.")
    prometheus_port: int | None = Field(None, ge=1024, le=65535, description="Serve Prometheus metrics on prometheus_address:PORT/metrics (off by default).")
    prometheus_address: str = Field("127.0.0.1", min_length=1, description="Address the metrics endpoint binds (loopback by default: it has no authentication).")
    webhook_url: str | None = Field(None, description="Webhook URL for alert events: JSON with a Slack-compatible text (off by default).")
    webhook_events: list[Literal["incident", "action", "restart", "hang", "completed", "stopped", "failed", "telemetry"]] = Field(
        ["incident", "restart", "hang", "completed", "stopped", "failed", "telemetry"], description="Alert event kinds "
        "to send (telemetry: a job whose output gives no step record, docs/CLIENT.md).")
    webhook_secret_env: str | None = Field(None, description="Environment variable holding the HMAC-SHA256 key that signs each webhook POST (X-Ulyssesd-Signature).")
    socket_group: str | None = Field(None, description="Group allowed on the control socket besides root (default: ulyssesd if it exists).")
    hang_grace_s: float = Field(10.0, gt=0, description="SIGTERM -> SIGKILL grace for a hung job (it cannot save; shorter than stop_grace_s).")
    stack_dump_wait_s: float = Field(3.0, ge=0, description="Seconds to let ranks write their faulthandler stack dumps.")
    rank_exit_grace_s: float = Field(1.0, gt=0, le=60, description="A rank gone this long while other ranks of its attempt still run ends the attempt (they are stuck in a collective; torchrun would wait 30 s); a normal or agreed exit ends every rank within milliseconds.")
    rank_watch_every_s: float = Field(1.0, gt=0, le=60, description="How often the daemon scans for lost ranks (one process-table scan).")
    backoff_base_s: float = Field(2.0, ge=0, description="First crash-restart backoff; doubles per consecutive early death.")
    backoff_max_s: float = Field(60.0, ge=0, description="Upper bound of the crash-restart backoff.")
    early_death_s: float = Field(30.0, ge=0, description="An attempt that dies sooner than this without progress counts as a start failure.")
    status_every_s: float = Field(300.0, gt=0, description="Period of the status summary log line (scheduler job).")
    maintenance_every_s: float = Field(3600.0, gt=0, description="Period of store maintenance (WAL checkpoint, vacuum).")
    backup_every_s: float = Field(900.0, gt=0, description="Period of the store's online backup into {state_dir}/backups (and one at clean shutdown).")
    backups_keep: int = Field(4, ge=1, le=100, description="Newest store backups kept in {state_dir}/backups.")
    retention_every_s: float = Field(60.0, gt=0, description="Period of checkpoint retention besides the run after every checkpoint_saved event.")
    min_free_gib: float = Field(5.0, ge=0, description="Checkpoint disk margin: a save must leave this much free on its filesystem (docs/CHECKPOINT_DISK.md).")
    checkpoint_anchors: int = Field(2, ge=1, le=100, description="Known-good tags kept outside the keep_last window for rollbacks, the newest known-good first (it is never removed).")
    anchor_spacing_steps: int = Field(0, ge=0, description="Two kept known-good anchors are at least this many steps apart (0: any spacing).")
    set_aside_keep: int = Field(1, ge=0, le=100, description="Set-aside copies (rolled back, corrupt, partial tags) kept for forensics, newest first; older ones are removed.")
    set_aside_max_gib: float | None = Field(None, ge=0, description="... and at most this many GiB of them (default: no byte cap besides the count).")
    verify_max_gib: float = Field(4.0, ge=0, description="Before a relaunch the daemon sha256-checks tags up to this size (larger: sizes only; the job verifies checksums itself) so the loop never blocks for long.")
    sweep_every_s: float = Field(30.0, gt=0, description="Period of the stale-attempt sweep (attempts marked live whose process is gone).")
    attempt_log_max_mib: float = Field(1024.0, ge=1, le=1 << 20, description="An attempt's log (the job's stdout and stderr) is rotated past this size: its last half goes to attempt-N.log.1, the live file is truncated (at most 1.5x this on disk per attempt; the newest output is kept).")
    step_error_limit: int = Field(5, ge=1, le=1000, description="A tick step (telemetry, engine, exit, relaunch, ...) raising this many ticks in a row ends the run FAILED (job stopped with the stop grace) instead of spinning.")

    @model_validator(mode="after")
    def _rank_watch_within_grace(self) -> DaemonSection:
        # A loss is seen at the first scan after it and then waits out the grace: with scans rarer than the grace,
        # the scan period, not the documented grace, would decide how long stuck peers hold the GPUs.
        if self.rank_watch_every_s > self.rank_exit_grace_s:
            raise ValueError(
                f"daemon.rank_watch_every_s={self.rank_watch_every_s:g} is longer than daemon.rank_exit_grace_s="
                f"{self.rank_exit_grace_s:g}: a dead rank would end its attempt up to "
                f"{self.rank_watch_every_s + self.rank_exit_grace_s:g} s after it died (one scan period plus the "
                f"grace). Set rank_watch_every_s <= rank_exit_grace_s (a scan is one process-table pass) or raise "
                f"rank_exit_grace_s")
        return self

    def resolved_db_path(self) -> Path:
        return Path(self.db_path) if self.db_path else Path(self.state_dir) / "ulyssesd.db"

    def resolved_socket_path(self) -> Path:
        return Path(self.socket_path) if self.socket_path else Path(self.state_dir) / "ulyssesd.sock"


class DaemonSpec(_Section):
    run: RunSection = Field(default_factory=RunSection)
    launcher: LauncherSection = Field(default_factory=LauncherSection)
    detectors: DetectorsConfig = Field(default_factory=DetectorsConfig)
    remediation: RemediationConfig = Field(default_factory=RemediationConfig)
    daemon: DaemonSection = Field(default_factory=DaemonSection)
    restart: RestartSection = Field(default_factory=RestartSection)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    gpu_health: GpuHealthConfig = Field(default_factory=GpuHealthConfig)

    @model_validator(mode="after")
    def _slurm_needs_srun(self) -> DaemonSpec:
        if self.slurm.mode != "off" and self.launcher.kind != "srun":
            raise ValueError(f"slurm.mode={self.slurm.mode!r} needs launcher.kind='srun' (is {self.launcher.kind!r})")
        return self


class RunSpec(BaseModel):
    """A parsed run spec: `job` goes to the training ranks, the rest drives the daemon."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    source: str
    raw: dict[str, Any]
    job: JobSpec
    run: RunSection
    launcher: LauncherSection
    detectors: DetectorsConfig
    remediation: RemediationConfig
    daemon: DaemonSection
    restart: RestartSection = Field(default_factory=RestartSection)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    job_section: JobSection = Field(default_factory=JobSection)
    gpu_health: GpuHealthConfig = Field(default_factory=GpuHealthConfig)


def _spec_sections() -> dict[str, type[BaseModel]]:
    """Each top-level table of a spec file and its model (for the number bounds, spec_bounds.py)."""
    from ulyssesd.daemon import spec_bounds

    out: dict[str, type[BaseModel]] = {"job": JobSection}
    for model in (JobSpec, DaemonSpec):
        for name, field in model.model_fields.items():
            subs = spec_bounds._models(field.annotation)
            if subs:
                out.setdefault(name, subs[0])
    return out


def run_spec_from_dict(data: dict[str, Any], source: str = "<dict>", base_dir: Path | None = None,
                       layout: tuple[int, int, str] | None = None) -> RunSpec:
    """`layout`: (nodes, GPUs per node, what says so) to check the parallel layout against instead of the
    launcher's (`ulyssesctl plan --nodes/--gpus` plans the spec for other hardware)."""
    from ulyssesd.daemon import spec_bounds

    # Every number finite and within a physical range, named with the field and the range.
    problems: list[str] = spec_bounds.problems(data, _spec_sections())
    daemon_part = {k: v for k, v in data.items() if k in DAEMON_SECTIONS}
    job_section = JobSection()
    if "job" in data:  # `[job]` is the daemon's: the job's own sections never see it
        try:
            job_section = JobSection.model_validate(data["job"])
        except ValidationError as exc:
            problems.extend(f"[job] {p}" for p in format_validation_error(exc))
        else:
            cmd = job_section.command
            if cmd and cmd[0].endswith(".py") and base_dir is not None and not Path(cmd[0]).is_absolute():
                job_section.command = [str((Path(base_dir) / cmd[0]).resolve()), *cmd[1:]]  # the job runs in run_dir
            for key in ("ds_config", "checkpoint_dir"):  # relative to the spec file, like the job's paths
                value = getattr(job_section, key)
                if value and base_dir is not None and not Path(value).is_absolute():
                    setattr(job_section, key, str((Path(base_dir) / value).resolve()))
            if job_section.ds_config and not Path(job_section.ds_config).is_file():
                problems.append(f"[job] ds_config: {job_section.ds_config} is not a file")
    dspec: DaemonSpec | None = None
    job: JobSpec | None = None
    try:
        dspec = DaemonSpec.model_validate(daemon_part)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc))
    try:
        job = job_spec_from_dict({k: v for k, v in data.items() if k != "job"}, source, base_dir)
    except SpecError as exc:
        problems.extend(exc.problems)
    if job is not None and job.telemetry.files and base_dir is not None and not Path(job.telemetry.files).is_absolute():
        job.telemetry.files = str((Path(base_dir) / job.telemetry.files).resolve())  # the spec file's, like [job]'s
    if dspec is not None and job is not None:
        launched = dspec.launcher.world_size if layout is None else layout[0] * layout[1]
        where = "launcher.nnodes × launcher.nproc_per_node" if layout is None else layout[2]
        world = job.parallel.world_size or launched
        if job.parallel.world_size is not None and job.parallel.world_size != launched:
            problems.append(f"parallel.world_size={job.parallel.world_size} does not match {where}={launched}")
        problems.extend(standby_problems(dspec.restart, dspec.launcher, job_section))
        problems.extend(builtin_only_problems(data, job_section))
        problems.extend(coexist_problems(dspec.launcher, dspec.detectors, dspec.restart.standby))
        problems.extend(file_source_problems(job.telemetry.source, dspec.detectors.hang_timeout_floor_s))
        sp = job.parallel.sequence_parallel_size
        if world % sp:
            problems.append(f"launcher world size {world} ({where}) is not divisible by "
                            f"parallel.sequence_parallel_size={sp}")
    if problems:
        raise SpecError(source, problems)
    assert dspec is not None and job is not None
    return RunSpec(source=source, raw=data, job=job, job_section=job_section,
                   **{k: getattr(dspec, k) for k in DAEMON_SECTIONS})


def standby_problems(restart: RestartSection, launcher: LauncherSection, job: JobSection) -> list[str]:
    """A warm standby needs its own rendezvous (one node: a free port) and the built-in job (which knows the gate)."""
    if not restart.standby:
        return []
    problems = []
    if launcher.kind not in ("torchrun", "local") or launcher.nnodes > 1 or launcher.rdzv_endpoint:
        problems.append(f"restart.standby needs launcher.kind 'torchrun' or 'local' on one node without "
                        f"launcher.rdzv_endpoint (a standby rendezvous on its own free port); got kind "
                        f"{launcher.kind!r}, nnodes {launcher.nnodes}")
    if job.kind != "builtin":
        problems.append("restart.standby needs job.kind 'builtin' (only the built-in job waits at a standby gate)")
    return problems


def builtin_only_problems(data: Mapping[str, Any], job: JobSection) -> list[str]:
    """`[checkpoint]` keys only the built-in job reads (its host-memory snapshots, in-process restart, deferred
    saves), given to a command job: refused, each named, since they could not take effect (unknown is loud)."""
    from ulyssesd.training.recovery.options import RecoveryOptions

    ck = data.get("checkpoint")
    if job.kind != "command" or not isinstance(ck, Mapping):
        return []
    return [f"checkpoint.{key} is the built-in job's (ulyssesd's own snapshots and restarts inside the job); a "
            f"command job (job.kind = 'command') cannot apply it: remove it from [checkpoint]"
            for key in sorted(k for k in ck if k in RecoveryOptions.model_fields)]


def load_run_spec(path: str | Path, layout: tuple[int, int, str] | None = None) -> RunSpec:
    path = Path(path)
    return run_spec_from_dict(read_toml(path), str(path), path.parent, layout)


def engine_job_values(config: Mapping[str, Any], launcher_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job values the remediation engine takes (it never imports the spec): the job config's dotted keys,
    the model's resolved layer count (a preset leaves `model.num_layers` unset in configs/vN.json) and the
    launcher env as `launcher.env.NAME`. An invalid config raises the validation error; nothing is guessed."""
    num_layers = JobSpec.model_validate(dict(config)).resolved_model().num_layers
    return job_values(config, num_layers=num_layers, launcher_env=launcher_env)
