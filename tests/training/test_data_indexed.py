"""Megatron indexed datasets: byte-for-byte compatibility with the reference layout, reading datasets made
elsewhere (several sequences per document), and a clear error for each kind of bad data."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ulyssesd.training.data.batches import DataError, SampleSource
from ulyssesd.training.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    token_dtype_for_vocab,
)
from ulyssesd.training.spec import DataSpec

# ------------------------------------------------------------------ independent reference writer
# Written from the layout of Megatron-LM's megatron/core/datasets/indexed_dataset.py (_IndexWriter and
# IndexedDatasetBuilder), not from our writer: a builder keeps sequence lengths and document indices
# starting at [0], end_document() appends the sequence count, the .idx is magic, version, dtype code, counts,
# then int32 lengths, int64 byte pointers, int64 document indices.
_REF_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
              np.uint16: 8}


def reference_build(prefix, documents, dtype):
    """documents: list of documents, each a list of sequences (lists of ids)."""
    lengths, doc_idx = [], [0]
    with open(f"{prefix}.bin", "wb") as data:
        for doc in documents:
            for seq in doc:
                arr = np.array(seq, dtype=dtype)
                data.write(arr.tobytes(order="C"))
                lengths.append(arr.size)
            doc_idx.append(len(lengths))
    pointers, cur = [], 0
    for n in lengths:
        pointers.append(cur)
        cur += n * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", _REF_CODES[dtype]))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(doc_idx)))
        idx.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        idx.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        idx.write(np.array(doc_idx, dtype=np.int64).tobytes(order="C"))


DOCS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [0]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_output_is_byte_identical_to_the_reference_layout(tmp_path, dtype):
    reference_build(tmp_path / "ref", [[d] for d in DOCS], dtype)
    with IndexedDatasetWriter(tmp_path / "ours", np.dtype(dtype)) as w:
        for d in DOCS:
            w.add_document(d)
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    # Header fields at their fixed offsets (the 34-byte header).
    raw = (tmp_path / "ours.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack_from("<Q", raw, 9)[0] == 1
    assert raw[17] == (8 if dtype is np.uint16 else 4)
    assert struct.unpack_from("<QQ", raw, 18) == (len(DOCS), len(DOCS) + 1)


def test_reads_a_dataset_made_elsewhere_with_several_sequences_per_document(tmp_path):
    docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [9], [10, 11, 12]]]  # sentence-split style
    reference_build(tmp_path / "meg", docs, np.int32)
    ds = IndexedDataset(tmp_path / "meg")
    assert (ds.num_sequences, ds.num_documents, ds.num_tokens, ds.dtype.name) == (6, 3, 12, "int32")
    assert ds.sequence(1).tolist() == [4, 5]
    assert ds.document(0).tolist() == [1, 2, 3, 4, 5] and ds.document(2).tolist() == [7, 8, 9, 10, 11, 12]
    assert ds.document_starts().tolist() == [0, 5, 6]
    assert np.asarray(ds.tokens).tolist() == list(range(1, 13))
    # A ".bin"/".idx" suffix on the prefix is accepted too.
    assert IndexedDataset(tmp_path / "meg.idx").num_tokens == 12


def test_dtype_follows_megatrons_vocabulary_rule():
    assert token_dtype_for_vocab(50257) == np.dtype("<u2")
    assert token_dtype_for_vocab(65499) == np.dtype("<u2")
    assert token_dtype_for_vocab(65500) == np.dtype("<i4")
    assert token_dtype_for_vocab(250880) == np.dtype("<i4")  # BLOOM


def test_writer_rejects_ids_that_do_not_fit_and_empty_documents_and_leaves_nothing(tmp_path):
    with pytest.raises(IndexedDatasetError, match="token id 70000 does not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "x", np.dtype("<u2")) as w:
            w.add_document([1, 70000])
    with pytest.raises(IndexedDatasetError, match="document 1 is empty"):
        with IndexedDatasetWriter(tmp_path / "x", np.dtype("<u2")) as w:
            w.add_document([1])
            w.add_document([])
    assert list(tmp_path.iterdir()) == []  # no partial .bin/.idx under any name


# --------------------------------------------------------------------------------- bad data
@pytest.fixture
def good(tmp_path):
    reference_build(tmp_path / "d", [[d] for d in DOCS], np.uint16)
    return tmp_path / "d"


def test_truncated_bin_is_named(good):
    raw = good.with_suffix(".bin").read_bytes()
    good.with_suffix(".bin").write_bytes(raw[:-4])
    with pytest.raises(IndexedDatasetError, match=r"d.bin: 28 bytes but d.idx describes 16 tokens .*truncated"):
        IndexedDataset(good)


def test_bin_longer_than_its_index_is_named(good):
    with good.with_suffix(".bin").open("ab") as fh:
        fh.write(b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match="longer than its index"):
        IndexedDataset(good)


def test_idx_that_disagrees_with_itself_or_the_bin(good):
    idx = good.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    idx.write_bytes(bytes(raw[:-8]))  # cut the last document index
    with pytest.raises(IndexedDatasetError, match="truncated or corrupt .idx"):
        IndexedDataset(good)
    bad = bytearray(raw)
    struct.pack_into("<q", bad, 34 + 4 * 4 + 8 * 2, 999)  # sequence 2's pointer
    idx.write_bytes(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="sequence 2 starts at byte 999, expected 16"):
        IndexedDataset(good)
    bad = bytearray(raw)
    bad[:9] = b"TNTIDX\x00\x00\x00"  # the legacy format's magic
    idx.write_bytes(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="not a Megatron MMIDIDX"):
        IndexedDataset(good)
    idx.write_bytes(bytes(raw[:20]))
    with pytest.raises(IndexedDatasetError, match="shorter than the 34-byte header"):
        IndexedDataset(good)


def test_empty_documents_in_a_foreign_dataset_are_named(tmp_path):
    reference_build(tmp_path / "e", [[[1, 2]], [[]], [[3]]], np.uint16)
    with pytest.raises(IndexedDatasetError, match="sequence 1 has length 0 .*empty document"):
        IndexedDataset(tmp_path / "e")
    reference_build(tmp_path / "f", [[[1, 2]], [], [[3]]], np.uint16)  # a document with no sequences
    with pytest.raises(IndexedDatasetError, match="document 1 has no sequences"):
        IndexedDataset(tmp_path / "f")


def test_missing_files_are_named(tmp_path, good):
    good.with_suffix(".bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"not found: .*d\.bin"):
        IndexedDataset(good)


def test_token_ids_at_or_above_the_model_vocabulary_fail_with_their_offset(tmp_path):
    docs = [[list(range(i, i + 10))] for i in range(0, 100, 10)]
    docs[7][0][3] = 300  # token offset 73
    reference_build(tmp_path / "v", docs, np.uint16)
    src = SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "v")), seq_len=9, vocab_size=256, seed=0)
    errors = []
    for i in range(src.num_windows):
        try:
            src.sample(i)
        except DataError as exc:
            errors.append(str(exc))
    assert errors and all("token 300 at token offset 73 (byte offset 146)" in e for e in errors)
    assert all("outside the model vocabulary [0, 256)" in e for e in errors)
    # The healthy case: the same data with a large enough vocabulary reads every window.
    big = SampleSource(DataSpec(kind="indexed", path=str(tmp_path / "v")), seq_len=9, vocab_size=512, seed=0)
    assert sum(int(big.sample(i).numel()) for i in range(big.num_windows)) == 10 * big.num_windows


def test_source_reports_dataset_errors_as_data_errors(good):
    good.with_suffix(".bin").write_bytes(b"\x00")
    with pytest.raises(DataError, match="the .idx disagrees with the .bin"):
        SampleSource(DataSpec(kind="indexed", path=str(good)), seq_len=4, vocab_size=256, seed=0)
