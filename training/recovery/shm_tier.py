"""The host tier across processes: each rank's newest snapshot also kept in shared memory, for a relaunch.

    {shm}/ulyssesd-<run key>/rank<R>/<tag>/<DeepSpeed's relative paths>   the objects, torch.save'd
    {shm}/ulyssesd-<run key>/rank<R>/<tag>/manifest.json                  written last, then the directory renamed

`{shm}` is /dev/shm (ULYSSESD_SHM_DIR overrides it); the run key is a hash of the resolved run directory, so a
relaunch of the same run finds it and another run never does. After each snapshot's manifest (host_tier.py) a
background thread removes the rank's copies but the newest, writes the files into a hidden directory, the
manifest last, and renames it into place: a rank holds at most two complete copies, and since every rank
completed a copy before the next capture's collective, the ranks always share one tag; a
snapshot larger than `checkpoint.memory_shm_max_gib`, or one /dev/shm has no room for, is not copied (an event
says why). The manifest carries the host tier's per-file sizes and crc32s, the world size, and
`durable_step`: the newest durable tag's step when the snapshot was taken.

A relaunch (the Trainer's `_prefer_shm_copy`, collective) uses the newest tag every rank holds, only when the world is the
same, the daemon asked for `latest` (a rollback names its tag and is never overridden), the copy is newer than
the newest durable tag, and that tag is not older than the copy's `durable_step` (a rollback that set aside the
tags it grew from makes the copy part of an abandoned trajectory). Each rank then loads its files and recomputes
every crc32 against the manifest before anything is restored: a copy is never trusted without that check.
The owner cleans up: a run that completes removes its directory; each new copy removes the rank's older one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from .. import checkpoint as ckpt
from .host_tier import HostTier

log = logging.getLogger("ulyssesd.training")

#: Where the copies live (default /dev/shm).
SHM_DIR_ENV = "ULYSSESD_SHM_DIR"
MANIFEST = "manifest.json"
#: Room left free in the shared-memory file system after a copy (fraction of the copy's size).
HEADROOM = 0.1


def run_key(run_dir: Path) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def run_shm_dir(run_dir: Path) -> Path:
    return Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm") / f"ulyssesd-{run_key(run_dir)}"


def newest_durable_step(ckpt_dir: Path) -> int:
    """The step of the newest tag with a readable manifest (0: none)."""
    for tag in reversed(ckpt.list_tags(ckpt_dir) if Path(ckpt_dir).is_dir() else []):
        try:
            ckpt.read_manifest(Path(ckpt_dir) / tag)
        except (ckpt.ManifestError, OSError):
            continue
        return ckpt.step_of_tag(tag) or 0
    return 0


class ShmCopy:
    """One rank's copy of its host tier in shared memory (see the module docstring)."""

    def __init__(self, run_dir: Path, rank: int, world: int, max_bytes: int):
        self.root = run_shm_dir(run_dir) / f"rank{rank}"
        self.rank, self.world, self.max_bytes = rank, world, max_bytes
        self._thread: threading.Thread | None = None
        self.last: dict[str, Any] = {}   # the last publish's outcome (for the next snapshot's event)

    # ------------------------------------------------------------------------------- writing
    def publish_async(self, tier: HostTier, ckpt_dir: Path) -> float:
        """Start copying `tier` once its manifest is complete; returns the seconds waited for the previous copy
        (the tier's buffers are reused by the next capture: a copy in flight finishes first)."""
        waited = self.join()
        self._thread = threading.Thread(target=self._publish, args=(tier, ckpt_dir), daemon=True,
                                        name=f"host-tier-shm-{tier.tag}")
        self._thread.start()
        return waited

    def join(self) -> float:
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return time.perf_counter() - t0

    def _publish(self, tier: HostTier, ckpt_dir: Path) -> None:
        t0 = time.perf_counter()
        try:
            why = tier.restorable()
            self.last = {"tag": tier.tag, **self._write(tier, ckpt_dir)} if why is None else {"skipped": why}
        except Exception as exc:  # noqa: BLE001 - a failed copy only means a relaunch reads the disk
            log.warning("host tier copy to shared memory failed: %s", exc)
            self.last = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        self.last["seconds"] = round(time.perf_counter() - t0, 4)

    def _write(self, tier: HostTier, ckpt_dir: Path) -> dict[str, Any]:
        import torch

        assert tier.manifest is not None and tier.tag is not None
        size = tier.nbytes
        if size > self.max_bytes:
            return {"skipped": f"{size} bytes > checkpoint.memory_shm_max_gib ({self.max_bytes} bytes)"}
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < size * (1 + HEADROOM):
            return {"skipped": f"{self.root.parent.parent} has {free} bytes free, the copy needs {size}"}
        # Kept: the newest complete copy (every rank completed it before this capture's collective, so the
        # ranks always share one tag); gone: older ones and partial leftovers.
        complete = sorted(self.copies(), key=lambda m: m["step"])
        for old in self.root.iterdir():
            if not complete or old.name != complete[-1]["tag"]:
                shutil.rmtree(old, ignore_errors=True)
        partial = self.root / f".{tier.tag}.partial"
        for rel, obj in tier.files.items():
            path = partial / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, path)
        manifest = {**tier.manifest, "rank": self.rank, "world": self.world,
                    "durable_step": newest_durable_step(ckpt_dir)}
        (partial / MANIFEST).write_text(json.dumps(manifest))
        final = self.root / tier.tag
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        return {"bytes": size, "durable_step": manifest["durable_step"]}

    def clean(self) -> None:
        """Remove this rank's copies (the run completed), and the run's directory once it is empty."""
        self.join()
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            self.root.parent.rmdir()
        except OSError:
            pass   # another rank's copy is still there, or it is gone already

    # ------------------------------------------------------------------------------- reading
    def copies(self) -> list[dict[str, Any]]:
        """The manifests of this rank's complete copies (not yet verified)."""
        found: list[dict[str, Any]] = []
        for d in self.root.iterdir() if self.root.is_dir() else []:
            if d.name.startswith(".") or not (d / MANIFEST).is_file():
                continue
            try:
                m = json.loads((d / MANIFEST).read_text())
                if m.get("tag") == d.name and isinstance(m.get("step"), int) and isinstance(m.get("files"), dict):
                    found.append(m)
            except (OSError, ValueError) as exc:
                log.warning("shared-memory copy %s has an unreadable manifest: %s", d, exc)
        return found

    def load(self, manifest: dict[str, Any]) -> HostTier | str:
        """This rank's copy as a host tier, every file's size and crc32 recomputed against `manifest`; or why
        it cannot be used."""
        import torch

        tier = HostTier(self.rank)
        tag_dir = self.root / manifest["tag"]
        try:
            files = {rel: torch.load(tag_dir / rel, map_location="cpu", weights_only=False)
                     for rel in manifest["files"]}
        except Exception as exc:  # noqa: BLE001 - a missing or damaged file: the copy is not used
            return f"{tag_dir}: {type(exc).__name__}: {exc}"[:300]
        tier.tag, tier.step, tier.files = manifest["tag"], manifest["step"], files
        tier.meta = {k: manifest.get(k) for k in ("loss", "samples_seen", "world", "config_version")}
        tier.manifest = {k: v for k, v in manifest.items() if k not in ("rank", "world", "durable_step")}
        tier.manifest["files"] = manifest["files"]
        bad = tier.verify()
        return tier if bad is None else f"{tag_dir}: {bad}"


