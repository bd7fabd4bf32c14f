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
{resume} = the newest complete checkpoint under checkpoint_dir: with manifests (ulyssesd.client), the
highest step whose manifest validates (sizes); without, the directory with the highest number in its name
(checkpoint-500, global_step100, step-00000010) that holds every file of `resume_requires`.
"""

from __future__ import annotations

import re
import shutil
import string
from pathlib import Path
from typing import Any

PLACEHOLDERS = ("run_dir", "attempt", "config_version", "ds_config", "checkpoint_dir", "resume")
_NUMBER = re.compile(r"(\d+)(?!.*\d)")


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


def newest_complete_checkpoint(root: Path, requires: list[str] | tuple[str, ...] = (),
                               max_step: int | None = None) -> Path | None:
    """The checkpoint directory a restart resumes from (see the module docstring); None when there is none.
    `max_step`: a rollback's bound (the newest complete checkpoint at or before that step)."""
    from ulyssesd.client.manifest import MANIFEST_NAME, read_manifest, validate_manifest

    try:
        dirs = [d for d in Path(root).iterdir() if d.is_dir() and ".corrupt-" not in d.name]
    except OSError:
        return None
    with_manifest = [d for d in dirs if (d / MANIFEST_NAME).exists()]
    if with_manifest:
        valid = []
        for d in with_manifest:
            if validate_manifest(d, verify_checksums=False)[0]:
                step = read_manifest(d)["step"]
                if max_step is None or step <= max_step:
                    valid.append((step, d.name, d))
        return max(valid)[2] if valid else None
    numbered = []
    for d in dirs:
        m = _NUMBER.search(d.name)
        if m and all((d / r).exists() for r in requires) and (max_step is None or int(m.group(1)) <= max_step):
            numbered.append((int(m.group(1)), d.name, d))
    return max(numbered)[2] if numbered else None


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
                   rollback_to_step: int | None = None) -> list[str]:
    """The job's command with its placeholders filled in; copies the job's ds_config into the run dir once
    and hands the job the copy with remediation's changes applied (`patched_ds_config`)."""
    run_dir = Path(run_dir)
    ds_config = run_dir / "ds_config.json"
    if job.ds_config and not ds_config.exists():
        shutil.copyfile(job.ds_config, ds_config)
    if job.ds_config:
        ds_config = patched_ds_config(run_dir, config_version)
    ckpt_root = Path(job.checkpoint_dir) if job.checkpoint_dir else run_dir / "checkpoints"
    resume = (newest_complete_checkpoint(ckpt_root, job.resume_requires, rollback_to_step)
              if attempt > 1 or job.resume_first else None)
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
