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


def newest_complete_checkpoint(root: Path, requires: list[str] | tuple[str, ...] = ()) -> Path | None:
    """The checkpoint directory a restart resumes from (see the module docstring); None when there is none."""
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
                valid.append((read_manifest(d)["step"], d.name, d))
        return max(valid)[2] if valid else None
    numbered = []
    for d in dirs:
        m = _NUMBER.search(d.name)
        if m and all((d / r).exists() for r in requires):
            numbered.append((int(m.group(1)), d.name, d))
    return max(numbered)[2] if numbered else None


def render_command(job: Any, *, run_dir: Path, attempt: int, config_version: int) -> list[str]:
    """The job's command with its placeholders filled in; copies the job's ds_config into the run dir once."""
    run_dir = Path(run_dir)
    ds_config = run_dir / "ds_config.json"
    if job.ds_config and not ds_config.exists():
        shutil.copyfile(job.ds_config, ds_config)
    ckpt_root = Path(job.checkpoint_dir) if job.checkpoint_dir else run_dir / "checkpoints"
    resume = newest_complete_checkpoint(ckpt_root, job.resume_requires) if attempt > 1 or job.resume_first else None
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
