"""`ulysses-preprocess`'s command line (the tool itself: training/data/preprocess.py), on the CLI framework
every ulyssesd executable shares (ulyssesd.cli_app). Kept apart from the tool so that it imports without
numpy and tokenizers: on an install without the `train` extra the command says which extra to install and
exits 1 instead of failing with a traceback at import.

Exit codes: 0 written (or already complete), 1 an input, tokenizer or output problem (one line on stderr)
or the training stack missing, 2 a usage error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from ulyssesd.cli_app import cli_app, run_cli

from .tokenizer import DEFAULT_EOS  # a constant: tokenizer.py imports `tokenizers` only when used

#: What a missing module of these means: the `train` extra is not installed.
TRAIN_EXTRA_MODULES = frozenset({"numpy", "tokenizers"})

app = cli_app("Tokenize JSONL/Parquet/text into a Megatron-compatible indexed dataset (.bin + .idx) for "
              "data.kind='indexed'. Exactly one of --tokenizer, --train-tokenizer.")


@app.command()
def preprocess_cmd(
    ctx: typer.Context,
    inputs: list[Path] = typer.Argument(..., metavar="INPUT",
                                        help="input files (.jsonl/.json, .parquet, else UTF-8 text)"),
    output_prefix: str = typer.Option(..., "--output-prefix", metavar="PREFIX",
                                      help="writes PREFIX.bin, PREFIX.idx and PREFIX.json"),
    tokenizer: Path = typer.Option(None, "--tokenizer", metavar="PATH",
                                   help="tokenizer.json (Hugging Face tokenizers) or its folder"),
    train_tokenizer: Path = typer.Option(None, "--train-tokenizer", metavar="OUT.json",
                                         help="first train a byte-level BPE on the inputs and save it here "
                                              "(then encode with it)"),
    vocab_size: int = typer.Option(4096, "--vocab-size", metavar="N", help="vocabulary of --train-tokenizer"),
    text_key: str = typer.Option("text", "--text-key", metavar="KEY",
                                 help="JSON key / Parquet column of the text"),
    text_unit: str = typer.Option("file", "--text-unit", metavar="file|line",
                                  help="plain-text inputs: one document per file or per line"),
    workers: int = typer.Option(min(2, os.cpu_count() or 1), "--workers", metavar="N", help="processes"),
    chunk_mb: float = typer.Option(16.0, "--chunk-mb", metavar="MB", help="JSONL/line-text work unit size in MB"),
    skip_empty: bool = typer.Option(False, "--skip-empty", help="drop empty documents instead of failing"),
    no_eos: bool = typer.Option(False, "--no-eos", help="do not append EOS after each document"),
    eos_token: str = typer.Option(DEFAULT_EOS, "--eos-token", metavar="TOKEN", help="EOS special token"),
    bos_token: str = typer.Option(None, "--bos-token", metavar="TOKEN",
                                  help="prepend this BOS special token to each document"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    max_document_mb: float = typer.Option(16.0, "--max-document-mb", metavar="MB",
                                          help="longest document (JSONL line, text line or file) in MiB; a "
                                               "longer one is an error naming its line (memory stays bounded)"),
) -> None:
    """Tokenize JSONL/Parquet/text into a Megatron-compatible indexed dataset (PREFIX.bin + PREFIX.idx) for
    data.kind='indexed'. Exactly one of --tokenizer, --train-tokenizer. Resumable and idempotent: a re-run
    with the same inputs, tokenizer and options does nothing."""
    if (tokenizer is None) == (train_tokenizer is None):
        ctx.fail("exactly one of --tokenizer, --train-tokenizer is required")
    if text_unit not in ("file", "line"):
        ctx.fail(f"--text-unit must be file or line, not {text_unit!r}")
    try:
        from . import preprocess as pp
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in TRAIN_EXTRA_MODULES:
            raise  # not a missing extra: a real bug, with its traceback
        print(f"ulysses-preprocess: the training stack is not installed ({exc}): pip install 'ulyssesd[train]'",
              file=sys.stderr)
        raise typer.Exit(1) from None
    raise typer.Exit(pp.run(inputs, output_prefix, tokenizer=tokenizer, train_tokenizer=train_tokenizer,
                            vocab_size=vocab_size, options=pp.Options(
                                text_key=text_key, text_unit=text_unit, append_eos=not no_eos,
                                prepend_bos=bos_token is not None, skip_empty=skip_empty,
                                eos_token=eos_token, bos_token=bos_token),
                            workers=workers, chunk_mb=chunk_mb, progress=not no_progress and sys.stderr.isatty(),
                            max_document_mb=max_document_mb))


def main(argv: list[str] | None = None) -> int:
    return run_cli(app, argv, "ulysses-preprocess")


if __name__ == "__main__":
    sys.exit(main())
