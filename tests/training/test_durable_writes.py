"""training.durable: the one atomic-replace of the training side (checkpoint manifests, `latest`, shards,
the indexed dataset pair, the preprocessing metadata)."""

from __future__ import annotations

import pytest

from ulyssesd.training.durable import atomic_write, atomic_write_text, durable_replace


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "manifest.json"
    target.write_text("old")

    def half_then_fail(fh):
        fh.write(b"new, but only ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_complete_write_replaces_the_file(tmp_path):
    target = tmp_path / "latest"
    target.write_text("step-00000001")
    atomic_write_text(target, "step-00000002")
    assert target.read_text() == "step-00000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_streamed_temp_file_is_published_under_its_final_name(tmp_path):
    tmp, final = tmp_path / "corpus.bin.tmp-1", tmp_path / "corpus.bin"
    tmp.write_bytes(b"\x01\x02")
    durable_replace(tmp, final)
    assert final.read_bytes() == b"\x01\x02" and not tmp.exists()
