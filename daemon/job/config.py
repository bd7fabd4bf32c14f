"""Effective job configs: patching by dotted key, validating, and the control file (diffs: the store's `flat_diff`).

A config version is a `JobSpec` dumped to JSON (`{run_dir}/configs/v{N}.json`); remediation patches it by
dotted key (`train.gradient_clipping`, `data.skip_ranges`, ...). Every patched config is re-validated by
the job's own model before it is written, so the daemon can never launch a config the job would reject.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ulyssesd.client.contract import CONTROL_NAME, parse_control
from ulyssesd.training.durable import atomic_write_text
from ulyssesd.training.spec import JobSpec

_MISSING = object()


def get_dotted(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_dotted(cfg: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {key}: {part} is not a section")
    node[parts[-1]] = value


def apply_patch(cfg: dict[str, Any], patch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Apply {dotted: after | (before, after)}; returns (validated new config, diff {dotted: [before, after]})."""
    new = copy.deepcopy(cfg)
    diff: dict[str, list[Any]] = {}
    for key, val in patch.items():
        # A tuple is (before, after) as the remediation engine reports it; anything else is the new value.
        after = val[1] if isinstance(val, tuple) and len(val) == 2 else val
        before = get_dotted(new, key)
        if before == after:
            continue
        set_dotted(new, key, after)
        diff[key] = [before, after]
    validated = JobSpec.model_validate(new).model_dump(mode="json")
    return validated, diff


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as JSON at `path`, durably (training.durable: temp file, fsync, rename, directory fsync); a
    failed write (full disk) raises and leaves neither `path` changed nor its temp file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))


def read_control(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / CONTROL_NAME).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def write_control(run_dir: Path, *, lr_scale: float | None = None, gradient_clipping: float | None = None,
                  suspect: bool | None = None, dump_stacks: bool | None = None) -> dict[str, Any]:
    """Write control.json atomically with version+1: the fields of the job's contract
    (`ulyssesd.client.contract`, the same module the job parses it with); a field left None is dropped, i.e.
    "no change". A document the job would reject raises ValueError naming the field; nothing is written."""
    cur = read_control(run_dir)
    version = int(cur.get("version", 0)) + 1
    fields = {"lr_scale": lr_scale, "gradient_clipping": gradient_clipping, "suspect": suspect,
              "dump_stacks": dump_stacks}
    data = {"version": version, **{k: v for k, v in fields.items() if v is not None}}
    _, problem = parse_control(json.dumps(data))
    if problem is not None:
        raise ValueError(f"control.json v{version} would be rejected by the job: {problem}")
    write_json_atomic(run_dir / CONTROL_NAME, data)
    return data
