"""How a shard's bytes are digested: the writer's digest mode (`ULYSSESD_CKPT_DIGEST`), the v3 manifest's file
digest derived from the chunk digests (`chunk_list_sha256`), and `StreamCheck`, which checks bytes read in order
against a manifest entry (per chunk where it has chunk digests). Stdlib only (the daemon imports it)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

#: Env switch of the background writer's digests, so both can be measured in one run:
#: "chunks" (default): one sha256 per chunk, taken by a pool of threads; each byte is hashed once and the
#: manifest's file digest is `chunk_list_sha256`. "whole": also the whole-file sha256, in one serial stream
#: (the writer of manifest v2, capped at one core's hash speed).
DIGEST_MODE_ENV = "ULYSSESD_CKPT_DIGEST"
DIGEST_MODES = ("chunks", "whole")


def digest_mode() -> str:
    """The writer's digest mode from ULYSSESD_CKPT_DIGEST ("chunks" when unset); ValueError names a bad value."""
    mode = os.environ.get(DIGEST_MODE_ENV, "").strip().lower() or "chunks"
    if mode not in DIGEST_MODES:
        raise ValueError(f"{DIGEST_MODE_ENV}={os.environ[DIGEST_MODE_ENV]!r}: expected one of {', '.join(DIGEST_MODES)}")
    return mode


def chunk_list_sha256(chunk_hex: list[str]) -> str:
    """A v3 manifest's file digest: sha256 over the ordered raw 32-byte chunk digests (not `sha256sum` of the
    file: a byte changed in any chunk changes its chunk digest, hence this one)."""
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunk_hex)).hexdigest()


class StreamCheck:
    """Checks one file's bytes, fed in order (`update`), against its manifest entry: chunk by chunk when the
    entry has `chunk_sha256` (a bad chunk shows as soon as it is read: `failed`), else the whole-file sha256.
    `matches()` once every byte was fed (the caller checks the size)."""

    def __init__(self, meta: dict[str, Any]):
        chunks = meta.get("chunk_sha256")
        self._chunks: list[str] | None = list(chunks) if isinstance(chunks, list) else None
        self._chunk_bytes = int(meta["chunk_bytes"]) if self._chunks is not None else 0
        if self._chunks is not None and self._chunk_bytes < 1:  # a chunk always full: update() would spin
            raise ValueError(f"manifest entry's chunk_bytes must be >= 1, got {meta['chunk_bytes']!r}")
        self._sha256 = meta.get("sha256")
        self._h = hashlib.sha256()
        self._filled = self._done = 0
        self.failed = False

    def update(self, data: Any) -> None:
        if self._chunks is None:
            self._h.update(data)
            return
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self._chunk_bytes - self._filled)
            self._h.update(view[:take])
            self._filled, view = self._filled + take, view[take:]
            if self._filled == self._chunk_bytes:
                self._end_chunk()

    def _end_chunk(self) -> None:
        k, got = self._done, self._h.hexdigest()
        assert self._chunks is not None
        self.failed = self.failed or k >= len(self._chunks) or got != self._chunks[k]
        self._done, self._filled, self._h = k + 1, 0, hashlib.sha256()

    def matches(self) -> bool:
        if self._chunks is None:
            return self._h.hexdigest() == self._sha256
        if self._filled:
            self._end_chunk()
        return not self.failed and self._done == len(self._chunks)
