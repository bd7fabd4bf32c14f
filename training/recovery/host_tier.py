"""The host-memory checkpoint tier: one rank's newest snapshot, kept in host memory as a restorable tag.

    tier.capture(engine, tag, step, meta)   # DeepSpeed's save_checkpoint, every file into host memory, no disk
    tier.verify()                            # its manifest's per-file sizes and crc32s, recomputed (None = good)
    with tier.serve(engine, ckpt_dir, tag, event): engine.load_checkpoint(ckpt_dir, tag=tag)   # from memory

A capture runs DeepSpeed's own `save_checkpoint` with the checkpoint engine's `save` answered by a copy into
host memory (`checkpoint.host_snapshot`) and its `makedirs` / the recovery-script copy turned off, so the tier
holds exactly the objects DeepSpeed would have written, under the same relative paths. A load is DeepSpeed's
own `load_checkpoint` with `load` answered by a clone of those objects (the optimizer may keep what it is
handed; the tier's copy must stay intact for the next restore) and the model-states file list taken from the
tier, not from a glob of the tag directory (which may not exist on disk: a memory-only snapshot).
The manifest ({tag, step, loss, samples_seen, config_version, files: {path: {bytes, crc32}}}) is computed in a
background thread after the capture (crc32 releases the GIL: a thread pool over the tensors); a snapshot is
restorable only once its manifest is complete, and `verify` recomputes it before every restore.
The previous snapshot is dropped when a capture starts: one snapshot's memory at a time, its host buffers of
device tensors reused by the next capture (pageable memory: a GPU capture is a synchronous device-to-host copy
into it; not yet the registered snapshot pool the async writer uses).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..checkpoint.snapshot import PinnedPool, _map_tensors, host_snapshot

log = logging.getLogger("ulyssesd.training")

#: Threads computing the manifest's crc32s (zlib releases the GIL on large buffers).
CRC_THREADS = 8
#: Largest piece one crc32 call covers (so a big tensor spreads over the threads).
CRC_PIECE_BYTES = 64 << 20


def _tensor_pieces(obj: Any) -> list[memoryview]:
    """Every tensor of `obj` as raw bytes, in a fixed walk order, split into pieces of <= CRC_PIECE_BYTES."""
    import torch

    pieces: list[memoryview] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.numel() == 0:
                return
            raw = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            for off in range(0, len(raw), CRC_PIECE_BYTES):
                pieces.append(raw[off:off + CRC_PIECE_BYTES])
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return pieces


def file_digest(obj: Any, pool: ThreadPoolExecutor) -> dict[str, int]:
    """{bytes, crc32}: the tensor bytes of one snapshot file and a crc32 over the per-piece crc32s (in order)."""
    pieces = _tensor_pieces(obj)
    crcs = list(pool.map(zlib.crc32, pieces))
    combined = zlib.crc32(b"".join(c.to_bytes(4, "little") for c in crcs))
    return {"bytes": sum(len(p) for p in pieces), "crc32": combined}


class HostTier:
    """One rank's host-memory checkpoint tier (see the module docstring)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.tag: str | None = None
        self.step = -1
        self.files: dict[str, Any] = {}           # relative path -> the host copy of what DeepSpeed saved
        self.manifest: dict[str, Any] | None = None   # set once the digests are computed (restorable)
        self.meta: dict[str, Any] = {}
        self.capture_s = 0.0    # seconds the last capture held training (the copy)
        self.digest_s = 0.0     # seconds its manifest took in the background
        self._digest_thread: threading.Thread | None = None
        self._digest_error: str | None = None
        self.hits = 0           # files served from memory by the last restore
        # Host buffers of device tensors, kept from one capture to the next (pageable: never the pinned
        # allocation that stalls a GPU for ~0.55 s per GiB); CPU tensors are copied into fresh memory.
        self._buffers = PinnedPool()
        self._taken: list[Any] = []

    # ------------------------------------------------------------------------------------ capture
    @property
    def nbytes(self) -> int:
        return sum(f["bytes"] for f in (self.manifest or {}).get("files", {}).values())

    def drop(self) -> None:
        """Forget the snapshot (waits for its digest thread first)."""
        self._join_digest(None)
        self.tag, self.step, self.files, self.manifest, self.meta = None, -1, {}, None, {}
        self._buffers.give_back(self._taken)   # the snapshot is gone: its buffers serve the next capture
        self._taken = []

    def capture(self, engine: Any, ckpt_dir: Path, tag: str, step: int, client_state: dict[str, Any],
                meta: dict[str, Any]) -> float:
        """Collective (DeepSpeed's save_checkpoint): replace the snapshot by `tag` at `step`. Returns the seconds
        training was held. The manifest follows in a background thread (`restorable` once done)."""
        self.drop()
        t0 = time.perf_counter()
        root = Path(ckpt_dir) / tag
        files: dict[str, Any] = {}
        ce = engine.checkpoint_engine

        def collect(state_dict: Any, path: str) -> None:
            files[Path(path).relative_to(root).as_posix()] = host_snapshot(state_dict, pin_memory=False,
                                                                           pool=self._buffers, taken=self._taken)

        ce.save = collect
        ce.makedirs = lambda *a, **k: None
        engine._copy_recovery_script = lambda save_path: None
        try:
            engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
        finally:
            del ce.save, ce.makedirs, engine._copy_recovery_script
        self.tag, self.step, self.files, self.meta = tag, step, files, dict(meta)
        self.capture_s = time.perf_counter() - t0
        self._digest_error = None
        self._digest_thread = threading.Thread(target=self._digest, name=f"host-tier-digest-{tag}", daemon=True)
        self._digest_thread.start()
        return self.capture_s

    def add_shared(self, shared: dict[str, Any]) -> None:
        """Files another rank captured that this rank also reads at load (DeepSpeed's model-states file is
        written by one rank and read by all); before the digest completes, so the manifest covers them."""
        self._join_digest(None)
        self.files.update({k: v for k, v in shared.items() if k not in self.files})
        self._digest_thread = threading.Thread(target=self._digest, name=f"host-tier-digest-{self.tag}",
                                               daemon=True)
        self._digest_thread.start()

    def _digest(self) -> None:
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="host-tier-crc") as pool:
                digests = {rel: file_digest(obj, pool) for rel, obj in sorted(self.files.items())}
            self.manifest = {"tag": self.tag, "step": self.step, **self.meta, "files": digests}
        except Exception as exc:  # noqa: BLE001 - a snapshot without a manifest is simply not restorable
            self._digest_error = f"{type(exc).__name__}: {exc}"
            self.manifest = None
        self.digest_s = time.perf_counter() - t0

    def _join_digest(self, timeout_s: float | None) -> bool:
        if self._digest_thread is not None:
            self._digest_thread.join(timeout_s)
            if self._digest_thread.is_alive():
                return False
            self._digest_thread = None
        return True

    # ------------------------------------------------------------------------------------ restore
    def restorable(self, timeout_s: float = 60.0) -> str | None:
        """None when a snapshot with a complete manifest is held, else why not (waits for the digest, bounded)."""
        if self.tag is None:
            return "no snapshot in host memory"
        if not self._join_digest(timeout_s):
            return f"the manifest of {self.tag} was not complete after {timeout_s:g} s"
        if self.manifest is None:
            return f"the manifest of {self.tag} failed: {self._digest_error}"
        return None

    def verify(self) -> str | None:
        """Recompute every file's size and crc32 against the manifest; None when they all match."""
        why = self.restorable()
        if why is not None:
            return why
        assert self.manifest is not None
        with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="host-tier-crc") as pool:
            for rel, want in self.manifest["files"].items():
                obj = self.files.get(rel)
                if obj is None:
                    return f"{self.tag}/{rel} is in the manifest but not in memory"
                got = file_digest(obj, pool)
                if got != want:
                    return f"{self.tag}/{rel} changed in memory: {got} != manifest {want}"
        return None

    def model_state_files(self, engine: Any, ckpt_dir: Path, tag: str, names: Any = None) -> list[str]:
        """The model-states files DeepSpeed's load globs for on this rank (`_get_all_ckpt_names`), matched
        against `names` (absolute paths; default: the tier's own files) instead of the directory."""
        pattern = engine._get_ckpt_name(str(ckpt_dir), tag, mp_placeholder="*")
        root = Path(ckpt_dir) / tag
        have = names if names is not None else [str(root / rel) for rel in self.files]
        return sorted(p for p in have if fnmatch.fnmatchcase(p, pattern))

    @contextlib.contextmanager
    def serve(self, engine: Any, ckpt_dir: Path, tag: str, event: Callable[..., None]) -> Iterator[None]:
        """While DeepSpeed loads `tag`, every file it asks for comes from memory (a clone: the optimizer may
        keep what it is handed). A file the tier lacks raises: a memory restore never reads the disk."""
        if tag != self.tag:
            raise RuntimeError(f"host tier holds {self.tag}, not {tag}")
        root = Path(ckpt_dir) / tag
        ce = engine.checkpoint_engine
        self.hits = 0

        def load(path: str, map_location: Any = None) -> Any:
            rel = Path(path).relative_to(root).as_posix()
            obj = self.files.get(rel)
            if obj is None:
                raise FileNotFoundError(f"{tag}/{rel} is not in the host tier (have {sorted(self.files)})")
            self.hits += 1
            return _map_tensors(obj, lambda t: t.clone())

        model_files = self.model_state_files(engine, ckpt_dir, tag)
        from deepspeed.runtime import state_dict_factory as sdf  # its loader asserts the file exists on disk

        real_os = sdf.os
        ce.load = load
        engine._get_all_ckpt_names = lambda checkpoints_path, tag: model_files
        sdf.os = _OsWithFiles(set(model_files))  # type: ignore[assignment]
        try:
            yield
        finally:
            sdf.os = real_os
            del ce.load, engine._get_all_ckpt_names


class _OsWithFiles:
    """`os` for DeepSpeed's state-dict loader, whose `os.path.exists` also says yes for the tier's files."""

    def __init__(self, files: set[str]):
        self.path = _PathWithFiles(files)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _PathWithFiles:
    def __init__(self, files: set[str]):
        self.files = files

    def exists(self, path: Any) -> bool:
        return str(path) in self.files or os.path.exists(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(os.path, name)
