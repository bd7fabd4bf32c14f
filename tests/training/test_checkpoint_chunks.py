"""Chunked manifest digests and their parallel verification at load: a corrupted chunk is found and named
(file and offset), truncation, v1 manifests (whole-file sha256 only) still verified, the same answer with 1 or
8 threads, the O_DIRECT writer's own chunk digests, and hostile chunk fields refused. Chunks are made small
(monkeypatched DIGEST_CHUNK_BYTES) so multi-chunk files stay a few hundred KB."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from ulyssesd.training import checkpoint as ck
from ulyssesd.training.checkpoint import digests, files

CHUNK = 64 << 10   # 64 KiB chunks in these tests (the product uses 64 MiB)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(files, "DIGEST_CHUNK_BYTES", CHUNK)
    # digest_file's default argument was bound at import: pass the patched size through.
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p, chunk_bytes=CHUNK: real(p, chunk_bytes))
    return CHUNK


def make_tag(root, step=10, sizes=(5 * CHUNK + 123, 3 * CHUNK, 777)):
    tag = root / ck.tag_for_step(step)
    tag.mkdir(parents=True)
    for i, size in enumerate(sizes):
        (tag / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(size))
    ck.write_manifest(tag, step, 1.0, 0, 1)
    return tag


def flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


BIG = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_manifest_lists_each_chunks_sha256_beside_the_whole_file_digest(tmp_path, small_chunks):
    tag = make_tag(tmp_path)
    data = (tag / BIG).read_bytes()
    entry = ck.read_manifest(tag)["files"][BIG]
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()   # kept: the standby preload checks it
    assert entry["chunk_bytes"] == CHUNK and len(entry["chunk_sha256"]) == 6   # 5 whole chunks + 123 bytes
    assert entry["chunk_sha256"] == [hashlib.sha256(data[o:o + CHUNK]).hexdigest()
                                     for o in range(0, len(data), CHUNK)]
    assert ck.read_manifest(tag)["v"] == 3
    assert entry["chunk_list_sha256"] == hashlib.sha256(
        b"".join(hashlib.sha256(data[o:o + CHUNK]).digest() for o in range(0, len(data), CHUNK))).hexdigest()
    assert ck.validate_tag(tag) == (True, "ok")


@pytest.mark.parametrize("k", [0, 3, 5])   # first, middle and the short last chunk
def test_a_corrupted_byte_in_chunk_k_is_found_and_named(tmp_path, small_chunks, k):
    tag = make_tag(tmp_path)
    flip(tag / BIG, k * CHUNK + 17)
    assert ck.validate_tag(tag, verify_checksums=False) == (True, "ok")   # sizes alone cannot see it
    for threads in (1, 4):
        ok, reason = ck.validate_tag(tag, threads=threads)
        assert not ok
        assert f"{BIG}: sha256 of chunk {k} (bytes {k * CHUNK}..{min((k + 1) * CHUNK, 5 * CHUNK + 123)})" in reason
        assert "(corrupted)" in reason


def test_several_bad_chunks_give_the_same_first_reason_with_1_or_8_threads(tmp_path, small_chunks):
    tag = make_tag(tmp_path)
    other = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(tag / other, 2 * CHUNK + 1)
    flip(tag / BIG, 4 * CHUNK)
    flip(tag / BIG, 1 * CHUNK + 9)
    one = ck.validate_tag(tag, threads=1)
    assert not one[0] and f"{BIG}: sha256 of chunk 1 " in one[1]   # file order, then offset order
    assert all(ck.validate_tag(tag, threads=8) == one for _ in range(5))
    healthy = make_tag(tmp_path, step=20)
    assert ck.validate_tag(healthy, threads=1) == ck.validate_tag(healthy, threads=8) == (True, "ok")


def test_a_truncated_file_is_caught_by_size_and_one_that_shrinks_during_verification_by_the_read(tmp_path,
                                                                                                  small_chunks):
    tag = make_tag(tmp_path)
    os.truncate(tag / BIG, 2 * CHUNK)
    ok, reason = ck.validate_tag(tag)
    assert not ok and f"{BIG}: size {2 * CHUNK} bytes, manifest says {5 * CHUNK + 123}" in reason
    # The size check passed, then the file shrank before its chunks were read: the read names it.
    files_ = ck.read_manifest(tag)["files"]
    files_[BIG]["size"] = 2 * CHUNK + 5
    files_[BIG]["chunk_sha256"] = files_[BIG]["chunk_sha256"][:3]
    reason = ck.verify_checksums_parallel(tag, {BIG: files_[BIG]}, threads=2)
    assert reason is not None and f"{BIG}: ended at byte {2 * CHUNK} while verifying chunk 2" in reason


def test_an_old_manifest_without_chunks_is_read_and_verified_whole(tmp_path, small_chunks):
    tag = make_tag(tmp_path)
    man = tag / ck.MANIFEST_NAME
    old = json.loads(man.read_text())
    old["v"] = 1
    for meta in old["files"].values():
        meta.pop("chunk_bytes", None), meta.pop("chunk_sha256", None), meta.pop("chunk_list_sha256", None)
    man.write_text(json.dumps(old))
    assert ck.validate_tag(tag) == (True, "ok")
    flip(tag / BIG, 3 * CHUNK)
    for threads in (1, 3):
        ok, reason = ck.validate_tag(tag, threads=threads)
        assert not ok and f"{BIG}: sha256 " in reason and "(corrupted)" in reason
        assert "chunk" not in reason.split(BIG)[1]
    assert ck.latest_valid_tag(tmp_path, threads=2) is None


def test_a_corrupt_chunk_makes_load_fall_back_to_the_previous_tag(tmp_path, small_chunks):
    older, newer = make_tag(tmp_path, 10), make_tag(tmp_path, 20)
    flip(newer / BIG, 2 * CHUNK + 5)
    skipped = []
    assert ck.latest_valid_tag(tmp_path, on_invalid=lambda t, r: skipped.append((t, r)), threads=4) == older.name
    assert [t for t, _ in skipped] == [newer.name] and "chunk 2" in skipped[0][1]


@pytest.mark.parametrize("change, expect", [
    (lambda m: m.update(chunk_bytes=0), "'chunk_bytes' must be an integer in [4096, "),
    (lambda m: m.update(chunk_bytes="65536"), "'chunk_bytes' must be an integer"),
    (lambda m: m.update(chunk_bytes=2 << 30), "'chunk_bytes' must be an integer"),
    (lambda m: m["chunk_sha256"].pop(), "'chunk_sha256' must list 6 digests"),
    (lambda m: m.update(chunk_sha256="abc"), "'chunk_sha256' must list 6 digests"),
    (lambda m: m["chunk_sha256"].__setitem__(2, "Z" * 64), "is not a 64-digit lowercase hex sha256"),
    (lambda m: m.pop("chunk_bytes"), "'chunk_bytes' must be an integer"),
])
def test_hostile_chunk_fields_are_refused_naming_the_file(tmp_path, small_chunks, change, expect):
    tag = make_tag(tmp_path)
    man = tag / ck.MANIFEST_NAME
    data = json.loads(man.read_text())
    change(data["files"][BIG])
    man.write_text(json.dumps(data))
    ok, reason = ck.validate_tag(tag)
    assert not ok and f"entry for {BIG!r}" in reason and expect in reason, reason


def test_verification_threads_are_validated(tmp_path, small_chunks):
    tag = make_tag(tmp_path)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="verification threads must be an integer >= 1"):
            ck.validate_tag(tag, threads=bad)
    from ulyssesd.training.spec import CheckpointSpec

    assert CheckpointSpec(verify_threads=4).verify_threads == 4
    with pytest.raises(ValueError, match="verify_threads"):
        CheckpointSpec(verify_threads=0)


def test_digest_file_matches_a_plain_hash_at_chunk_boundaries(tmp_path):
    for size in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, (files.HASH_CHUNK // CHUNK + 1) * CHUNK + 3):
        data = os.urandom(size)
        (tmp_path / "f").write_bytes(data)
        d = files.digest_file(tmp_path / "f", CHUNK)
        assert d["size"] == size and d["sha256"] == hashlib.sha256(data).hexdigest()
        assert d["chunk_sha256"] == [hashlib.sha256(data[o:o + CHUNK]).hexdigest() for o in range(0, size, CHUNK)]


@pytest.mark.parametrize("mode", ["chunks", "whole"])
def test_the_direct_writer_takes_the_chunk_digests_and_the_commit_uses_them(tmp_path, monkeypatch, mode):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("ULYSSESD_CKPT_DIGEST", mode)
    from ulyssesd.training.checkpoint import shard_io

    # 64 KiB buffers = 64 KiB chunks: a 1 MB shard spans 16 buffers, the last one partial.
    monkeypatch.setattr(shard_io, "DIRECT_BUFFER_BYTES", CHUNK)
    monkeypatch.setattr(files, "DIGEST_CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(ck.saving, "DIGEST_CHUNK_BYTES", CHUNK)
    tag_dir = tmp_path / ck.tag_for_step(2)
    writer = ck.AsyncCheckpointWriter(0)
    writer.begin(tag_dir)
    writer.collect({"x": torch.arange(250_000.0)}, str(tag_dir / "a.pt"))
    writer.start()
    assert writer.wait(30) and writer.take_failure() is None
    data = (tag_dir / "a.pt").read_bytes()
    want = [hashlib.sha256(data[o:o + CHUNK]).hexdigest() for o in range(0, len(data), CHUNK)]
    assert len(want) > 10
    marker = json.loads((tag_dir / f"{ck.DONE_PREFIX}0").read_text())
    assert marker["a.pt"]["chunk_sha256"] == want and marker["a.pt"]["chunk_bytes"] == CHUNK
    hashed = []
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p, *a: (hashed.append(os.path.basename(p)), real(p, *a))[1])
    manifest = ck.commit_when_durable(tag_dir, 1, 2, 1.0, 8, 1, timeout_s=5)
    assert hashed == []   # the shard was not read again
    assert manifest["files"]["a.pt"]["chunk_sha256"] == want
    if mode == "whole":   # the v2 writer's second, serial hash of every byte
        assert manifest["files"]["a.pt"]["sha256"] == hashlib.sha256(data).hexdigest()
    else:                 # each byte hashed once: the file digest is derived from the chunk digests
        assert "sha256" not in manifest["files"]["a.pt"] and "sha256" not in marker["a.pt"]
        assert manifest["files"]["a.pt"]["chunk_list_sha256"] == digests.chunk_list_sha256(want)
    assert ck.validate_tag(tag_dir, threads=4) == (True, "ok")
    flip(tag_dir / "a.pt", 7 * CHUNK + 3)
    ok, reason = ck.validate_tag(tag_dir, threads=4)
    assert not ok and f"a.pt: sha256 of chunk 7 (bytes {7 * CHUNK}.." in reason


def test_a_file_of_one_chunk_or_less_has_no_chunk_fields_and_is_verified_whole(tmp_path, small_chunks):
    tag = make_tag(tmp_path, sizes=(CHUNK + 1, CHUNK, 10))
    entries = ck.read_manifest(tag)["files"]
    assert [len(entries[f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt"].get("chunk_sha256", [])) for i in range(3)] \
        == [2, 0, 0]
    small = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(tag / small, CHUNK - 1)
    ok, reason = ck.validate_tag(tag, threads=3)
    assert not ok and f"{small}: sha256 " in reason and "chunk" not in reason.split(small)[1]
