"""`ulysses-preprocess`: JSONL / Parquet / text -> a Megatron-compatible indexed dataset (.bin + .idx).

    ulysses-preprocess --tokenizer tokenizer.json --output-prefix data/corpus IN.jsonl [IN2.parquet a.txt ...]
                       [--text-key text] [--text-unit file|line] [--workers 2] [--skip-empty]
                       [--no-eos] [--bos] [--chunk-mb 16]
    ulysses-preprocess --train-tokenizer OUT/tokenizer.json --vocab-size 4096 IN... [...]   (then encodes)

Input kind by suffix: `.jsonl`/`.json` (one JSON object per line, text under --text-key), `.parquet` (column
--text-key; needs pyarrow: `pip install 'ulyssesd[parquet]'`), anything else is UTF-8 text (one document per
file, or per line with --text-unit line). Each document gets EOS appended (documents are EOS-separated
in the packed stream); an empty document is an error naming its file and line unless --skip-empty.

Resumable and idempotent: the work is split into units (a byte range of a JSONL/text file, a Parquet row
group, a whole text file), each written as its own part under `<prefix>.parts-<job>/` (rename-on-complete),
then merged. `<prefix>.json` is written last and records the inputs' fingerprint: a re-run with the same
inputs, tokenizer and options sees it and does nothing; an interrupted run resumes at the first missing
part; a `.bin`/`.idx` without a matching `<prefix>.json` is never taken for complete.

Bounded: one document (a JSONL line, a text line or file, a Parquet value) may be at most
`--max-document-mb` (default 16 MiB; tokenizing costs about 100 bytes of memory per input byte: one 200 MB
JSONL line took 22 GB); a longer one is an error naming its file and line, found by a streaming scan that
never holds the long line. Workers die with the preprocess process (PR_SET_PDEATHSIG on Linux), so a
SIGKILLed run leaves no worker behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..durable import atomic_write_text
from .indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    paths_of,
    token_dtype_for_vocab,
)
from .line_scan import PreprocessError, check_lines, die_with_parent, line_end, line_number
from .tokenizer import DEFAULT_EOS, Tokenizer, TokenizerError, train_bpe

FORMAT = "ulyssesd-preprocess/1"
_ENCODE_BATCH = 256  # documents per encode_batch call
MAX_DOCUMENT_MB = 16.0  # default bound of one document (see the module doc)


@dataclass(frozen=True)
class Options:
    """What changes the output besides the inputs themselves (part of the job fingerprint)."""

    text_key: str = "text"  # JSON field / Parquet column holding the document text
    text_unit: str = "file"  # plain text: one document per "file" or per "line"
    append_eos: bool = True  # append the tokenizer's EOS after every document
    prepend_bos: bool = False  # prepend the tokenizer's BOS before every document
    skip_empty: bool = False  # drop empty documents (counted) instead of failing
    eos_token: str = DEFAULT_EOS  # name of the EOS special token in the tokenizer
    bos_token: str | None = None  # name of the BOS special token, if any


@dataclass(frozen=True)
class Unit:
    """One independent piece of work: part `index` of the output."""

    index: int
    path: str
    kind: str  # jsonl | text-lines | text-file | parquet
    start: int  # byte offset (jsonl, text-lines) or row group (parquet)
    end: int  # byte offset end (exclusive) or row group + 1
    nbytes: int  # input bytes it covers (progress and throughput)
    files: tuple[str, ...] = ()  # text-file: the consecutive whole files it holds (small files share a unit)


@dataclass
class Stats:
    """What a preprocessing run produced."""

    documents: int
    tokens: int
    skipped_empty: int
    input_bytes: int
    seconds: float
    dtype: str
    vocab_size: int
    output_prefix: str
    reused_parts: int = 0
    already_complete: bool = False

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


def _kind_of(path: Path, text_unit: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text-lines" if text_unit == "line" else "text-file"


def _require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PreprocessError("reading .parquet input needs pyarrow: pip install 'ulyssesd[parquet]' "
                              "(or pyarrow)") from None
    return pq


def plan_units(inputs: list[Path], text_unit: str, chunk_bytes: int,
               max_document_bytes: int = int(MAX_DOCUMENT_MB * (1 << 20))) -> list[Unit]:
    """Split the inputs into units; a pure function of the inputs' sizes and contents at line boundaries.
    A line (JSONL, line text) or a whole text file over `max_document_bytes` is refused here, streaming."""
    units: list[Unit] = []
    group: list[Path] = []

    def close_group() -> None:
        if group:
            size = sum(p.stat().st_size for p in group)
            units.append(Unit(len(units), str(group[0]), "text-file", 0, size, size, tuple(map(str, group))))
            group.clear()

    for path in inputs:
        if not path.is_file():
            raise PreprocessError(f"input file not found: {path}")
        kind = _kind_of(path, text_unit)
        size = path.stat().st_size
        if kind != "text-file":
            close_group()  # a group of whole text files ends where another kind of input starts (input order)
        if kind == "parquet":
            meta = _require_pyarrow().ParquetFile(path).metadata
            for rg in range(meta.num_row_groups):
                nbytes = meta.row_group(rg).total_byte_size
                units.append(Unit(len(units), str(path), kind, rg, rg + 1, nbytes))
        elif kind == "text-file":
            if size > max_document_bytes:
                raise PreprocessError(f"{path}: one document of {size} bytes, over {max_document_bytes} "
                                      f"(--max-document-mb); split it or use --text-unit line")
            group.append(path)
            if sum(p.stat().st_size for p in group) >= chunk_bytes:
                close_group()
            continue
        else:
            with path.open("rb") as fh:
                start = 0
                while start < size:
                    # Extend to the end of the line the chunk boundary falls in; every line on the way is
                    # checked against the bound without being held (a 200 MB line is never read whole).
                    end = size if start + chunk_bytes >= size else line_end(fh, start + chunk_bytes, size,
                                                                             max_document_bytes, path)
                    check_lines(fh, start, end, max_document_bytes, path)
                    units.append(Unit(len(units), str(path), kind, start, end, end - start))
                    start = end
    close_group()
    return units


def _documents(unit: Unit, opts: Options,
               max_document_bytes: int = int(MAX_DOCUMENT_MB * (1 << 20))) -> Iterator[tuple[str, Any]]:
    """(text, location) for every document of the unit; `describe(unit, location)` names it for errors."""
    if unit.kind == "text-file":
        for name in unit.files:
            if Path(name).stat().st_size > max_document_bytes:
                raise PreprocessError(f"{name}: one document over {max_document_bytes} bytes (--max-document-mb)")
            try:
                text = Path(name).read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise PreprocessError(f"{name}: not UTF-8 text ({exc})") from None
            yield text, name
        return
    if unit.kind == "parquet":
        table = _require_pyarrow().ParquetFile(unit.path).read_row_group(unit.start)
        if opts.text_key not in table.column_names:
            raise PreprocessError(f"{unit.path}: no column {opts.text_key!r} (columns: {table.column_names}); "
                                  f"pass --text-key")
        for row, value in enumerate(table.column(opts.text_key).to_pylist()):
            if not isinstance(value, str) and value is not None:
                raise PreprocessError(f"{describe(unit, row)}: column {opts.text_key!r} is "
                                      f"{type(value).__name__}, not a string")
            if value is not None and len(value) > max_document_bytes:
                raise PreprocessError(f"{describe(unit, row)}: a document of {len(value)} characters, over "
                                      f"{max_document_bytes} (--max-document-mb)")
            yield value or "", row
        return
    with open(unit.path, "rb") as fh:
        fh.seek(unit.start)
        data = fh.read(unit.end - unit.start)
    offset = unit.start
    for raw in data.splitlines(keepends=True):
        line_start, offset = offset, offset + len(raw)
        if len(raw) > max_document_bytes + 2:  # planned units were checked; a unit built by hand is not
            raise PreprocessError(f"{describe(unit, line_start)}: a line of {len(raw)} bytes, over "
                                  f"{max_document_bytes} (--max-document-mb)")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PreprocessError(f"{describe(unit, line_start)}: not UTF-8 ({exc})") from None
        if unit.kind == "text-lines":
            yield line.rstrip("\r\n"), line_start
            continue
        if not line.strip():
            continue  # blank line between JSON records
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PreprocessError(f"{describe(unit, line_start)}: not valid JSON ({exc.msg} at column "
                                  f"{exc.colno})") from None
        if not isinstance(obj, dict) or opts.text_key not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise PreprocessError(f"{describe(unit, line_start)}: no key {opts.text_key!r} (has {keys}); "
                                  f"pass --text-key")
        value = obj[opts.text_key]
        if not isinstance(value, str):
            raise PreprocessError(f"{describe(unit, line_start)}: {opts.text_key!r} is {type(value).__name__}, "
                                  f"not a string")
        yield value, line_start


def describe(unit: Unit, location: Any) -> str:
    """Where a document is, for error messages: `file:line`, a Parquet row, or the text file."""
    if unit.kind == "parquet":
        return f"{unit.path} row group {unit.start} row {location}"
    if unit.kind == "text-file":
        return str(location)
    return f"{unit.path}:{line_number(unit.path, location)}"


# ------------------------------------------------------------------------------------ workers
_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer_path: str, eos: str, bos: str | None, parent_pid: int | None = None) -> None:
    global _worker_tok
    if parent_pid is not None:
        die_with_parent(parent_pid)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_tok = Tokenizer.load(tokenizer_path, eos_token=eos, bos_token=bos)


def _part_prefix(parts_dir: Path, index: int) -> Path:
    return parts_dir / f"part-{index:06d}"


def run_unit(unit: Unit, opts: Options, parts_dir: str, dtype_str: str,
             max_document_bytes: int = int(MAX_DOCUMENT_MB * (1 << 20))) -> tuple[int, int, int, int]:
    """Encode one unit into its part; returns (index, documents, tokens, skipped_empty)."""
    tok = _worker_tok
    assert tok is not None, "worker not initialised"
    docs = skipped = 0
    prefix = _part_prefix(Path(parts_dir), unit.index)
    with IndexedDatasetWriter(prefix, np.dtype(dtype_str)) as writer:
        batch: list[str] = []

        def flush() -> None:
            for ids in tok.encode_documents(batch, opts.append_eos, opts.prepend_bos):
                writer.add_document(ids)
            batch.clear()

        for text, location in _documents(unit, opts, max_document_bytes):
            if not text.strip():
                if opts.skip_empty:
                    skipped += 1
                    continue
                raise PreprocessError(f"{describe(unit, location)}: empty document (pass --skip-empty to drop "
                                      f"empty documents)")
            batch.append(text)
            docs += 1
            if len(batch) >= _ENCODE_BATCH:
                flush()
        if batch:
            flush()
        tokens = writer.tokens  # an all-empty unit still gets a (zero-document) part: a resume sees it done
    return unit.index, docs, tokens, skipped


# --------------------------------------------------------------------------------------- driver
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fingerprint(inputs: list[Path], tokenizer_path: Path, opts: Options, chunk_bytes: int) -> dict[str, Any]:
    """Everything the output depends on; equal fingerprints mean equal outputs."""
    files = []
    for p in inputs:
        st = p.stat()
        files.append({"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return {"format": FORMAT, "inputs": files, "tokenizer_sha256": _sha256(tokenizer_path),
            "options": asdict(opts), "chunk_bytes": chunk_bytes}


def meta_path(prefix: str | Path) -> Path:
    return paths_of(prefix)[0].with_suffix(".json")


def read_meta(prefix: str | Path) -> dict[str, Any] | None:
    """The completion record of a dataset this tool wrote, or None (foreign or incomplete dataset)."""
    p = meta_path(prefix)
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _intact(prefix: str | Path, meta: dict[str, Any]) -> bool:
    """The finished dataset is still on disk as recorded (a damaged one is rebuilt, not trusted)."""
    try:
        ds = IndexedDataset(prefix)
    except IndexedDatasetError:
        return False
    return ds.num_tokens == meta["stats"]["tokens"] and ds.num_documents == meta["stats"]["documents"]


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    prog = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
    prog.start()
    prog.add_task("tokenizing", total=total)
    return prog


def preprocess(inputs: list[str | Path], tokenizer_path: str | Path, output_prefix: str | Path,
               opts: Options | None = None, workers: int = 1, chunk_bytes: int = 16 << 20,
               progress: bool = False, max_document_bytes: int = int(MAX_DOCUMENT_MB * (1 << 20))) -> Stats:
    """Tokenize `inputs` into `<output_prefix>.bin/.idx` (+ `.json`); resumes and skips finished work."""
    opts = opts or Options()
    paths = [Path(p) for p in inputs]
    if not paths:
        raise PreprocessError("no input files")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if chunk_bytes < 1:
        raise PreprocessError(f"chunk size must be >= 1 byte, got {chunk_bytes}")
    if not 1 <= max_document_bytes <= 4 << 30:
        raise PreprocessError(f"--max-document-mb must be within (0, 4096] MiB, got {max_document_bytes / (1 << 20):g}")
    tok_path = Path(tokenizer_path)
    tok = Tokenizer.load(tok_path, eos_token=opts.eos_token if opts.append_eos else None,
                         bos_token=opts.bos_token if opts.prepend_bos else None)
    for p in paths:
        if not p.is_file():
            raise PreprocessError(f"input file not found: {p}")
    dtype = token_dtype_for_vocab(tok.vocab_size)
    fp = fingerprint(paths, tok_path, opts, chunk_bytes)
    job = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    bin_path = paths_of(output_prefix)[0]
    meta = read_meta(output_prefix)
    if meta and meta.get("fingerprint") == fp and _intact(output_prefix, meta):
        return Stats(**{**meta["stats"], "already_complete": True, "reused_parts": 0})
    meta_path(output_prefix).unlink(missing_ok=True)  # from now on the old output is not complete
    parts_dir = bin_path.with_name(f"{bin_path.stem}.parts-{job}")
    parts_dir.mkdir(parents=True, exist_ok=True)
    units = plan_units(paths, opts.text_unit, chunk_bytes, max_document_bytes)
    t0 = time.perf_counter()
    done: dict[int, tuple[int, int, int]] = {}
    done_file = parts_dir / "done.jsonl"
    if done_file.is_file():
        for line in done_file.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash: that unit is simply redone
            if paths_of(_part_prefix(parts_dir, rec["index"]))[1].is_file():
                done[rec["index"]] = (rec["documents"], rec["tokens"], rec["skipped"])
    reused = len(done)
    todo = [u for u in units if u.index not in done]
    prog = _progress(progress, sum(u.nbytes for u in units))
    if prog is not None:
        prog.update(0, completed=sum(u.nbytes for u in units if u.index in done))
    try:
        with done_file.open("a") as log:
            def record(res: tuple[int, int, int, int]) -> None:
                index, docs, tokens, skipped = res
                done[index] = (docs, tokens, skipped)
                log.write(json.dumps({"index": index, "documents": docs, "tokens": tokens, "skipped": skipped}) + "\n")
                log.flush()
                if prog is not None:
                    prog.update(0, advance=units[index].nbytes)

            if workers == 1 or len(todo) <= 1:
                _init_worker(str(tok_path), opts.eos_token, opts.bos_token if opts.prepend_bos else None)
                for u in todo:
                    record(run_unit(u, opts, str(parts_dir), dtype.str, max_document_bytes))
            else:
                import multiprocessing as mp

                ctx = mp.get_context("spawn")  # no fork of a process that may hold tokenizer threads
                with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                         initargs=(str(tok_path), opts.eos_token,
                                                   opts.bos_token if opts.prepend_bos else None,
                                                   os.getpid())) as pool:
                    futures = [pool.submit(run_unit, u, opts, str(parts_dir), dtype.str, max_document_bytes)
                               for u in todo]
                    try:
                        for fut in as_completed(futures):
                            record(fut.result())
                    except BaseException:
                        for f in futures:
                            f.cancel()
                        raise
    finally:
        if prog is not None:
            prog.stop()
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for u in units:
            if done[u.index][0]:
                writer.add_dataset(_part_prefix(parts_dir, u.index))
    docs = sum(d for d, _, _ in done.values())
    tokens = sum(t for _, t, _ in done.values())
    skipped = sum(s for _, _, s in done.values())
    stats = Stats(documents=docs, tokens=tokens, skipped_empty=skipped, input_bytes=sum(u.nbytes for u in units),
                  seconds=time.perf_counter() - t0, dtype=dtype.name, vocab_size=tok.vocab_size,
                  output_prefix=str(output_prefix), reused_parts=reused)
    if docs == 0:
        raise PreprocessError("the inputs hold no (non-empty) documents")
    ds = IndexedDataset(output_prefix)
    max_id = int(ds.tokens.max()) if ds.num_tokens else -1
    record_ = {"fingerprint": fp, "stats": {k: v for k, v in asdict(stats).items()
                                            if k not in ("reused_parts", "already_complete")},
               "max_token_id": max_id, "eos_id": tok.eos_id, "bos_id": tok.bos_id}
    # Last, and durable: the dataset is complete from here on.
    atomic_write_text(meta_path(output_prefix), json.dumps(record_, indent=2, sort_keys=True))
    shutil.rmtree(parts_dir, ignore_errors=True)
    return stats


def _iter_texts(paths: list[Path], opts: Options, max_document_bytes: int) -> Iterator[str]:
    for u in plan_units(paths, opts.text_unit, 64 << 20, max_document_bytes):
        for text, _ in _documents(u, opts, max_document_bytes):
            if text.strip():
                yield text


def run(inputs: list[Path], output_prefix: str | Path, *, tokenizer: Path | None, train_tokenizer: Path | None,
        vocab_size: int, options: Options, workers: int, chunk_mb: float, progress: bool,
        max_document_mb: float = MAX_DOCUMENT_MB) -> int:
    """What `ulysses-preprocess` does once its flags are parsed (training/data/preprocess_cli.py): train the
    tokenizer if asked, encode, print the outcome and the config lines to use. 0, or 1 with the problem."""
    try:
        if not (0 < max_document_mb <= 4096):  # NaN fails too
            raise PreprocessError(f"--max-document-mb must be within (0, 4096], got {max_document_mb}")
        if not (0 < chunk_mb <= 4096):
            raise PreprocessError(f"--chunk-mb must be within (0, 4096], got {chunk_mb}")
        max_doc = int(max_document_mb * (1 << 20))
        tok_path = train_tokenizer if train_tokenizer is not None else tokenizer
        if tok_path is None:
            raise PreprocessError("no tokenizer: give --tokenizer PATH or --train-tokenizer OUT.json")
        if train_tokenizer is not None:
            if not tok_path.is_file():
                trained = train_bpe(_iter_texts(inputs, options, max_doc), vocab_size, special_tokens=[options.eos_token])
                trained.save(tok_path)
                print(f"trained a {trained.vocab_size}-id BPE tokenizer -> {tok_path}")
            else:
                print(f"tokenizer {tok_path} exists; reusing it")
        stats = preprocess([*inputs], tok_path, output_prefix, options, workers=workers,
                           chunk_bytes=max(1, int(chunk_mb * (1 << 20))), progress=progress,
                           max_document_bytes=max_doc)
    except (PreprocessError, TokenizerError, IndexedDatasetError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if stats.already_complete:
        print(f"{stats.output_prefix}: already complete for these inputs, tokenizer and options; nothing to do")
    else:
        print(f"wrote {stats.documents} documents, {stats.tokens} tokens ({stats.dtype}) to {stats.output_prefix}"
              f".bin/.idx in {stats.seconds:.2f} s ({stats.mb_per_s:.2f} MB/s of input; {stats.reused_parts} "
              f"parts reused, {stats.skipped_empty} empty documents skipped)")
    print(f"config: [data] kind = \"indexed\", path = \"{stats.output_prefix}\"; model.vocab_size >= {stats.vocab_size}")
    return 0


if __name__ == "__main__":  # `python -m ulyssesd.training.data.preprocess`: the same command line
    import runpy

    # Run the CLI module as the program rather than import it here: it imports this module (lazily, so that
    # it starts without numpy), and an import back would be a cycle.
    runpy.run_module("ulyssesd.training.data.preprocess_cli", run_name="__main__", alter_sys=True)
