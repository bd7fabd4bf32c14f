"""Manifest v3 (each byte hashed once): a shard written in digest mode "chunks" carries only its chunk digests
and `chunk_list_sha256`; a byte flipped in its first, a middle or its last chunk, or a truncation, is still
caught by the tag validation (the daemon's launch check uses it too) and by the standby preload's
`_read_checked`; a tampered chunk list is refused; small files keep the plain sha256; v2 tags still verify;
the env switch names a bad value. Chunks are small (monkeypatched) so files stay ~1 MB."""

from __future__ import annotations

import hashlib
import json

import pytest
from test_checkpoint_chunks import flip

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import digests, files

torch = pytest.importorskip("torch")
CHUNK = 64 << 10


@pytest.fixture
def chunked(monkeypatch):
    from ulyssesd.training.checkpoint import shard_io

    monkeypatch.setattr(shard_io, "DIRECT_BUFFER_BYTES", CHUNK)
    monkeypatch.setattr(files, "DIGEST_CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(ck.saving, "DIGEST_CHUNK_BYTES", CHUNK)
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p, chunk_bytes=CHUNK: real(p, chunk_bytes))


def save_tag(tmp_path, mode, monkeypatch, step=2):
    monkeypatch.setenv(digests.DIGEST_MODE_ENV, mode)
    tag_dir = tmp_path / ck.tag_for_step(step)
    writer = ck.AsyncCheckpointWriter(0)
    writer.begin(tag_dir)
    writer.collect({"x": torch.arange(250_000.0)}, str(tag_dir / "big.pt"))   # ~1 MB: 16 chunks
    writer.collect({"y": torch.arange(100.0)}, str(tag_dir / "small.pt"))    # one chunk
    writer.start()
    assert writer.wait(30) and writer.take_failure() is None
    ck.commit_when_durable(tag_dir, 1, step, 1.0, 8, 1, timeout_s=5)
    return tag_dir


def preload_check(tag_dir, rel):
    from ulyssesd.training.standby import _read_checked

    meta = ck.read_manifest(tag_dir)["files"][rel]
    return _read_checked(tag_dir / rel, meta["size"], meta, False, lambda: False, 0.0)


