"""Live control (`{run_dir}/control.json`, CONTRACTS.md): hot lr scale / clip changes between steps.

Rank 0 reads the file, every rank receives the same parsed state through one broadcast_object_list,
and a version is applied exactly once. Missing file or key = no change; a garbage file is logged once
and ignored.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# SIGUSR1 stack dumps (CONTRACTS.md): each rank appends to its own file under `{run_dir}/stacks/`.
STACK_DUMP_DIR = "stacks"
_STACK_DUMP_RE = re.compile(r"^attempt-(\d+)-rank-(\d+)\.txt$")


def stack_dump_path(run_dir: Path, attempt: int, rank: int | str) -> Path:
    return run_dir / STACK_DUMP_DIR / f"attempt-{attempt}-rank-{rank}.txt"


def stack_dump_files(run_dir: Path, attempt: int) -> dict[int, Path]:
    """rank -> its dump file, for one attempt (what the daemon reads after SIGUSR1)."""
    out = {}
    for f in (run_dir / STACK_DUMP_DIR).glob(f"attempt-{attempt}-rank-*.txt"):
        m = _STACK_DUMP_RE.match(f.name)
        if m:
            out[int(m.group(2))] = f
    return dict(sorted(out.items()))


@dataclass
class ControlState:
    """The job's view of the daemon's live overrides."""

    version: int = -1
    lr_scale: float = 1.0
    gradient_clipping: float | None = None  # None = the config's value
    suspect: bool = False
    dump_stacks: bool = False


def parse_control(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """(fields, None) for a usable document, (None, reason) otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc}"
    if not isinstance(data, dict):
        return None, "top level is not an object"
    if not isinstance(data.get("version"), int) or isinstance(data.get("version"), bool):
        return None, f"'version' must be an integer, got {data.get('version')!r}"
    out: dict[str, Any] = {"version": data["version"]}
    for key, kind in (("lr_scale", (int, float)), ("gradient_clipping", (int, float)),
                      ("suspect", (bool,)), ("dump_stacks", (bool,))):
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if not isinstance(value, kind) or (kind != (bool,) and isinstance(value, bool)):
            return None, f"{key!r} has the wrong type: {value!r}"
        if key == "lr_scale" and not 0 < value <= 10:
            return None, f"lr_scale={value} outside (0, 10]"
        if key == "gradient_clipping" and value < 0:
            return None, f"gradient_clipping={value} is negative"
        out[key] = value
    return out, None


class ControlPoller:
    """Rank 0 reads control.json; `poll()` (a collective) returns the new fields once per version."""

    def __init__(self, path: str | Path | None, rank: int, world_size: int):
        self.path = Path(path) if path else None
        self.rank = rank
        self.world_size = world_size
        self.state = ControlState()
        self._bad_logged: str | None = None

    def _read(self) -> dict[str, Any] | None:
        if self.path is None:
            return None
        reason: str | None
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            reason = f"unreadable: {exc}"
        else:
            parsed, reason = parse_control(text)
            if parsed is not None:
                self._bad_logged = None
                return parsed if parsed["version"] > self.state.version else None
        if reason != self._bad_logged:
            log.warning("ignoring %s: %s", self.path, reason)
            self._bad_logged = reason
        return None

    def poll(self) -> dict[str, Any] | None:
        """Collective: every rank must call it at the same point. Returns the applied update or None."""
        update = self._read() if self.rank == 0 else None
        if self.world_size > 1:
            import torch.distributed as dist

            box = [update]
            dist.broadcast_object_list(box, src=0)
            update = box[0]
        if update is None:
            return None
        self.state.version = update["version"]
        for key in ("lr_scale", "gradient_clipping", "suspect", "dump_stacks"):
            if key in update:
                setattr(self.state, key, update[key])
        return update


def set_engine_clip(engine, value: float) -> None:
    """Change gradient clipping of a live engine: the engine's config (non-ZeRO path, `gradient_clipping()`)
    and the ZeRO optimizer's `clip_grad`, which stage 3 copies at init and reads in unscale_and_clip_grads."""
    engine._config.gradient_clipping = float(value)
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "clip_grad"):
        opt.clip_grad = float(value)


def engine_clip(engine) -> float:
    """The clip value ZeRO-3 will actually use on the next step."""
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "clip_grad"):
        return float(opt.clip_grad)
    return float(engine.gradient_clipping())
