"""Megatron-LM compatible indexed datasets: a `.bin` of token ids plus an `.idx` ("MMIDIDX") index.

The layout is the one `megatron/core/datasets/indexed_dataset.py` (and Megatron-DeepSpeed's
`MMapIndexedDataset`) reads and writes, so datasets preprocessed there load here and vice versa:

    .idx, all little-endian:
      9 bytes   magic b"MMIDIDX\\x00\\x00"
      u64       version = 1
      u8        dtype code of the .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
      u64       sequence count S
      u64       document count D (= number of documents + 1: the array starts with 0)
      int32[S]  sequence lengths (tokens)
      int64[S]  sequence pointers (byte offset of each sequence in the .bin)
      int64[D]  document indices: document k holds sequences [doc[k], doc[k+1])
      (int8[S]  sequence modes, multimodal datasets only: not supported here)
    .bin: the sequences' tokens back to back, in the dtype above.

Token dtype follows Megatron's rule: uint16 when the vocabulary has fewer than 65500 ids, else int32.
Here each document is written as one sequence (what Megatron's preprocess_data.py does without
--split-sentences); the reader accepts several sequences per document.

Writers create `<prefix>.bin.tmp-*` / `<prefix>.idx.tmp-*` and rename them into place, .bin first and the
.idx last, so a crash never leaves an .idx that vouches for a half-written .bin.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..durable import durable_replace

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
_CODE_OF = {dt.str: code for code, dt in DTYPE_CODES.items()}
_INTEGER_CODES = {1, 2, 3, 4, 5, 8}


class IndexedDatasetError(ValueError):
    """An indexed dataset is missing, truncated, or its .idx disagrees with its .bin."""


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 below 65500 ids, else int32."""
    return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")


def paths_of(prefix: str | Path) -> tuple[Path, Path]:
    p = str(prefix)
    for suffix in (".bin", ".idx"):
        if p.endswith(suffix):
            p = p[: -len(suffix)]
    return Path(p + ".bin"), Path(p + ".idx")


