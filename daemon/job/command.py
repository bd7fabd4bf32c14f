"""`[job] kind = "command"`: supervise any program (the user's own training script) instead of the built-in GPT.

    [job]
    kind = "command"
    command = ["train.py", "--deepspeed_config", "{ds_config}", "--output_dir", "{checkpoint_dir}",
               "--resume_from_checkpoint", "{resume}"]
    ds_config = "ds_config.json"          # the job's own DeepSpeed config, copied into the run directory
    checkpoint_dir = "out"                # where the job saves its checkpoints
    resume_requires = ["trainer_state.json"]

The launcher of `[launcher]` starts `command` on every rank (a `.py` first element runs under the
launcher's Python). Placeholders: {run_dir} {attempt} {config_version} {ds_config} {checkpoint_dir}
{resume}. An argument that formats to the empty string is dropped (a bare "{resume}" when there is nothing
to resume from also drops the `--option` right before it).
{resume} = the newest complete checkpoint under checkpoint_dir (the layouts and what "complete" means:
checkpoint_files.py; never one a rollback abandoned: checkpoint_watch.py).
"""

from __future__ import annotations

import shutil
import string
from pathlib import Path
from typing import Any

from ulyssesd.daemon.job.checkpoint_files import RollbackBounds, WatchConfig, resume_point

PLACEHOLDERS = ("run_dir", "attempt", "config_version", "ds_config", "checkpoint_dir", "resume")


def placeholder_problems(command: list[str]) -> list[str]:
    """Unknown or malformed placeholders in a command (the spec validator's message)."""
    problems = []
    for arg in command:
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(arg) if f is not None]
        except ValueError as exc:
            problems.append(f"command argument {arg!r}: {exc} (write a literal brace as {{{{ or }}}})")
            continue
        for name in names:
            if name not in PLACEHOLDERS:
                problems.append(f"command argument {arg!r}: unknown placeholder {{{name}}} "
                                f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
    return problems


def watch_config(job: Any, run_dir: Path) -> WatchConfig:
    """What the checkpoint watch and `{resume}` look at, from the spec's `[job]`."""
    return WatchConfig(root=checkpoint_root(job, run_dir), pattern=getattr(job, "checkpoint_pattern", None),
                       requires=tuple(job.resume_requires),
                       settle_s=float(getattr(job, "checkpoint_settle_s", 2.0)),
                       unknown_after_s=float(getattr(job, "checkpoint_unknown_after_s", 900.0)))


def checkpoint_root(job: Any, run_dir: Path) -> Path:
    return Path(job.checkpoint_dir) if job.checkpoint_dir else Path(run_dir) / "checkpoints"


def newest_complete_checkpoint(root: Path, requires: list[str] | tuple[str, ...] = (),
                               max_step: int | None = None) -> Path | None:
    """The newest complete checkpoint under `root` (checkpoint_watch.resume_point, no rollback bounds);
    `max_step`: a rollback's bound (the newest complete checkpoint at or before that step)."""
    found, _ = resume_point(WatchConfig(root=Path(root), requires=tuple(requires)), None, max_step)
    return found.path if found else None


# Remediation's config keys (the built-in job's names) -> where they live in a DeepSpeed config.
DS_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "train.gradient_clipping": ("gradient_clipping",),
    "train.lr": ("optimizer", "params", "lr"),
    "train.micro_batch_size": ("train_micro_batch_size_per_gpu",),
    "train.gradient_accumulation_steps": ("gradient_accumulation_steps",),
}
_DS_PREFIX = "deepspeed.config."


