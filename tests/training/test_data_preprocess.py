"""ulysses-preprocess: text -> indexed dataset -> batches round trip, multi-process equality, resume after a
crash, idempotence, partial output never taken for complete, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ulyssesd.training.data import preprocess as pp
from ulyssesd.training.data.batches import DataError, SampleSource
from ulyssesd.training.data.indexed_dataset import IndexedDataset
from ulyssesd.training.data.tokenizer import Tokenizer, TokenizerError, check_model_vocab, train_bpe
from ulyssesd.training.spec import DataSpec

TEXTS = [f"Document {i}: the quick brown fox jumps over {i % 13} lazy dogs. " * (1 + i % 5) for i in range(400)]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXTS, vocab_size=320).save(path)
    return path


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return path


def _bytes(prefix):
    return (prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes())


def test_tokenizer_trains_encodes_with_eos_and_round_trips(tokenizer_path):
    tok = Tokenizer.load(tokenizer_path)
    assert tok.vocab_size == 320 and tok.eos_id == 0
    [ids] = tok.encode_documents([TEXTS[3]])
    assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
    assert tok.decode(ids[:-1]) == TEXTS[3]
    assert len(ids) < len(TEXTS[3]) / 2  # BPE merges learnt: far fewer tokens than bytes
    with pytest.raises(TokenizerError, match="bos_token '<s>' is not in the tokenizer's vocabulary"):
        Tokenizer.load(tokenizer_path, bos_token="<s>")
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.load(tokenizer_path.parent / "nope.json")


def test_tokenizer_vocab_must_fit_the_model():
    check_model_vocab(50257, 50304)  # GPT-2 padded to a multiple of 128: fine
    with pytest.raises(TokenizerError, match="has 50257 ids but model.vocab_size=50000"):
        check_model_vocab(50257, 50000)
    with pytest.raises(TokenizerError, match="does not match .* a tokenizer for another model"):
        check_model_vocab(1024, 50304)


def test_round_trip_jsonl_to_batches(tmp_path, jsonl, tokenizer_path):
    stats = pp.preprocess([jsonl], tokenizer_path, tmp_path / "out" / "ds", workers=1)
    ds = IndexedDataset(tmp_path / "out" / "ds")
    tok = Tokenizer.load(tokenizer_path)
    assert stats.documents == ds.num_documents == len(TEXTS) and stats.tokens == ds.num_tokens
    assert ds.dtype == np.dtype("<u2")
    for k in (0, 17, 399):
        assert ds.document(k).tolist() == tok.encode(TEXTS[k]) + [tok.eos_id]
    # The packed stream is the documents back to back, each ending with EOS.
    src = SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "out" / "ds"), tokenizer=str(tokenizer_path)),
                       seq_len=32, vocab_size=320, seed=5)
    flat = np.asarray(ds.tokens)
    seen = set()
    for i in range(src.num_windows):
        w = src.window_of(i)
        seen.add(w)
        assert src.sample(i).tolist() == flat[w * 32:w * 32 + 33].tolist()
    assert seen == set(range(src.num_windows)) == set(range((len(flat) - 1) // 32))
    meta = pp.read_meta(tmp_path / "out" / "ds")
    assert meta["max_token_id"] == int(flat.max()) and meta["stats"]["vocab_size"] == 320


def test_plain_text_parquet_and_multiple_workers_give_identical_bytes(tmp_path, jsonl, tokenizer_path):
    one = tmp_path / "one"
    pp.preprocess([jsonl], tokenizer_path, one, workers=1, chunk_bytes=4096)
    two = tmp_path / "two"
    stats = pp.preprocess([jsonl], tokenizer_path, two, workers=2, chunk_bytes=4096)
    assert stats.input_bytes == jsonl.stat().st_size
    assert _bytes(one) == _bytes(two)
    # One document per line of plain text is the same data.
    txt = tmp_path / "in.txt"
    txt.write_text("".join(t + "\n" for t in TEXTS))
    three = tmp_path / "three"
    pp.preprocess([txt], tokenizer_path, three, pp.Options(text_unit="line"), workers=2, chunk_bytes=3000)
    assert _bytes(three) == _bytes(one)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "in.parquet", row_group_size=64)
    four = tmp_path / "four"
    pp.preprocess([tmp_path / "in.parquet"], tokenizer_path, four, workers=2)
    assert _bytes(four) == _bytes(one)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, tokenizer_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(pp.PreprocessError, match=r"\.parquet input needs pyarrow: pip install 'ulyssesd\[parquet\]'"):
        pp.preprocess([tmp_path / "x.parquet"], tokenizer_path, tmp_path / "o")


def test_resume_after_a_crash_reuses_finished_parts_and_gives_the_same_bytes(tmp_path, jsonl, tokenizer_path,
                                                                              monkeypatch):
    clean = tmp_path / "clean"
    pp.preprocess([jsonl], tokenizer_path, clean, chunk_bytes=4096)
    real = pp.run_unit
    calls = []

    def crash_on_unit_5(unit, *args):
        calls.append(unit.index)
        if unit.index == 5:
            raise KeyboardInterrupt("simulated kill")
        return real(unit, *args)

    monkeypatch.setattr(pp, "run_unit", crash_on_unit_5)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess([jsonl], tokenizer_path, out, chunk_bytes=4096)
    # Partial output is never complete: no final files, no completion record.
    assert not out.with_suffix(".idx").exists() and pp.read_meta(out) is None
    monkeypatch.setattr(pp, "run_unit", real)
    stats = pp.preprocess([jsonl], tokenizer_path, out, chunk_bytes=4096)
    assert stats.reused_parts == 5 and not stats.already_complete
    assert _bytes(out) == _bytes(clean)
    assert not list(tmp_path.glob("resumed.parts-*"))  # parts removed once merged


def test_rerun_is_a_no_op_and_a_damaged_or_unrecorded_output_is_rebuilt(tmp_path, jsonl, tokenizer_path):
    out = tmp_path / "ds"
    pp.preprocess([jsonl], tokenizer_path, out)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("ds.*")}
    again = pp.preprocess([jsonl], tokenizer_path, out)
    assert again.already_complete
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("ds.*")} == before
    good = _bytes(out)
    # A truncated .bin under a valid-looking record is not trusted.
    out.with_suffix(".bin").write_bytes(good[0][:100])
    assert not pp.preprocess([jsonl], tokenizer_path, out).already_complete
    assert _bytes(out) == good
    # A .bin/.idx pair without its completion record (e.g. copied mid-run) is rebuilt too.
    out.with_suffix(".json").unlink()
    assert not pp.preprocess([jsonl], tokenizer_path, out).already_complete
    # Changed input -> new fingerprint -> rebuilt.
    with jsonl.open("a") as fh:
        fh.write(json.dumps({"text": "one more document"}) + "\n")
    stats = pp.preprocess([jsonl], tokenizer_path, out)
    assert not stats.already_complete and stats.documents == len(TEXTS) + 1


def test_bad_input_is_named_with_file_and_line(tmp_path, tokenizer_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ""}\n{"text": "also fine"}\n')
    with pytest.raises(pp.PreprocessError, match=r"bad.jsonl:2: empty document \(pass --skip-empty"):
        pp.preprocess([bad], tokenizer_path, tmp_path / "o")
    stats = pp.preprocess([bad], tokenizer_path, tmp_path / "o", pp.Options(skip_empty=True))
    assert (stats.documents, stats.skipped_empty) == (2, 1)
    bad.write_text('{"text": "fine"}\n{"text": "x"\n')
    with pytest.raises(pp.PreprocessError, match=r"bad.jsonl:2: not valid JSON"):
        pp.preprocess([bad], tokenizer_path, tmp_path / "o2")
    bad.write_text('{"body": "no text key"}\n')
    with pytest.raises(pp.PreprocessError, match=r"bad.jsonl:1: no key 'text' \(has \['body'\]\); pass --text-key"):
        pp.preprocess([bad], tokenizer_path, tmp_path / "o3")
    with pytest.raises(pp.PreprocessError, match="input file not found"):
        pp.preprocess([tmp_path / "missing.jsonl"], tokenizer_path, tmp_path / "o4")


def test_dataset_preprocessed_for_another_vocabulary_fails_at_start(tmp_path, jsonl, tokenizer_path):
    pp.preprocess([jsonl], tokenizer_path, tmp_path / "ds")
    with pytest.raises(DataError, match=r"holds token id 3\d\d \(per ds.json\) but model.vocab_size=256"):
        SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "ds")), 16, vocab_size=256, seed=0)
    with pytest.raises(DataError, match="does not match the tokenizer .* was preprocessed with .320 ids"):
        SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "ds")), 16, vocab_size=50304, seed=0)
    with pytest.raises(DataError, match="data.tokenizer .* has 320 ids but model.vocab_size=300"):
        SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "ds"), tokenizer=str(tokenizer_path)), 16,
                     vocab_size=300, seed=0)
    SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "ds")), 16, vocab_size=384, seed=0)  # padded: ok


def test_cli_trains_a_tokenizer_preprocesses_and_reports(tmp_path, jsonl):
    cmd = [sys.executable, "-m", "ulyssesd.training.data.preprocess", str(jsonl), "--train-tokenizer",
           str(tmp_path / "tok.json"), "--vocab-size", "300", "--output-prefix", str(tmp_path / "ds"),
           "--workers", "2", "--chunk-mb", "0.01"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "trained a 300-id BPE tokenizer" in out.stdout and f"wrote {len(TEXTS)} documents" in out.stdout
    assert IndexedDataset(tmp_path / "ds").num_documents == len(TEXTS)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already complete" in again.stdout
    bad = subprocess.run(cmd[:4] + ["--tokenizer", str(tmp_path / "none.json"), "--output-prefix",
                                    str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "tokenizer file not found" in bad.stderr


def test_whole_text_files_are_one_document_each_in_input_order(tmp_path, tokenizer_path):
    files = []
    for i, t in enumerate(TEXTS[:40]):
        files.append(tmp_path / f"doc{i:02d}.txt")
        files[-1].write_text(t)
    rest = tmp_path / "rest.jsonl"
    rest.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[40:60]))
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:60]))
    # Small files are grouped into units (chunk 500 bytes -> many groups), spread over two workers.
    stats = pp.preprocess([*files[:30], rest, *files[30:]], tokenizer_path, tmp_path / "mixed", workers=2,
                          chunk_bytes=500)
    assert stats.documents == 60
    pp.preprocess([ref], tokenizer_path, tmp_path / "ref")
    mixed, want = IndexedDataset(tmp_path / "mixed"), IndexedDataset(tmp_path / "ref")
    order = list(range(30)) + list(range(40, 60)) + list(range(30, 40))
    assert [mixed.document(k).tolist() for k in range(60)] == [want.document(k).tolist() for k in order]
