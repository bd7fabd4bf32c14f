"""Resume a ZeRO-3 tag at another world size: DeepSpeed's universal checkpoint, made once per tag.

A ZeRO-3 tag holds one optimizer/parameter partition per rank (`zero_pp_rank_R_mp_rank_00_optim_states.pt`), and
DeepSpeed refuses to load it on another number of ranks ("The checkpoint being loaded used a DP world size of 3
but the current world size is 2"). When a run continues on fewer nodes (or grows back), rank 0 converts the tag
with DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`: every parameter's fp32 master and
Adam moments consolidated, one folder per parameter) and every rank loads it with `load_universal_checkpoint`,
which re-partitions for the new world size. Weights, Adam moments and step counts carry over; the client state
(step, data cursor, loss) comes from rank 0's model-states file.

Layout, beside the tags (not a tag: retention counts it as "other" and never loads it as one):

    {ckpt_dir}/.universal/step-00000100/      the converted tag (zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt, ...)
    {ckpt_dir}/.universal/step-00000100/source.json   written LAST: the source tag, its world size and manifest
                                                      digest; a conversion without it (a crash) is redone

Only the conversion in use is kept: converting a tag removes the older ones, and a resume that needs none removes
them all (derived data; the source tags stay where retention keeps them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import MANIFEST_NAME

#: The folder under the checkpoint directory that holds converted (universal) tags.
UNIVERSAL_DIR = ".universal"
#: Written last into a finished conversion.
SOURCE_NAME = "source.json"
#: How long the converter may run (a large model's conversion reads and writes every shard once).
CONVERT_TIMEOUT_S = 6 * 3600.0

_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class ReshardError(RuntimeError):
    """A tag could not be converted for another world size (the message names the tag and the cause)."""


@dataclass(frozen=True)
class Resharded:
    """A converted tag ready for `load_checkpoint(load_dir, tag)` with DeepSpeed's universal loader."""

    load_dir: Path       # the folder to pass as load_dir ({ckpt_dir}/.universal)
    tag: str             # the tag name inside it (the source tag's name)
    from_world: int      # ranks that saved the source tag
    seconds: float       # conversion time (0 when an earlier conversion was reused)
    reused: bool


def saved_world_size(tag_dir: str | Path) -> int | None:
    """How many ranks saved a ZeRO tag: its optimizer partitions (one per rank of the ZeRO group, DP × SP);
    None when the tag has none (not a ZeRO-3 tag, or unreadable)."""
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return None
    ranks = {int(m.group(1)) for n in names if (m := _OPTIM_RE.match(n))}
    return len(ranks) or None


def needs_reshard(tag_dir: str | Path, world: int) -> int | None:
    """The tag's world size when it differs from `world` (so it must be converted), else None."""
    saved = saved_world_size(tag_dir)
    return saved if saved is not None and saved != world else None


def _manifest_digest(tag_dir: Path) -> str:
    try:
        return hashlib.sha256((tag_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError as exc:
        raise ReshardError(f"{tag_dir.name}: its manifest cannot be read ({exc}); only a valid tag is converted") \
            from None


def _finished(out: Path, source_digest: str) -> bool:
    try:
        meta = json.loads((out / SOURCE_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("manifest_sha256") == source_digest


def convert(ckpt_dir: str | Path, tag: str, *, workers: int = 1, timeout_s: float = CONVERT_TIMEOUT_S,
            python: str | None = None) -> Resharded:
    """Rank 0: the universal form of `tag` (converted now, or an earlier finished conversion of the same tag
    contents reused). Raises ReshardError with the converter's last output lines when it fails."""
    root = Path(ckpt_dir)
    src = root / tag
    from_world = saved_world_size(src)
    if from_world is None:
        raise ReshardError(f"{src}: no ZeRO optimizer partitions (zero_pp_rank_*_optim_states.pt); only a ZeRO "
                           "checkpoint can be resumed at another world size")
    digest = _manifest_digest(src)
    base = root / UNIVERSAL_DIR
    out = base / tag
    if _finished(out, digest):
        return Resharded(base, tag, from_world, 0.0, True)
    base.mkdir(parents=True, exist_ok=True)
    for old in base.iterdir():  # derived data: only the conversion in use is kept
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    t0 = time.time()
    cmd = [python or sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
           "--output_folder", str(out), "--num_extract_workers", str(max(1, workers)),
           "--num_merge_workers", str(max(1, workers // 2))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ReshardError(f"converting {tag} to a universal checkpoint took over {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise ReshardError(f"converting {tag} (saved by {from_world} ranks) to a universal checkpoint failed "
                           f"(exit {done.returncode}): {tail}")
    (base / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; tags are always named here
    meta = {"source_tag": tag, "from_world": from_world, "manifest_sha256": digest,
            "converter": "deepspeed.checkpoint.ds_to_universal", "seconds": round(time.time() - t0, 3)}
    tmp = out / f".{SOURCE_NAME}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / SOURCE_NAME)
    return Resharded(base, tag, from_world, time.time() - t0, False)


def default_workers() -> int:
    """Converter processes: half the cores (the other ranks of this node wait meanwhile), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def agree_on_reshard(dist: Any, rank: int, ckpt_dir: str | Path, tag: str, world: int) -> Resharded | None:
    """Collective: rank 0 checks how many ranks saved `tag` and, when that is not `world`, converts it; every
    rank gets the same answer (None: load the tag as it is) or the same ReshardError."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            if needs_reshard(Path(ckpt_dir) / tag, world) is not None:
                box[0] = convert(ckpt_dir, tag, workers=default_workers())
            else:  # a conversion made for an earlier resize is derived data nobody loads any more
                shutil.rmtree(Path(ckpt_dir) / UNIVERSAL_DIR, ignore_errors=True)
        except ReshardError as exc:
            box[0] = str(exc)
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ReshardError(box[0])
    return box[0]


@contextlib.contextmanager
def universal_load(engine: Any, on: bool) -> Iterator[None]:
    """DeepSpeed reads `checkpoint.load_universal` from its config at load time only: switched on for this load
    (the converted tag), off again after, so the run's own later saves and loads are the usual per-rank ones."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = bool(on) or before
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
