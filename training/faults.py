"""Fault injection for tests, demos and chaos runs (off unless `[[faults]]` are configured).

Every rank evaluates every fault with the same deterministic rule (seeded per step), so rank 0 can write
the `fault_injected` event for a fault that another rank is about to act out - before it acts.
A fault fires only on its `attempts` (default: attempt 1 only), so a restarted job recovers.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .spec import FaultSpec

# torch's real text (docs/DEEPSPEED_NOTES.md); the numbers are plausible H100/A100 values.
CUDA_OOM_TEXT = ("CUDA out of memory. Tried to allocate {gib:.2f} GiB. GPU {gpu} has a total capacity of 79.18 GiB "
                 "of which 23.04 GiB is free. Including non-PyTorch memory, this process has 56.13 GiB memory in "
                 "use. Of the allocated memory 52.10 GiB is allocated by PyTorch, and 2.54 GiB is reserved by "
                 "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
                 "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")

_STEP_KINDS = ("raise", "sigkill", "hang", "slow_rank", "cuda_oom", "memory_spike")
_LOSS_KINDS = ("nan_loss", "loss_spike")
_DURATION_KINDS = ("loss_spike", "slow_rank", "memory_spike", "lr_spike")
_SAVE_KINDS = ("enospc_on_save", "corrupt_checkpoint")
# Act inside the real save path, on every file DeepSpeed's checkpoint engine writes, on EVERY rank: a full
# or read-only filesystem is shared by all ranks of a node (and by all nodes on a shared filesystem).
_WRITE_KINDS = ("disk_full", "read_only_fs")


class InjectedFault(RuntimeError):
    """Raised by the `raise` fault."""


class FaultInjector:
    """Consulted by the train loop at fixed points; `emit(fault_kind, step, **fields)` writes the event."""

    def __init__(self, faults: list[FaultSpec], rank: int, local_rank: int, attempt: int, seed: int,
                 device: torch.device, emit: Callable[..., None]):
        # `restarts`: the launcher's own restarts inside one attempt (torchrun --max-restarts, NVRx ft_launcher).
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        self.faults = [f for f in faults if attempt in (f.attempts if f.attempts is not None else [1])
                       and (f.restarts is None or restart in f.restarts)]
        self.rank, self.local_rank, self.seed, self.device, self.emit = rank, local_rank, seed, device, emit
        self._held: torch.Tensor | None = None
        self._held_until = -1
        self.extra_mem_gib = 0.0  # CPU: the simulated part of a memory spike, added to memory telemetry
        self._save_fired: set[int] = set()
        self._write_fault_step: dict[int, int] = {}  # write fault index -> the save step it fires on
        self.replayed_through = 0  # steps up to here are replays after an in-process restart (no fault again)

    def _rolls(self, idx: int, f: FaultSpec, step: int) -> bool:
        if f.probability >= 1.0:
            return True
        return random.Random(hash((self.seed, idx, step)) & 0xFFFFFFFF).random() < f.probability

    def _due(self, idx: int, f: FaultSpec, step: int) -> bool:
        if step <= self.replayed_through:
            return False   # a step replayed after an in-process restart: its faults already fired
        if f.at_step is None:
            return self._rolls(idx, f, step)
        if f.kind in _DURATION_KINDS:
            in_window = f.at_step <= step < f.at_step + f.steps
        else:
            in_window = step == f.at_step
        return in_window and self._rolls(idx, f, step)

    def _announce(self, f: FaultSpec, step: int | None, **extra) -> None:
        # Rank 0 writes for everybody (it alone owns the telemetry file).
        self.emit(f.kind, step, rank=f.rank, magnitude=f.magnitude, **extra)

    # ----------------------------------------------------------------------------- hook points
    def at_start(self) -> None:
        for f in self.faults:
            if f.kind == "exit_at_start":
                self._announce(f, None)
                if self.rank == f.rank:
                    raise InjectedFault("injected fault exit_at_start")

    def before_step(self, step: int) -> None:
        """Called on every rank before step `step` (1-based) computes anything."""
        if self._held is not None and step >= self._held_until:
            self._held, self.extra_mem_gib = None, 0.0
        for i, f in enumerate(self.faults):
            if f.kind not in _STEP_KINDS or not self._due(i, f, step):
                continue
            if f.kind in _DURATION_KINDS and f.at_step is not None and step != f.at_step:
                mine = self.rank == f.rank
                if f.kind == "slow_rank" and mine:
                    time.sleep(f.magnitude)
                continue  # announced once, at the window's first step
            self._announce(f, step)
            if self.rank != f.rank:
                continue
            if f.kind == "raise":
                raise InjectedFault(f"injected fault 'raise' at step {step}")
            if f.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "hang":
                while True:  # the other ranks block in the next collective; the daemon must notice
                    time.sleep(3600)
            if f.kind == "slow_rank":
                time.sleep(f.magnitude)
            if f.kind == "cuda_oom":
                raise torch.OutOfMemoryError(CUDA_OOM_TEXT.format(gib=f.magnitude, gpu=self.local_rank))
            if f.kind == "memory_spike":
                self._spike(f, step)

    def mid_step(self, step: int) -> None:
        """Called on every rank after the first micro-batch's forward (its ZeRO-3 all-gathers and Ulysses
        all-to-alls done), before its backward: `raise_mid_step` raises there on its rank while the others go
        on into the backward's collectives and wait for it."""
        for i, f in enumerate(self.faults):
            if f.kind == "raise_mid_step" and self._due(i, f, step):
                self._announce(f, step)
                if self.rank == f.rank:
                    raise InjectedFault(f"injected fault 'raise_mid_step' at step {step}")

    def _spike(self, f: FaultSpec, step: int) -> None:
        if self.device.type == "cuda":
            self._held = torch.ones(int(f.magnitude * (1 << 30)), dtype=torch.uint8, device=self.device)
        else:
            # A 2-core CI box cannot hold GiBs: hold magnitude MiB for real, report magnitude GiB.
            self._held = torch.ones(int(f.magnitude * (1 << 20)), dtype=torch.uint8)
            self.extra_mem_gib = f.magnitude
        self._held_until = (f.at_step if f.at_step is not None else step) + f.steps

    def loss_factor(self, step: int) -> float:
        """Factor on this rank's loss (reported AND backpropagated); 1.0 normally."""
        factor = 1.0
        for i, f in enumerate(self.faults):
            if f.kind not in _LOSS_KINDS or not self._due(i, f, step):
                continue
            if f.at_step is None or step == f.at_step:
                self._announce(f, step)
            if f.kind == "nan_loss":
                factor = float("nan")
            else:
                factor *= f.magnitude
        return factor

    def lr_factor(self, step: int) -> float:
        """Factor on the scheduled learning rate (`lr_spike`: a real blow-up, the optimizer's own doing);
        1.0 normally. Announced at the window's first step."""
        factor = 1.0
        for i, f in enumerate(self.faults):
            if f.kind != "lr_spike" or not self._due(i, f, step):
                continue
            if f.at_step is None or step == f.at_step:
                self._announce(f, step)
            factor *= f.magnitude
        return factor

    def before_save(self, step: int, tag_dir: Path) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "enospc_on_save" and self._save_due(i, f, step):
                self._announce(f, step, tag=tag_dir.name)
                if self.rank == f.rank:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tag_dir))

    def checkpoint_write(self, step: int, path: str, write: Callable[[], None]) -> None:
        """Every rank, for each file of the save at `step`: `write()` writes it for real.

        `disk_full`: the file is written, truncated to half (the part that fit), then OSError(ENOSPC) -
        a partial tag like a real full disk leaves. `read_only_fs`: OSError(EROFS), nothing written. Both
        fire on every write of the first save at or after `at_step`."""
        for i, f in enumerate(self.faults):
            if f.kind not in _WRITE_KINDS:
                continue
            if i not in self._write_fault_step and (step >= f.at_step if f.at_step is not None
                                                    else self._rolls(i, f, step)):
                self._write_fault_step[i] = step
                self._announce(f, step, tag=Path(path).parent.name)
            if self._write_fault_step.get(i) != step:
                continue
            if f.kind == "read_only_fs":
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            write()
            os.truncate(path, os.path.getsize(path) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write()

    def after_save(self, step: int, tag_dir: Path) -> None:
        """Called on every rank after the manifest is written (the corruption must defeat validation)."""
        for i, f in enumerate(self.faults):
            if f.kind == "corrupt_checkpoint" and self._save_due(i, f, step):
                target = corrupt_tag(tag_dir, f.corruption, dry_run=True)
                self._announce(f, step, tag=tag_dir.name, file=target.name, corruption=f.corruption)
                if self.rank == f.rank:
                    corrupt_tag(tag_dir, f.corruption)

    def _save_due(self, idx: int, f: FaultSpec, step: int) -> bool:
        # The first save at or after at_step (a save may not land exactly on it).
        if idx in self._save_fired:
            return False
        due = self._rolls(idx, f, step) if f.at_step is None else step >= f.at_step
        if due:
            self._save_fired.add(idx)
        return due


def corrupt_tag(tag_dir: Path, how: str, dry_run: bool = False) -> Path:
    """Damage the largest model/optimizer shard of a tag: truncate to half, or flip 64 bytes in the middle."""
    files = sorted((p for p in tag_dir.rglob("*.pt")), key=lambda p: (-p.stat().st_size, p.name))
    if not files:
        raise FileNotFoundError(f"no checkpoint shard to corrupt in {tag_dir}")
    target = files[0]
    if dry_run:
        return target
    size = target.stat().st_size
    if how == "truncate":
        os.truncate(target, size // 2)
    else:
        with open(target, "r+b") as fh:
            fh.seek(size // 2)
            chunk = fh.read(64)
            fh.seek(size // 2)
            fh.write(bytes(b ^ 0xFF for b in chunk))
    return target