def ds_config_patch(base: dict[str, Any], current: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    """What remediation changed between two config versions, as DeepSpeed-config paths -> new values.
    Keys with no DeepSpeed equivalent (model/precision/data of the built-in job) are left out."""
    from ulyssesd.daemon.store import flat_diff

    def leaves(key: str, value: Any) -> list[tuple[str, Any]]:  # a section new in `current` diffs as a whole
        if isinstance(value, dict):
            return [leaf for k, v in value.items() for leaf in leaves(f"{key}.{k}", v)]
        return [(key, value)]

    out: dict[tuple[str, ...], Any] = {}
    changed = [leaf for key, (_old, new) in flat_diff(base, current).items() for leaf in leaves(key, new)]
    for key, new in changed:
        if key in DS_CONFIG_KEYS:
            out[DS_CONFIG_KEYS[key]] = new
        elif key.startswith(_DS_PREFIX):
            out[tuple(key[len(_DS_PREFIX):].split("."))] = new
    return out


def patched_ds_config(run_dir: Path, config_version: int) -> Path:
    """`{run_dir}/ds_config.json` (the job's own, copied) with what remediation changed up to this config
    version applied: `ds_config.v{N}.json`, or the copy itself when nothing applies. A key the job's config
    does not have in a nested place that does not exist (e.g. an optimizer lr without an `optimizer`
    section) is not invented."""
    import json

    base_path = run_dir / "ds_config.json"
    try:
        v1 = json.loads((run_dir / "configs" / "v1.json").read_text())
        cur = json.loads((run_dir / "configs" / f"v{config_version}.json").read_text())
    except (OSError, ValueError):
        return base_path
    patch = ds_config_patch(v1, cur)
    if not patch:
        return base_path
    ds = json.loads(base_path.read_text())
    for path, value in patch.items():
        node = ds
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                if len(path) > 1 and path[0] == "optimizer":
                    node = None
                    break
                node[part] = {}
            node = node[part]
        if node is not None:
            node[path[-1]] = value
    out = run_dir / f"ds_config.v{config_version}.json"
    out.write_text(json.dumps(ds, indent=1, sort_keys=True) + "\n")
    return out


def render_command(job: Any, *, run_dir: Path, attempt: int, config_version: int,
                   rollback_to_step: int | None = None, resume: Path | None | bool = True) -> list[str]:
    """The job's command with its placeholders filled in; copies the job's ds_config into the run dir once
    and hands the job the copy with remediation's changes applied (`patched_ds_config`). `resume`: the
    checkpoint the launch chose (core/job_checkpoints.py; None: none), True: pick it here (`resume_point`
    with the run's rollback bounds)."""
    run_dir = Path(run_dir)
    ds_config = run_dir / "ds_config.json"
    if job.ds_config and not ds_config.exists():
        shutil.copyfile(job.ds_config, ds_config)
    if job.ds_config:
        ds_config = patched_ds_config(run_dir, config_version)
    ckpt_root = checkpoint_root(job, run_dir)
    if not (attempt > 1 or job.resume_first):
        resume = None
    elif resume is True:
        chosen, _ = resume_point(watch_config(job, run_dir), RollbackBounds(run_dir), rollback_to_step)
        resume = chosen.path if chosen else None
    values = {"run_dir": str(run_dir), "attempt": str(attempt), "config_version": str(config_version),
              "ds_config": str(ds_config), "checkpoint_dir": str(ckpt_root), "resume": str(resume) if resume else ""}
    out: list[str] = []
    for arg in job.command:
        rendered = arg.format(**values)
        if rendered == "" and arg.strip():
            if arg == "{resume}" and out and out[-1].startswith("--"):
                out.pop()  # `--resume_from_checkpoint {resume}` with nothing to resume: drop both
            continue
        out.append(rendered)
    return out


def job_reach(job: Any, config: dict[str, Any]) -> Any:
    """What of remediation's changes reach this job (remediation/job.py): the built-in job takes all; a
    command job takes its ds_config's DeepSpeed keys (`train.lr` only when the file has an `optimizer`
    section: `patched_ds_config` invents none), launcher env vars, and control.json values unless its
    telemetry is read from its log/files (no client reads control.json then)."""
    import json

    from ulyssesd.daemon.telemetry.log_source import stdout_source
    from ulyssesd.remediation.job import BUILTIN, JobReach

    if getattr(job, "kind", "builtin") != "command":
        return BUILTIN
    keys = {"launcher.env."}
    if job.ds_config:
        keys |= set(DS_CONFIG_KEYS) | {_DS_PREFIX}
        try:
            ds = json.loads(Path(job.ds_config).read_text())
        except (OSError, ValueError):
            ds = None   # unreadable here: the launch says so; assume the optimizer section is there
        if isinstance(ds, dict) and not isinstance(ds.get("optimizer"), dict):
            keys.discard("train.lr")
        why = "a command job: only its ds_config's DeepSpeed keys and launcher env reach it"
    else:
        why = "a command job without [job] ds_config: only launcher env reaches it"
    hot: frozenset[str] | None = frozenset() if stdout_source(config) else None
    return JobReach(config_keys=frozenset(keys), hot_controls=hot, why_limited=why)