def summary(manifest: dict[str, Any]) -> tuple[str, int, Any, int]:
    """What `choose` compares of one copy: (tag, step, world, durable_step)."""
    return manifest["tag"], manifest["step"], manifest.get("world"), int(manifest.get("durable_step") or 0)


def choose(held: list[list[Any]], world: int, disk_step: int, load_setting: str) -> tuple[str | None, str | None]:
    """(tag to restore from shared memory or None, why not) from every rank's copies (`summary` of each): the
    newest tag every rank holds; the same answer on every rank."""
    if load_setting != "latest":
        return None, f"checkpoint.load={load_setting!r} names the tag to load (a rollback)"
    missing = [r for r, copies in enumerate(held) if not copies]
    if missing:
        return None, f"rank(s) {missing} hold no copy"
    common = set.intersection(*({tuple(c) for c in copies} for copies in held))
    if not common:
        return None, f"the ranks hold no snapshot in common: {[sorted(c[0] for c in copies) for copies in held]}"
    tag, step, copy_world, durable_step = max(common, key=lambda c: c[1])
    if copy_world != world:
        return None, f"{tag} was taken with {copy_world} ranks, this attempt has {world}"
    if step <= disk_step:
        return None, f"{tag} is not newer than the newest durable tag (step {disk_step})"
    if disk_step < durable_step:
        return None, (f"{tag} grew from a durable tag of step {durable_step}, newer than the newest one now "
                      f"(step {disk_step}): set aside by a rollback")
    return tag, None