def encode_index(dtype: np.dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> bytes:
    """The .idx bytes for sequences of these lengths (pointers are their running byte offsets)."""
    dt = np.dtype(dtype).newbyteorder("<")
    if dt.str not in _CODE_OF:
        raise IndexedDatasetError(f"dtype {dt} has no MMIDIDX code")
    lengths = np.asarray(sequence_lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype="<i8")
    return b"".join([MAGIC, struct.pack("<Q", VERSION), struct.pack("<B", _CODE_OF[dt.str]),
                     struct.pack("<Q", len(lengths)), struct.pack("<Q", len(docs)),
                     lengths.tobytes(), pointers.tobytes(), docs.tobytes()])


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin`, then writes `<prefix>.idx` on `finalize()`.

    Use as a context manager: leaving it by an exception removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.bin_path, self.idx_path = paths_of(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.str not in _CODE_OF or DTYPE_CODES[_CODE_OF[self.dtype.str]].kind not in "iu":
            raise IndexedDatasetError(f"token dtype must be an integer MMIDIDX dtype, got {self.dtype}")
        self._limit = int(np.iinfo(self.dtype).max)
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self._bin_tmp.open("wb")
        self._lengths: list[int] = []
        self.tokens = 0
        self.max_id = -1

    def add_document(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size == 0:
            raise IndexedDatasetError(f"document {len(self._lengths)} is empty (0 tokens)")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > self._limit:
            raise IndexedDatasetError(f"document {len(self._lengths)}: token id {hi if hi > self._limit else lo} "
                                      f"does not fit {self.dtype.name}")
        self._fh.write(arr.astype(self.dtype).tobytes())
        self._lengths.append(int(arr.size))
        self.tokens += int(arr.size)
        self.max_id = max(self.max_id, hi)

    def add_dataset(self, prefix: str | Path) -> None:
        """Append every document of another indexed dataset of the same dtype (merging parts)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{other.bin_path}: dtype {other.dtype} differs from {self.dtype}")
        with other.bin_path.open("rb") as src:
            while chunk := src.read(16 << 20):
                self._fh.write(chunk)
        doc_lengths = np.add.reduceat(other.sequence_lengths, other.document_indices[:-1]) \
            if other.num_documents else np.zeros(0, dtype=np.int64)
        self._lengths.extend(int(x) for x in doc_lengths)
        self.tokens += other.num_tokens
        del other

    def finalize(self) -> None:
        self._fh.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        self._idx_tmp.write_bytes(encode_index(self.dtype, lengths, np.arange(len(lengths) + 1)))
        durable_replace(self._bin_tmp, self.bin_path)
        durable_replace(self._idx_tmp, self.idx_path)  # last: its presence means the pair is complete

    def abort(self) -> None:
        self._fh.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._fh.closed:
            self.finalize()


class IndexedDataset:
    """Read-only view of an existing `.bin` + `.idx` pair (ours or Megatron's), validated on open.

    `sequence(i)` is one sequence's tokens; `tokens` is the whole .bin as one flat memmap (the packed
    stream the sampler cuts into windows).
    """

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths_of(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise IndexedDatasetError(f"indexed dataset file not found: {p} (prefix {paths_of(prefix)[0].with_suffix('')})")
        raw = self.idx_path.read_bytes()
        where = str(self.idx_path)
        if len(raw) < HEADER_BYTES:
            raise IndexedDatasetError(f"{where}: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header "
                                      f"(truncated .idx)")
        if raw[:9] != MAGIC:
            raise IndexedDatasetError(f"{where}: magic {raw[:9]!r} is not {MAGIC!r} (not a Megatron MMIDIDX "
                                      f"index; the legacy 'cached'/'lazy' format is not supported)")
        (version,) = struct.unpack_from("<Q", raw, 9)
        if version != VERSION:
            raise IndexedDatasetError(f"{where}: index version {version}, only version {VERSION} is known")
        code = raw[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{where}: dtype code {code} is not one of {sorted(DTYPE_CODES)}")
        if code not in _INTEGER_CODES:
            raise IndexedDatasetError(f"{where}: dtype {DTYPE_CODES[code]} is not an integer token type")
        self.dtype = DTYPE_CODES[code]
        seq_count, doc_count = struct.unpack_from("<QQ", raw, 18)
        want = HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
        if len(raw) == want + seq_count:
            raise IndexedDatasetError(f"{where}: carries per-sequence modes (a multimodal dataset): not supported")
        if len(raw) != want:
            raise IndexedDatasetError(f"{where}: {len(raw)} bytes but a header of {seq_count} sequences and "
                                      f"{doc_count} document indices needs {want} (truncated or corrupt .idx)")
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(raw, dtype="<i4", count=seq_count, offset=off)
        off += 4 * seq_count
        self.sequence_pointers = np.frombuffer(raw, dtype="<i8", count=seq_count, offset=off)
        off += 8 * seq_count
        self.document_indices = np.frombuffer(raw, dtype="<i8", count=doc_count, offset=off)
        self._check_index(where)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        size = self.bin_path.stat().st_size
        expect = self.num_tokens * self.dtype.itemsize
        if size != expect:
            kind = "truncated .bin" if size < expect else ".bin longer than its index"
            raise IndexedDatasetError(f"{self.bin_path}: {size} bytes but {self.idx_path.name} describes "
                                      f"{self.num_tokens} tokens of {self.dtype.name} = {expect} bytes ({kind}; "
                                      f"the .idx disagrees with the .bin)")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)

    def _check_index(self, where: str) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if len(lengths) and int(lengths.min()) <= 0:
            i = int(np.flatnonzero(lengths <= 0)[0])
            raise IndexedDatasetError(f"{where}: sequence {i} has length {int(lengths[i])} (empty document; "
                                      f"preprocess with empty documents dropped)")
        expect = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expect[1:])
        if not np.array_equal(pointers, expect):
            i = int(np.flatnonzero(pointers != expect)[0])
            raise IndexedDatasetError(f"{where}: sequence {i} starts at byte {int(pointers[i])}, expected "
                                      f"{int(expect[i])} (sequences must be contiguous in the .bin)")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (len(docs) > 1 and np.any(np.diff(docs) < 0)):
            raise IndexedDatasetError(f"{where}: document indices must rise from 0 to the sequence count "
                                      f"{len(lengths)}; got first {docs[:1].tolist()} last {docs[-1:].tolist()}")
        if len(docs) > 1 and np.any(np.diff(docs) == 0):
            k = int(np.flatnonzero(np.diff(docs) == 0)[0])
            raise IndexedDatasetError(f"{where}: document {k} has no sequences (empty document)")

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return self.num_sequences

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[i])])

    def document(self, k: int) -> np.ndarray:
        lo, hi = int(self.document_indices[k]), int(self.document_indices[k + 1])
        start = int(self.sequence_pointers[lo]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[lo:hi].sum())])

    def document_starts(self) -> np.ndarray:
        """Token offset in the flat stream where each document begins."""
        first_seq = self.document_indices[:-1]
        return (self.sequence_pointers[first_seq] // self.dtype.itemsize).astype(np.int64) \
            if len(first_seq) else np.zeros(0, np.int64)

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.bin_path.with_suffix(''))!r}, dtype={self.dtype.name}, "
                f"documents={self.num_documents}, tokens={self.num_tokens})")
