"""Live control for any job: poll `{run_dir}/control.json` between steps and apply what the daemon asks.

`ControlPoller` is the wire part: rank 0 reads the file, every rank receives the same parsed update through
one `broadcast_object_list` (so all ranks switch at the same step), a version is applied exactly once,
a missing file or key means no change and a garbage file is logged once and ignored.
`Control` adds the application to a target: a DeepSpeed engine (lr scale on its optimizer's param groups,
clipping through the ZeRO optimizer's `clip_grad`) or a plain torch optimizer (lr scale; the clip value is
read by the caller through `Control.clip(default)`), and reports `control_applied` to a Reporter.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ulyssesd.client.contract import CONTROL_NAME, ControlState, env_rank, env_run_dir, parse_control

log = logging.getLogger("ulyssesd.client")


def _dist_world() -> int:
    """World size of an initialized torch.distributed group, without importing torch when it is absent."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


class ControlPoller:
    """Rank 0 reads control.json; `poll()` (a collective when world_size > 1) returns new fields once per
    version."""

    def __init__(self, path: str | Path | None, rank: int, world_size: int):
        self.path = Path(path) if path else None
        self.rank = rank
        self.world_size = world_size
        self.state = ControlState()
        self._bad_logged: str | None = None
        self._stamp: tuple[int, int, int] | None = None  # (inode, size, mtime) of the last file read

    def _read(self) -> dict[str, Any] | None:
        if self.path is None:
            return None
        reason: str | None
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return None  # unchanged since the last read: one stat per step, no read/parse
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            reason = f"unreadable: {exc}"
        else:
            self._stamp = stamp
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


def set_engine_clip(engine: Any, value: float) -> None:
    """Change gradient clipping of a live DeepSpeed engine: the engine's config (non-ZeRO path,
    `gradient_clipping()`) and the ZeRO optimizer's `clip_grad`, which stage 3 copies at init and reads in
    unscale_and_clip_grads."""
    engine._config.gradient_clipping = float(value)
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "clip_grad"):
        opt.clip_grad = float(value)


def engine_clip(engine: Any) -> float:
    """The clip value a DeepSpeed engine (ZeRO or not) will actually use on the next step."""
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "clip_grad"):
        return float(opt.clip_grad)
    return float(engine.gradient_clipping())


def _is_engine(target: Any) -> bool:
    return hasattr(target, "_config") and hasattr(target, "gradient_clipping") and hasattr(target, "optimizer")


class Control:
    """Apply control.json to a DeepSpeed engine or a torch optimizer; call `poll()` once per step, on every
    rank, before the optimizer step (after your LR scheduler has set this step's LR).

    lr_scale: each param group's LR is multiplied by the scale; an LR your scheduler rewrote since the last
    poll is scaled again, one we set is left alone, so the scale is absolute w.r.t. the scheduled LR for
    schedulers that compute the LR from their base (LambdaLR, OneCycle, cosine, DeepSpeed's). A chainable
    scheduler (new LR = current LR × factor) would compound the scale at each of its changes.
    """

    def __init__(self, target: Any = None, path: str | Path | None = None, *, reporter: Any = None,
                 rank: int | None = None, world_size: int | None = None):
        self.target = target
        self.path = Path(path) if path is not None else env_run_dir() / CONTROL_NAME
        rank = env_rank() if rank is None else rank
        if world_size is None:  # an initialized process group decides; the launcher's WORLD_SIZE alone does not
            world_size = _dist_world()
        self.poller = ControlPoller(self.path, rank, world_size)
        self.reporter = reporter
        self._set_lrs: list[Any] | None = None  # the LR of each param group as we last left it
        self._scheduled: list[Any] = []  # the unscaled LR behind each of those

    @property
    def state(self) -> ControlState:
        return self.poller.state

    @property
    def suspect(self) -> bool:
        """The daemon marked the current weights bad: do not save them on SIGTERM."""
        return self.poller.state.suspect

    def clip(self, default: float) -> float:
        """The clip value to use now: the daemon's override, else your `default`."""
        gc = self.poller.state.gradient_clipping
        return default if gc is None else gc

    def _param_groups(self) -> list[dict[str, Any]]:
        target = self.target
        if target is None:
            return []
        opt = getattr(target, "optimizer", None) if _is_engine(target) else target
        return list(getattr(opt, "param_groups", []) or [])

    def _apply_lr_scale(self) -> None:
        """LR of each group = scheduled LR × scale. The scheduled LR is the group's LR unless it still holds
        the value we wrote last time (the scheduler did not touch it), then it is the one we scaled."""
        scale = self.poller.state.lr_scale
        if scale == 1.0 and self._set_lrs is None:
            return
        groups = self._param_groups()
        if self._set_lrs is None or len(self._set_lrs) != len(groups):
            self._set_lrs = [None] * len(groups)
            self._scheduled = [None] * len(groups)
        for i, group in enumerate(groups):
            cur = group["lr"]
            scheduled = self._scheduled[i] if cur == self._set_lrs[i] else cur
            group["lr"] = scheduled * scale
            self._scheduled[i] = scheduled
            self._set_lrs[i] = group["lr"]

    def poll(self, step: int | None = None) -> dict[str, Any] | None:
        """Read (rank 0) and share (all ranks) a new control.json version; apply it. Returns the update."""
        update = self.poller.poll()
        st = self.poller.state
        self._apply_lr_scale()  # every step: the scheduler may have set a new LR since the last one
        if update is None:
            return None
        if "gradient_clipping" in update and _is_engine(self.target):
            set_engine_clip(self.target, update["gradient_clipping"])
        if update.get("dump_stacks"):
            faulthandler.dump_traceback(all_threads=True)
        clip = engine_clip(self.target) if _is_engine(self.target) else st.gradient_clipping
        if self.reporter is not None:
            self.reporter.event("control_applied", step, control_version=st.version, lr_scale=st.lr_scale,
                                gradient_clipping=clip, suspect=st.suspect)
        log.info("control.json v%d applied: lr_scale=%s gradient_clipping=%s suspect=%s", st.version,
                 st.lr_scale, clip, st.suspect)
        return update
