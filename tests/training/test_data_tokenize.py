"""The token-file converter: byte-level and vocab modes, chunk boundaries, CLI, and reading the result back."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ulyssesd.training import tokenize as tk
from ulyssesd.training.data import SampleSource
from ulyssesd.training.spec import DataSpec


def test_byte_level_round_trip_and_eos(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes("héllo\n".encode())
    b.write_bytes(b"\xff\x00z")
    out = tmp_path / "out.bin"
    stats = tk.tokenize_file([a, b], out, dtype="uint16", eos=256)
    data = np.fromfile(out, dtype="<u2")
    assert data.tolist() == [*"héllo\n".encode(), 256, 255, 0, ord("z"), 256]
    assert stats.tokens == len(data) and stats.max_id == 256 and out.stat().st_size == 2 * len(data)
    assert not list(tmp_path.glob(".out.bin.tmp*"))  # temp file renamed away


def test_vocab_greedy_longest_match_across_chunk_boundaries(tmp_path, monkeypatch):
    vocab = {"a": 1, "ab": 2, "abc": 3, "b": 4, "c": 5, " ": 6, "\n": 7}
    vpath = tmp_path / "vocab.json"
    vpath.write_text(json.dumps(vocab))
    text = "abc ab a b c\nabcabc" * 50
    inp = tmp_path / "in.txt"
    inp.write_text(text)
    expected, _ = tk.Vocab(vocab).encode(text)
    monkeypatch.setattr(tk, "_CHUNK", 7)  # force many chunk boundaries inside tokens
    tk.tokenize_file(inp, tmp_path / "o.bin", dtype="uint32", vocab=vpath)
    got = np.fromfile(tmp_path / "o.bin", dtype="<u4").tolist()
    assert got == expected
    assert expected[:4] == [3, 6, 2, 6]  # longest match: "abc" not "a","b","c"


def test_uncovered_character_fails_with_offset_or_maps_to_unk(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("aaxa")
    vocab = tk.Vocab({"a": 0})
    with pytest.raises(tk.TokenizeError, match="character 'x' at character offset 2"):
        tk.tokenize_file(inp, tmp_path / "o.bin", vocab=vocab)
    assert not (tmp_path / "o.bin").exists()  # no half file under the final name
    tk.tokenize_file(inp, tmp_path / "o.bin", vocab=vocab, unk=9)
    assert np.fromfile(tmp_path / "o.bin", dtype="<u2").tolist() == [0, 0, 9, 0]


def test_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("a")
    with pytest.raises(tk.TokenizeError, match="70000 does not fit uint16"):
        tk.tokenize_file(inp, tmp_path / "o.bin", vocab=tk.Vocab({"a": 70000}))
    with pytest.raises(tk.TokenizeError, match="must be one of"):
        tk.tokenize_file(inp, tmp_path / "o.bin", dtype="int8")
    with pytest.raises(tk.TokenizeError, match="input file not found"):
        tk.tokenize_file(tmp_path / "missing.txt", tmp_path / "o.bin")


def test_cli_output_is_readable_as_a_token_source(tmp_path):
    inp = tmp_path / "corpus.txt"
    inp.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    out = tmp_path / "corpus.bin"
    proc = subprocess.run([sys.executable, "-m", "ulyssesd.training.tokenize", str(inp), str(out),
                           "--dtype", "uint16"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 880 tokens" in proc.stdout
    src = SampleSource(DataSpec(kind="tokens", path=str(out), token_dtype="uint16"), 16, 256, seed=0)
    w = src.window_of(3)
    assert bytes(src.sample(3).tolist()) == inp.read_bytes()[w * 16:w * 16 + 17]
    bad = subprocess.run([sys.executable, "-m", "ulyssesd.training.tokenize", str(tmp_path / "nope"), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "input file not found" in bad.stderr
