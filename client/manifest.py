"""Checkpoint manifests for ANY checkpoint directory (a DeepSpeed tag, an HF `checkpoint-500/`, a folder
of .pt files): `write_manifest` records every file's size and sha256 in `manifest.json`, written last and
atomically; `validate_manifest` says whether the directory is complete and intact.

One implementation: these are the helpers the built-in job and the daemon use
(`ulyssesd.training.checkpoint`, stdlib only, so importing them pulls in neither torch nor deepspeed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ulyssesd.training.checkpoint import (
    MANIFEST_NAME,
    ManifestError,
    read_manifest,
    validate_tag,
)
from ulyssesd.training.checkpoint import write_manifest as _write_manifest

__all__ = ["MANIFEST_NAME", "ManifestError", "read_manifest", "validate_manifest", "write_manifest"]


def write_manifest(checkpoint_dir: str | Path, step: int, *, loss: float | None = None, samples_seen: int = 0,
                   config_version: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash the directory's files and write its manifest. Call it LAST, once every rank's files are on disk
    (after the save returned on all ranks, e.g. after a barrier), from one process (rank 0)."""
    return _write_manifest(checkpoint_dir, step, loss, samples_seen, config_version, extra)


def validate_manifest(checkpoint_dir: str | Path, verify_checksums: bool = True) -> tuple[bool, str]:
    """(True, "ok") or (False, reason naming the file). verify_checksums=False checks sizes only (fast)."""
    return validate_tag(checkpoint_dir, verify_checksums)