def test_chunks_mode_records_one_digest_per_chunk_and_a_derived_file_digest(tmp_path, chunked, monkeypatch):
    tag_dir = save_tag(tmp_path, "chunks", monkeypatch)
    man = ck.read_manifest(tag_dir)
    big, small = man["files"]["big.pt"], man["files"]["small.pt"]
    data = (tag_dir / "big.pt").read_bytes()
    assert man["v"] == 3 and "sha256" not in big and big["chunk_bytes"] == CHUNK
    assert big["chunk_sha256"] == [hashlib.sha256(data[o:o + CHUNK]).hexdigest() for o in range(0, len(data), CHUNK)]
    assert big["chunk_list_sha256"] == hashlib.sha256(
        b"".join(hashlib.sha256(data[o:o + CHUNK]).digest() for o in range(0, len(data), CHUNK))).hexdigest()
    assert big["chunk_list_sha256"] != hashlib.sha256(data).hexdigest()   # not to be mistaken for sha256sum
    # a file of one chunk keeps the plain sha256 (its one chunk digest is the whole file's)
    assert small["sha256"] == ck.sha256_file(tag_dir / "small.pt") and "chunk_sha256" not in small
    assert ck.validate_tag(tag_dir, threads=3) == (True, "ok")
    assert preload_check(tag_dir, "big.pt") == -1 and preload_check(tag_dir, "small.pt") == -1


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_chunk_is_caught_by_validation_and_the_preload(tmp_path, chunked, monkeypatch, where):
    tag_dir = save_tag(tmp_path, "chunks", monkeypatch)
    size = (tag_dir / "big.pt").stat().st_size
    n = -(-size // CHUNK)
    k = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    flip(tag_dir / "big.pt", min(size - 1, k * CHUNK + 17))
    ok, reason = ck.validate_tag(tag_dir, threads=4)
    assert not ok and f"big.pt: sha256 of chunk {k} (bytes {k * CHUNK}.." in reason
    assert preload_check(tag_dir, "big.pt") is None


def test_a_truncated_chunked_file_is_caught(tmp_path, chunked, monkeypatch):
    tag_dir = save_tag(tmp_path, "chunks", monkeypatch)
    path = tag_dir / "big.pt"
    size = path.stat().st_size
    meta = ck.read_manifest(tag_dir)["files"]["big.pt"]
    with open(path, "r+b") as fh:
        fh.truncate(size - 5)
    ok, reason = ck.validate_tag(tag_dir)
    assert not ok and "truncated" in reason
    from ulyssesd.training.standby import _read_checked
    assert _read_checked(path, meta["size"], meta, False, lambda: False, 0.0) is None


def test_a_tampered_chunk_list_or_an_entry_without_any_digest_is_refused(tmp_path, chunked, monkeypatch):
    tag_dir = save_tag(tmp_path, "chunks", monkeypatch)
    man_path = tag_dir / ck.MANIFEST_NAME
    good = json.loads(man_path.read_text())
    bad = json.loads(json.dumps(good))
    bad["files"]["big.pt"]["chunk_sha256"][3] = "0" * 64   # the list no longer matches its derived digest
    man_path.write_text(json.dumps(bad))
    with pytest.raises(ck.ManifestError, match="'chunk_list_sha256' does not match"):
        ck.read_manifest(tag_dir)
    bad = json.loads(json.dumps(good))
    for key in ("chunk_list_sha256", "chunk_bytes", "chunk_sha256"):
        bad["files"]["big.pt"].pop(key)
    man_path.write_text(json.dumps(bad))
    with pytest.raises(ck.ManifestError, match="big.pt.*needs integer 'size' and string 'sha256'"):
        ck.read_manifest(tag_dir)


def test_whole_mode_still_writes_the_v2_entry_and_old_tags_verify(tmp_path, chunked, monkeypatch):
    tag_dir = save_tag(tmp_path, "whole", monkeypatch)
    big = ck.read_manifest(tag_dir)["files"]["big.pt"]
    assert big["sha256"] == ck.sha256_file(tag_dir / "big.pt") and len(big["chunk_sha256"]) > 10
    man_path = tag_dir / ck.MANIFEST_NAME
    v2 = json.loads(man_path.read_text())   # what the v2 writer left: no derived digest
    v2["v"] = 2
    for meta in v2["files"].values():
        meta.pop("chunk_list_sha256", None)
    man_path.write_text(json.dumps(v2))
    assert ck.validate_tag(tag_dir) == (True, "ok") and preload_check(tag_dir, "big.pt") == -1
    flip(tag_dir / "big.pt", 5 * CHUNK)
    assert not ck.validate_tag(tag_dir)[0] and preload_check(tag_dir, "big.pt") is None


def test_a_bad_digest_mode_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(digests.DIGEST_MODE_ENV, "both")
    with pytest.raises(ValueError, match="ULYSSESD_CKPT_DIGEST='both': expected one of chunks, whole"):
        ck.write_shard_direct({"x": torch.zeros(3)}, tmp_path / "a.pt")
    assert not list(tmp_path.iterdir())   # nothing half-written left behind
    monkeypatch.delenv(digests.DIGEST_MODE_ENV)
    assert digests.digest_mode() == "chunks"


def test_the_writer_bench_runs_every_variant_it_can_and_skips_the_rest(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "ckpt_writer_bench.py"
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(bench), "--dir", str(tmp_path / "w"), "--gib", "0.02",
                           "--sources", "plain,pinned", "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    names = {f"{m}/plain/{b}" for m in ("whole", "chunks") for b in ("idle", "busy")}
    assert names <= set(res["variants"]) and all(r[0]["GBps"] > 0 for n, r in res["variants"].items() if n in names)
    assert res["variants"]["whole/plain/busy"][0]["busy_loops"] > 0
    if not torch.cuda.is_available():
        assert res["variants"]["pinned"] == {"skipped": "needs CUDA"}
    assert not list((tmp_path / "w").iterdir())   # every file it wrote is gone
