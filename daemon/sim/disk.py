"""The simulated checkpoint disk: a capacity in bytes over the run's real checkpoint files, and a read-only flag.

Free space is the capacity minus the bytes under the checkpoint directory (the files are real and small; the
simulation scales the disk, not the files). The daemon and the job read the disk only through the checkpoint
package's seams, `ck.bytes_free` and `ck.filesystem_errno`, which `SimDisk.patched()` replaces for the run.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ulyssesd.training.checkpoint.retention import tree_bytes


@dataclass
class SimDisk:
    """One filesystem holding the checkpoint directory."""

    root: Path  # the checkpoint directory (the only thing on this disk)
    capacity_bytes: int  # the filesystem's size
    read_only: bool = False  # remounted read-only (EROFS on every write)
    external_bytes: int = 0  # what others wrote on this filesystem (a disk-fill fault)

    def used(self) -> int:
        return tree_bytes(self.root)

    def free(self) -> int:
        return max(0, self.capacity_bytes - self.external_bytes - self.used())

    def write_error(self, nbytes: int) -> int | None:
        """The errno a write of `nbytes` more bytes fails with, or None when it fits."""
        if self.read_only:
            return errno.EROFS
        return errno.ENOSPC if nbytes > self.free() else None

    @contextlib.contextmanager
    def patched(self) -> Iterator[SimDisk]:
        """The checkpoint package's free-space and read-only seams answer from this disk while the block runs."""
        from ulyssesd.training import checkpoint as ck

        saved = ck.bytes_free, ck.filesystem_errno

        def bytes_free(path: str | Path) -> int | None:
            return self.free() if _under(Path(path), self.root) else saved[0](path)

        def filesystem_errno(path: str | Path) -> int | None:
            if _under(Path(path), self.root):
                return errno.EROFS if self.read_only else None
            return saved[1](path)

        ck.bytes_free, ck.filesystem_errno = bytes_free, filesystem_errno  # type: ignore[assignment]
        try:
            yield self
        finally:
            ck.bytes_free, ck.filesystem_errno = saved  # type: ignore[assignment]


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False
