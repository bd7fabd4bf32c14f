"""Convert text into a flat, header-free token file (uint16/uint32) that `data.kind = "tokens"` reads.

    python -m ulyssesd.training.tokenize IN.txt [IN2.txt ...] OUT.bin [--dtype uint16] [--vocab V.json]
                                         [--eos ID] [--unk ID]

Byte-level by default (token = byte, vocabulary 256). `--vocab` takes a JSON object {"token": id, ...} and
encodes by greedy longest match; characters no token covers map to `--unk` or fail with their offset.
`--eos ID` is appended after each input file (document separator). The output is written to a temporary
file and renamed, so a crashed conversion never leaves a half file under the final name.
The file format is the interface: any real tokenizer's ids written as a flat little-endian array work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_CHUNK = 16 << 20  # bytes (byte-level) or characters (vocab) per read


class TokenizeError(ValueError):
    """Bad input, vocabulary or dtype for the conversion."""


@dataclass
class TokenizeStats:
    """What a conversion wrote."""

    tokens: int  # number of tokens written
    max_id: int  # largest id written (-1 when empty); the model's vocab_size must exceed it
    dtype: str  # element type of the output file
    output: str  # output path


class Vocab:
    """A string -> id mapping encoded by greedy longest match."""

    def __init__(self, mapping: dict[str, int]):
        if not mapping:
            raise TokenizeError("vocabulary is empty")
        for tok, idx in mapping.items():
            if not isinstance(tok, str) or not tok:
                raise TokenizeError(f"vocabulary key {tok!r} must be a non-empty string")
            if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
                raise TokenizeError(f"vocabulary id of {tok!r} must be an int >= 0, got {idx!r}")
        self.mapping = dict(mapping)
        self.max_len = max(len(t) for t in mapping)
        self.max_id = max(mapping.values())

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenizeError(f"vocabulary file not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenizeError(f"vocabulary {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise TokenizeError(f"vocabulary {path} must be a JSON object {{token: id}}")
        return cls(data)

    def encode(self, text: str, unk: int | None = None, final: bool = True, base_offset: int = 0
               ) -> tuple[list[int], int]:
        """Encode `text`; returns (ids, characters consumed).

        With final=False the last max_len-1 characters are left unconsumed (a longer token might continue
        in the next chunk).
        """
        ids: list[int] = []
        n = len(text)
        stop = n if final else max(0, n - (self.max_len - 1))
        i = 0
        get = self.mapping.get
        while i < stop:
            for length in range(min(self.max_len, n - i), 0, -1):
                idx = get(text[i:i + length])
                if idx is not None:
                    ids.append(idx)
                    i += length
                    break
            else:
                if unk is None:
                    raise TokenizeError(f"character {text[i]!r} at character offset {base_offset + i} is not "
                                        f"covered by the vocabulary (pass --unk ID to map it)")
                ids.append(unk)
                i += 1
        return ids, i


def encode_bytes(data: bytes, dtype: str = "uint16") -> np.ndarray:
    """Byte-level encoding: one token per byte."""
    return np.frombuffer(data, dtype=np.uint8).astype(_dtype(dtype))


def _dtype(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TokenizeError(f"dtype {name!r} must be one of {sorted(DTYPES)}") from None


def _chunks(inputs: Iterable[Path], vocab: Vocab | None, unk: int | None, eos: int | None):
    for path in inputs:
        if not path.is_file():
            raise TokenizeError(f"input file not found: {path}")
        if vocab is None:
            with path.open("rb") as fh:
                while raw := fh.read(_CHUNK):
                    yield np.frombuffer(raw, dtype=np.uint8)
        else:
            with path.open("r", encoding="utf-8", newline="") as fh:
                pending, consumed_total = "", 0
                while True:
                    block = fh.read(_CHUNK)
                    text = pending + block
                    ids, used = vocab.encode(text, unk=unk, final=not block, base_offset=consumed_total)
                    consumed_total += used
                    pending = text[used:]
                    if ids:
                        yield np.asarray(ids, dtype=np.int64)
                    if not block:
                        break
        if eos is not None:
            yield np.asarray([eos], dtype=np.int64)


def tokenize_file(inputs: str | Path | Iterable[str | Path], output: str | Path, dtype: str = "uint16",
                  vocab: Vocab | str | Path | None = None, eos: int | None = None,
                  unk: int | None = None) -> TokenizeStats:
    """Convert text file(s) into a flat token file; returns what was written."""
    paths = [Path(inputs)] if isinstance(inputs, (str, Path)) else [Path(p) for p in inputs]
    if not paths:
        raise TokenizeError("no input files")
    dt = _dtype(dtype)
    if vocab is not None and not isinstance(vocab, Vocab):
        vocab = Vocab.load(vocab)
    limit = int(np.iinfo(dt).max)
    declared = [x for x in (eos, unk, vocab.max_id if vocab else 255) if x is not None]
    for x in declared:
        if not 0 <= x <= limit:
            raise TokenizeError(f"token id {x} does not fit {dtype} (max {limit}); use --dtype uint32")
    out = Path(output)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    count, max_id = 0, -1
    try:
        with tmp.open("wb") as fh:
            for arr in _chunks(paths, vocab, unk, eos):
                if arr.size:
                    max_id = max(max_id, int(arr.max()))
                    fh.write(arr.astype(dt).tobytes())
                    count += int(arr.size)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return TokenizeStats(tokens=count, max_id=max_id, dtype=dtype, output=str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ulyssesd.training.tokenize",
                                 description="Convert text to a flat token file for data.kind='tokens'.")
    ap.add_argument("inputs", nargs="+", type=Path, help="input text file(s)")
    ap.add_argument("output", type=Path, help="output .bin (flat little-endian token ids, no header)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="uint16", help="element type (default uint16)")
    ap.add_argument("--vocab", type=Path, help="JSON {token: id}; default byte-level (vocabulary 256)")
    ap.add_argument("--eos", type=int, help="id appended after each input file")
    ap.add_argument("--unk", type=int, help="id for characters the vocabulary does not cover")
    args = ap.parse_args(argv)
    try:
        stats = tokenize_file(args.inputs, args.output, args.dtype, args.vocab, args.eos, args.unk)
    except (TokenizeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {stats.tokens} tokens ({stats.dtype}, max id {stats.max_id}) to {stats.output}; "
          f"set data.kind='tokens', data.token_dtype='{stats.dtype}', model.vocab_size > {stats.max_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
