"""Tokenizer interface over Hugging Face `tokenizers` (`tokenizer.json`: BPE, Unigram, WordPiece, ...).

The job itself never tokenizes: preprocessing (`ulysses-preprocess`) turns text into an indexed dataset once,
and training reads token ids. This module is what preprocessing encodes with, what checks that a
tokenizer fits the model (`check_model_vocab`), and how a small BPE is trained on local text
(`train_bpe`; the shipped example uses it, no downloads).

EOS/BOS: `eos_token` / `bos_token` name special tokens of the tokenizer; `encode_document` appends EOS
(documents are separated by EOS in a packed stream) and prepends BOS when asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_EOS = "<|endoftext|>"
# Megatron-style vocabulary padding: the model's embedding may have up to this many rows past the
# tokenizer's ids (padded to a multiple of it), never fewer rows than the tokenizer has ids.
VOCAB_PAD_MULTIPLE = 128


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable, or does not fit the model."""


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - a declared dependency
        raise TokenizerError("the 'tokenizers' package is required: pip install tokenizers") from None
    return tokenizers


@dataclass(frozen=True)
class TokenizerInfo:
    """What the rest of the pipeline needs to know about a tokenizer."""

    vocab_size: int  # number of ids (including added special tokens); every id is < vocab_size
    eos_id: int | None  # id appended after each document, if the tokenizer has the EOS token
    bos_id: int | None  # id prepended to each document when BOS is requested


class Tokenizer:
    """A loaded `tokenizer.json` with the document-level encoding the preprocessor uses."""

    def __init__(self, hf_tokenizer, eos_token: str | None = DEFAULT_EOS, bos_token: str | None = None,
                 source: str = "<memory>"):
        self._tok = hf_tokenizer
        self.source = source
        self.eos_token, self.bos_token = eos_token, bos_token
        self.eos_id = self._special_id(eos_token, "eos_token")
        self.bos_id = self._special_id(bos_token, "bos_token")

    def _special_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise TokenizerError(f"{self.source}: {what} {token!r} is not in the tokenizer's vocabulary "
                                 f"(pass the tokenizer's own special token, or none)")
        return int(idx)

    @classmethod
    def load(cls, path: str | Path, eos_token: str | None = DEFAULT_EOS, bos_token: str | None = None
             ) -> Tokenizer:
        tokenizers = _require_tokenizers()
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(f"tokenizer file not found: {p}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as exc:  # the Rust side raises plain Exception on malformed JSON
            raise TokenizerError(f"{p} is not a valid tokenizer.json: {exc}") from None
        return cls(tok, eos_token, bos_token, source=str(p))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(p))
        return p

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def info(self) -> TokenizerInfo:
        return TokenizerInfo(self.vocab_size, self.eos_id, self.bos_id)

    def encode(self, text: str) -> list[int]:
        """Plain ids of `text` (no BOS/EOS, no post-processor specials)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_documents(self, texts: list[str], append_eos: bool = True, prepend_bos: bool = False
                         ) -> list[list[int]]:
        """Ids of each document, with EOS after it and BOS before it as asked."""
        if append_eos and self.eos_id is None:
            raise TokenizerError(f"{self.source}: append_eos needs an eos_token")
        if prepend_bos and self.bos_id is None:
            raise TokenizerError(f"{self.source}: prepend_bos needs a bos_token")
        out = []
        for enc in self._tok.encode_batch(texts, add_special_tokens=False):
            ids = enc.ids
            if prepend_bos:
                ids = [self.bos_id, *ids]
            if append_eos:
                ids = [*ids, self.eos_id]
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def check_model_vocab(tokenizer_vocab: int, model_vocab: int, where: str = "tokenizer") -> None:
    """Raise unless the model's embedding covers the tokenizer's ids with at most Megatron-style padding.

    A model smaller than the tokenizer would index past its embedding; one much larger than the padded
    tokenizer means the config was written for another tokenizer.
    """
    padded = -(-tokenizer_vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    if model_vocab < tokenizer_vocab:
        raise TokenizerError(f"{where} has {tokenizer_vocab} ids but model.vocab_size={model_vocab}: ids "
                             f">= {model_vocab} would index past the embedding (set model.vocab_size to "
                             f"{tokenizer_vocab}..{padded})")
    if model_vocab > padded:
        raise TokenizerError(f"model.vocab_size={model_vocab} does not match {where} ({tokenizer_vocab} ids; "
                             f"padded to a multiple of {VOCAB_PAD_MULTIPLE} that is {padded}): a tokenizer "
                             f"for another model? set model.vocab_size to {tokenizer_vocab}..{padded}")


def train_bpe(texts: Iterable[str] | Iterator[str], vocab_size: int, special_tokens: Iterable[str] = (DEFAULT_EOS,),
              min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) on `texts`; EOS is the first special token."""
    tokenizers = _require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = list(special_tokens)
    if vocab_size < 256 + len(specials):
        raise TokenizerError(f"vocab_size={vocab_size} must cover the 256 byte symbols and "
                             f"{len(specials)} special token(s)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eos_token=specials[0] if specials else None, source="<trained bpe>")
