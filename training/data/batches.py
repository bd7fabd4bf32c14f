"""Training data: sample sources, the data cursor, per-step index assignment and Ulysses slicing.

The order of samples is a pure function of (seed, global sample index): there is no iterator state to
save besides the cursor (`next_sample` + `skip_ranges`), so a resumed or rolled-back run reads exactly the
samples it would have read, and rollback-and-skip can exclude any range of samples.

Index layout of one optimizer step (all ranks compute the same thing from the same cursor):
the step takes the next `dp_size * micro_batch * grad_accum` non-skipped global indices in increasing
order; micro-step m of DP rank r gets block `m * dp_size + r` of `micro_batch` indices. SP ranks of one DP
group call with the same dp_rank and so read the same samples, then take their slice (`slice_for_sp`).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ulyssesd.training.spec import DataSpec

from .blend import BlendSchedule
from .indexed_dataset import IndexedDataset, IndexedDatasetError
from .order import MASK64, key_of, permute_index

__all__ = ["DataCursor", "DataError", "SampleSource", "batch_indices", "cursor_for", "normalize_ranges",
           "permute_index", "slice_for_sp"]

_TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}


class DataError(ValueError):
    """A data file is missing, malformed or holds tokens outside the model's vocabulary."""


# ------------------------------------------------------------------------------------- sources
class _Windows:
    """Windows of seq_len+1 tokens at stride seq_len over one flat token stream, shuffled per epoch.

    Neighbouring windows share one boundary token (its label), so every token is a target exactly once per
    epoch. Each epoch is a fresh keyed permutation of the windows.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, key: tuple[int, ...], where: str):
        self.tokens, self.seq_len, self.key, self.where = tokens, seq_len, key, where
        if len(tokens) < seq_len + 1:
            raise DataError(f"{where}: holds {len(tokens)} tokens ({tokens.dtype.name}) but one sample needs "
                            f"seq_len+1 = {seq_len + 1}")
        self.num_windows = (len(tokens) - 1) // seq_len

    def window_of(self, local_index: int) -> int:
        epoch, pos = divmod(local_index, self.num_windows)
        return permute_index(pos, self.num_windows, key_of(*self.key[:1], epoch, *self.key[1:], 0x5EED))

    def read(self, local_index: int, vocab_size: int, global_index: int) -> np.ndarray:
        start = self.window_of(local_index) * self.seq_len
        window = np.asarray(self.tokens[start:start + self.seq_len + 1])
        bad = np.flatnonzero((window >= vocab_size) | (window < 0)) if window.dtype.kind == "i" \
            else np.flatnonzero(window >= vocab_size)
        if bad.size:
            off = start + int(bad[0])
            raise DataError(
                f"{self.where}: token {int(window[bad[0]])} at token offset {off} (byte offset "
                f"{off * window.dtype.itemsize}) is outside the model vocabulary [0, {vocab_size}) "
                f"(sample {global_index}; wrong token_dtype or a tokenizer larger than model.vocab_size?)")
        return window


class SampleSource:
    """Returns sample `global_index` as a LongTensor of seq_len + 1 tokens (inputs + shifted labels).

    Kinds: `synthetic` (learnable mixture of patterns), `text` (a byte-level file, vocabulary 256),
    `tokens` (a flat, header-free uint16/uint32 file) and `indexed` (Megatron .bin/.idx datasets, one or a
    weighted blend, packed to seq_len: documents are EOS-separated and a window may span several). The
    order seed is `spec.seed`, else `seed`.
    """

    def __init__(self, spec: DataSpec, seq_len: int, vocab_size: int, seed: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.spec = spec
        self.kind = spec.kind
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = spec.seed if spec.seed is not None else seed
        self.path: Path | None = Path(spec.path) if spec.path and self.kind != "synthetic" else None
        self.components: list[tuple[str, _Windows]] = []
        self.schedule: BlendSchedule | None = None
        if self.kind == "synthetic":
            self._synthetic = _SyntheticPatterns(self.seed, vocab_size)
        elif self.kind in ("text", "tokens", "indexed"):
            self._open()
        else:  # pragma: no cover - DataSpec's Literal prevents it
            raise ValueError(f"unknown data kind {self.kind!r}")

    def _open(self) -> None:
        spec = self.spec
        if spec.tokenizer:
            _check_tokenizer_file(spec.tokenizer, self.vocab_size)
        if self.kind in ("text", "tokens"):
            # Token files are little-endian (what the converter writes), independent of the host's byte order.
            dtype = np.dtype("uint8") if self.kind == "text" else np.dtype(_TOKEN_DTYPES[spec.token_dtype])
            assert self.path is not None  # DataSpec requires path for these kinds
            tokens = _open_token_file(self.path, dtype, self.seq_len)
            self.components = [(str(self.path), _Windows(tokens, self.seq_len, (self.seed,), str(self.path)))]
            return
        entries = [(spec.path, 1.0)] if spec.path else [(e.path, e.weight) for e in spec.blend]
        for k, (prefix, _) in enumerate(entries):
            ds = _open_indexed(prefix, self.vocab_size)
            key = (self.seed,) if len(entries) == 1 else (self.seed, k + 1)
            self.components.append((prefix, _Windows(ds.tokens, self.seq_len, key, str(ds.bin_path))))
        if len(entries) > 1:
            self.schedule = BlendSchedule(tuple(w for _, w in entries), self.seed)

    @property
    def num_windows(self) -> int | None:
        """Windows per epoch of a single-file source (None for synthetic data and blends)."""
        return self.components[0][1].num_windows if len(self.components) == 1 else None

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}, windows={self.num_windows}" if self.path else ""
        if self.schedule is not None:
            where = f", blend={[name for name, _ in self.components]}, slots={self.schedule.counts}"
        return f"SampleSource(kind={self.kind!r}, seq_len={self.seq_len}, seed={self.seed}{where})"

    def __getstate__(self) -> dict[str, Any]:
        # A pickled np.memmap carries the whole file's data; DataLoader workers reopen the files instead.
        state = self.__dict__.copy()
        state["components"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.kind != "synthetic":
            self.components, self.schedule = [], None
            self._open()

    def window_of(self, global_index: int) -> int:
        """File window read by sample `global_index` of a single-file source."""
        assert len(self.components) == 1, "window_of is defined for a single-file source"
        return self.components[0][1].window_of(global_index)

    def locate(self, global_index: int) -> tuple[int, int]:
        """(component, that component's sample index) of a global sample index."""
        return self.schedule.locate(global_index) if self.schedule is not None else (0, global_index)

    @property
    def source_names(self) -> list[str] | None:
        """Names of the data sources a sample may come from (the synthetic families, a blend's datasets);
        None for a single source (its loss needs no per-source view)."""
        if self.kind == "synthetic":
            return list(_SyntheticPatterns.FAMILIES)
        if self.schedule is not None:
            names = [Path(name).name or name for name, _ in self.components]
            # Two datasets of one basename in different folders: keep them apart by their full prefix.
            return names if len(set(names)) == len(names) else [name for name, _ in self.components]
        return None

    def source_of(self, global_index: int) -> int:
        """Index into `source_names` of sample `global_index` (0 for a single source)."""
        if self.kind == "synthetic":
            return self._synthetic.family_of(global_index)
        return self.locate(global_index)[0]

    def sample(self, global_index: int) -> torch.Tensor:
        if global_index < 0:
            raise IndexError(f"global sample index must be >= 0, got {global_index}")
        if self.kind == "synthetic":
            arr = self._synthetic.sample(global_index, self.seq_len + 1)
            return torch.from_numpy(arr)
        comp, local = self.locate(global_index)
        window = self.components[comp][1].read(local, self.vocab_size, global_index)
        return torch.from_numpy(window.astype(np.int64))

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Stack samples into a LongTensor [len(indices), seq_len + 1]."""
        if not indices:
            return torch.empty((0, self.seq_len + 1), dtype=torch.long)
        return torch.stack([self.sample(i) for i in indices])

    def position(self, cursor: DataCursor) -> dict[str, Any]:
        """Epoch and sample counters at the cursor (stored in the checkpoint's client state)."""
        n = cursor.next_sample
        out: dict[str, Any] = {"samples_consumed": n, "samples_trained": n - cursor.skipped_below(n)}
        if not self.components:
            out["epoch"] = None
            return out
        used = self.schedule.consumed(n) if self.schedule is not None else [n]
        comps = [{"name": name, "samples": u, "windows": w.num_windows, "epoch": u // w.num_windows}
                 for (name, w), u in zip(self.components, used, strict=True)]
        out["epoch"] = max(u // w.num_windows for (_, w), u in zip(self.components, used, strict=True))
        out["components"] = comps
        return out

    def fingerprint(self) -> dict[str, Any]:
        """What the sample order depends on: a resume with a different fingerprint reads other data."""
        return {"kind": self.kind, "seq_len": self.seq_len, "seed": self.seed,
                "windows": [w.num_windows for _, w in self.components],
                "weights": list(self.schedule.weights) if self.schedule is not None else None}


def _check_tokenizer_file(path: str, vocab_size: int) -> None:
    from .tokenizer import Tokenizer, TokenizerError, check_model_vocab

    try:
        check_model_vocab(Tokenizer.load(path, eos_token=None).vocab_size, vocab_size, where=f"data.tokenizer {path}")
    except TokenizerError as exc:
        raise DataError(str(exc)) from None


def _open_indexed(prefix: str, vocab_size: int) -> IndexedDataset:
    """Open and validate one indexed dataset; our preprocessing record (if any) must fit the model."""
    from .preprocess import read_meta
    from .tokenizer import TokenizerError, check_model_vocab

    try:
        ds = IndexedDataset(prefix)
    except IndexedDatasetError as exc:
        raise DataError(str(exc)) from None
    meta = read_meta(prefix)
    if meta is not None:
        max_id = int(meta.get("max_token_id", -1))
        if max_id >= vocab_size:
            raise DataError(f"{prefix}: holds token id {max_id} (per {Path(prefix).name}.json) but "
                            f"model.vocab_size={vocab_size}: ids must be < vocab_size")
        tok_vocab = meta.get("stats", {}).get("vocab_size")
        if tok_vocab:
            try:
                check_model_vocab(int(tok_vocab), vocab_size, where=f"the tokenizer {prefix} was preprocessed with")
            except TokenizerError as exc:
                raise DataError(str(exc)) from None
    return ds


def _open_token_file(path: Path, dtype: np.dtype, seq_len: int) -> np.ndarray:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    if not path.is_file():
        raise DataError(f"data path is not a regular file: {path}")
    itemsize = dtype.itemsize
    if size % itemsize:
        raise DataError(f"{path}: size {size} bytes is not a multiple of {itemsize} ({dtype.name}); "
                        f"wrong token_dtype or a truncated file?")
    n = size // itemsize
    if n < seq_len + 1:
        raise DataError(f"{path}: holds {n} tokens ({dtype.name}) but one sample needs seq_len+1 = "
                        f"{seq_len + 1}")
    # Read-only memmap: pages are loaded on demand and shared between ranks on one host.
    return np.memmap(path, dtype=dtype, mode="r")


class _SyntheticPatterns:
    """Learnable synthetic data, deterministic per (seed, index).

    Each sample is one of three families, so a tiny model's loss drops within a few dozen steps:
    - motifs (50 %): a concatenation of fixed motifs from a per-seed table (deterministic bigrams),
    - copy (25 %): a random n-gram (n in 2..8) repeated to the end (learnable by induction),
    - arithmetic (25 %): x_{t+1} = x_t + d mod V' with a small per-sample stride d.
    Tokens use at most the first 64 ids of the vocabulary (skewed unigram statistics learn quickly).
    """

    NUM_MOTIFS = 16
    # The family names, in the order of `family_of`'s ids (reported per step as the loss's sources).
    FAMILIES = ("motif", "copy", "arithmetic")

    def __init__(self, seed: int, vocab_size: int):
        self.seed = seed
        self.alphabet = min(vocab_size, 64)
        rng = np.random.default_rng([seed & MASK64, 0xD0])
        self.motifs = [rng.integers(0, self.alphabet, size=int(rng.integers(3, 9)), dtype=np.int64)
                       for _ in range(self.NUM_MOTIFS)]

    def family_of(self, index: int) -> int:
        """The family id (index into FAMILIES) of sample `index`: the first draw of its generator."""
        family = np.random.default_rng([self.seed & MASK64, index, 0xDA7A]).random()
        return 0 if family < 0.5 else 1 if family < 0.75 else 2

    def sample(self, index: int, length: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed & MASK64, index, 0xDA7A])
        family = rng.random()
        a = self.alphabet
        if family < 0.5:
            count = length // 3 + 2  # shortest motif has 3 tokens
            picks = rng.integers(0, self.NUM_MOTIFS, size=count)
            out = np.concatenate([self.motifs[k] for k in picks])[:length]
        elif family < 0.75:
            n = int(rng.integers(2, 9))
            gram = rng.integers(0, a, size=n, dtype=np.int64)
            out = np.resize(gram, length)
        else:
            start = int(rng.integers(0, a))
            stride = int(rng.integers(1, 4))
            out = (start + stride * np.arange(length, dtype=np.int64)) % a
        return out.astype(np.int64, copy=False)


# -------------------------------------------------------------------------------------- cursor
def normalize_ranges(ranges: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """Sort and merge overlapping or touching half-open ranges; reject empty/negative ones."""
    clean: list[tuple[int, int]] = []
    for r in ranges:
        if len(r) != 2:
            raise ValueError(f"skip range {r!r} must be [start, end)")
        start, end = int(r[0]), int(r[1])
        if not 0 <= start < end:
            raise ValueError(f"skip range [{start}, {end}) must satisfy 0 <= start < end")
        clean.append((start, end))
    clean.sort()
    merged: list[tuple[int, int]] = []
    for start, end in clean:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


@dataclass
class DataCursor:
    """Where the data stream stands: the next global sample index and the ranges never trained on."""

    next_sample: int = 0
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.next_sample < 0:
            raise ValueError(f"next_sample must be >= 0, got {self.next_sample}")
        self.skip_ranges = normalize_ranges(self.skip_ranges)

    def add_skip(self, start: int, end: int) -> None:
        """Exclude [start, end) from training from now on (rollback-and-skip)."""
        self.skip_ranges = normalize_ranges([*self.skip_ranges, (start, end)])

    def skipped_below(self, n: int) -> int:
        """How many indices < n lie in skip ranges (consumed but never trained on)."""
        return sum(max(0, min(end, n) - start) for start, end in self.skip_ranges if start < n)

    def is_skipped(self, index: int) -> bool:
        k = bisect.bisect_right(self.skip_ranges, (index, float("inf"))) - 1
        return k >= 0 and self.skip_ranges[k][0] <= index < self.skip_ranges[k][1]

    def state_dict(self) -> dict[str, Any]:
        return {"next_sample": self.next_sample, "skip_ranges": [list(r) for r in self.skip_ranges]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restored = DataCursor(int(state.get("next_sample", 0)), list(state.get("skip_ranges", [])))
        self.next_sample, self.skip_ranges = restored.next_sample, restored.skip_ranges


def cursor_for(spec: DataSpec, state: dict[str, Any] | None = None) -> DataCursor:
    """The cursor to train with: checkpointed state (if any) plus the spec's skip ranges (union)."""
    cursor = DataCursor()
    if state:
        cursor.load_state_dict(state)
    cursor.skip_ranges = normalize_ranges([*cursor.skip_ranges, *spec.skip_ranges])
    return cursor


def _take_unskipped(start: int, count: int, skips: list[tuple[int, int]]) -> list[int]:
    """The first `count` indices >= start outside every skip range (ranges normalized)."""
    out: list[int] = []
    i = start
    k = bisect.bisect_right(skips, (i, float("inf"))) - 1
    if k < 0:
        k = 0
    while len(out) < count:
        while k < len(skips) and skips[k][1] <= i:
            k += 1
        if k < len(skips) and skips[k][0] <= i:
            i = skips[k][1]  # jump over the whole range at once
            continue
        limit = skips[k][0] if k < len(skips) else i + (count - len(out))
        take = min(limit - i, count - len(out))
        out.extend(range(i, i + take))
        i += take
    return out


def batch_indices(cursor: DataCursor, dp_rank: int, dp_size: int, micro_batch: int,
                  grad_accum: int) -> tuple[list[list[int]], tuple[int, int]]:
    """Global sample indices of ONE optimizer step for `dp_rank`, and the step's global [start, end).

    Returns `(per_micro_step, (start, end))`: `per_micro_step[m]` holds `micro_batch` indices. Advances
    `cursor.next_sample` to `end`. Every rank must call it once per step with the same cursor state.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if micro_batch < 1 or grad_accum < 1:
        raise ValueError(f"micro_batch={micro_batch} and grad_accum={grad_accum} must be >= 1")
    start = cursor.next_sample
    flat = _take_unskipped(start, dp_size * micro_batch * grad_accum, cursor.skip_ranges)
    per_micro = []
    for m in range(grad_accum):
        block = (m * dp_size + dp_rank) * micro_batch
        per_micro.append(flat[block:block + micro_batch])
    end = flat[-1] + 1
    cursor.next_sample = end
    return per_micro, (start, end)


# ---------------------------------------------------------------------------------- Ulysses SP
def slice_for_sp(tokens: torch.Tensor, sp_rank: int, sp_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This SP rank's (inputs, labels, position_ids), each [b, s/sp], from samples [b, s+1].

    Position ids are GLOBAL (sp_rank * s_local + arange): rotary embeddings must see each token's true
    position, not its position inside the shard.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq_len+1], got shape {tuple(tokens.shape)}")
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must be in [0, sp_size={sp_size})")
    b, s = tokens.shape[0], tokens.shape[1] - 1
    if s < 1:
        raise ValueError(f"tokens must hold at least 2 positions (seq_len+1), got {s + 1}")
    if s % sp_size:
        # Upstream DeepSpeed #7384: DistributedAttention silently computes garbage on uneven shards.
        raise ValueError(f"seq_len={s} is not divisible by sequence_parallel_size={sp_size}")
    s_local = s // sp_size
    lo = sp_rank * s_local
    inputs = tokens[:, lo:lo + s_local]
    labels = tokens[:, lo + 1:lo + s_local + 1]
    positions = torch.arange(lo, lo + s_local, dtype=torch.long, device=tokens.device).expand(b, s_local)
    return inputs, labels, positions
