"""Manifest round trip, every corruption kind detected, fallback, quarantine and `latest` (fake tag dirs)."""

from __future__ import annotations

import json
import os

import pytest

from ulyssesd.training import checkpoint as ck


def make_tag(root, step, files=None, manifest=True, loss=1.5):
    """A fake DeepSpeed tag dir shaped like a ZeRO-3 save (2 ranks)."""
    tag = root / ck.tag_for_step(step)
    tag.mkdir(parents=True)
    files = files or {
        "mp_rank_00_model_states.pt": os.urandom(3000),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": os.urandom(5000) + bytes([step % 256]),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": os.urandom(5000),
    }
    for rel, data in files.items():
        (tag / rel).parent.mkdir(parents=True, exist_ok=True)
        (tag / rel).write_bytes(data)
    if manifest:
        ck.write_manifest(tag, step, loss, samples_seen=step * 8, config_version=2)
    return tag


def test_tag_names():
    assert ck.tag_for_step(100) == "step-00000100"
    assert ck.step_of_tag("step-00000100") == 100
    assert ck.step_of_tag("step-123456789") == 123456789
    for other in ["step-00000100.corrupt-17", "global_step100", "latest", "step-1", ".deleting-step-00000001-5"]:
        assert ck.step_of_tag(other) is None
    with pytest.raises(ValueError):
        ck.tag_for_step(-1)


def test_manifest_round_trip(tmp_path):
    tag = make_tag(tmp_path, 100, files={"a.pt": b"x" * 10, "sub/b.pt": b"yz"}, manifest=False)
    m = ck.write_manifest(tag, 100, float("nan"), 800, 3, extra={"world_size": 2})
    read = ck.read_manifest(tag)
    assert read == json.loads(json.dumps(m))
    assert read["tag"] == "step-00000100" and read["step"] == 100 and read["samples_seen"] == 800
    assert read["loss"] == "nan" and read["config_version"] == 3 and read["extra"] == {"world_size": 2}
    assert read["files"]["sub/b.pt"]["size"] == 2 and ck.manifest_bytes(read) == 12
    assert read["files"]["a.pt"]["sha256"] == ck.sha256_file(tag / "a.pt")
    assert set(read["files"]) == {"a.pt", "sub/b.pt"}  # the manifest does not list itself
    assert ck.validate_tag(tag) == (True, "ok")
    assert not [p for p in tag.iterdir() if p.name.startswith(".")]  # temp file renamed away


def test_write_manifest_refuses_step_mismatch_and_empty_dir(tmp_path):
    tag = make_tag(tmp_path, 5, manifest=False)
    with pytest.raises(ValueError, match="does not match"):
        ck.write_manifest(tag, 6, 1.0, 0, 1)
    (tmp_path / "step-00000007").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        ck.write_manifest(tmp_path / "step-00000007", 7, 1.0, 0, 1)


def test_hashing_uses_chunks_that_span_multiple_reads(tmp_path, monkeypatch):
    import hashlib

    data = os.urandom(100_003)
    (tmp_path / "f").write_bytes(data)
    assert ck.sha256_file(tmp_path / "f", chunk=4096) == hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------ corruption kinds
def _flip_bit(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


OPT1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize("kind, expect", [
    ("truncate", f"{OPT1}: size 4000 bytes, manifest says 5000"),
    ("bitflip", f"{OPT1}: sha256"),
    ("missing_file", f"{OPT1}: file listed in the manifest is missing"),
    ("missing_manifest", "manifest.json: no manifest"),
    ("garbled_manifest", "manifest is not valid JSON"),
    ("manifest_not_object", "must be a JSON object"),
    ("manifest_no_files", "manifest lacks 'files'"),
    ("manifest_bad_entry", "needs integer 'size'"),
    ("step_mismatch", "manifest step 99 does not match tag step-00000100"),
    ("escape_path", "points outside the tag directory"),
])
def test_every_corruption_kind_is_detected(tmp_path, kind, expect):
    tag = make_tag(tmp_path, 100)
    assert ck.validate_tag(tag) == (True, "ok")  # positive control before corrupting
    man = tag / "manifest.json"
    data = json.loads(man.read_text())
    if kind == "truncate":
        os.truncate(tag / OPT1, 4000)
    elif kind == "bitflip":
        _flip_bit(tag / OPT1, 2500)
    elif kind == "missing_file":
        (tag / OPT1).unlink()
    elif kind == "missing_manifest":
        man.unlink()
    elif kind == "garbled_manifest":
        man.write_bytes(man.read_bytes()[:40])
    elif kind == "manifest_not_object":
        man.write_text("[1, 2]")
    elif kind == "manifest_no_files":
        del data["files"]
        man.write_text(json.dumps(data))
    elif kind == "manifest_bad_entry":
        data["files"][OPT1] = {"size": "5000"}
        man.write_text(json.dumps(data))
    elif kind == "step_mismatch":
        data["step"] = 99
        man.write_text(json.dumps(data))
    elif kind == "escape_path":
        data["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0"}
        man.write_text(json.dumps(data))
    ok, reason = ck.validate_tag(tag)
    assert not ok and expect in reason, reason


def test_bit_flip_needs_checksums_but_truncation_is_caught_by_the_fast_path(tmp_path):
    tag = make_tag(tmp_path, 1)
    _flip_bit(tag / OPT1, 10)
    assert ck.validate_tag(tag, verify_checksums=False) == (True, "ok")  # sizes only: documented limit
    assert not ck.validate_tag(tag, verify_checksums=True)[0]
    os.truncate(tag / OPT1, 10)
    ok, reason = ck.validate_tag(tag, verify_checksums=False)
    assert not ok and "size 10 bytes" in reason


def test_partial_tag_without_manifest_does_not_exist_for_resume(tmp_path):
    make_tag(tmp_path, 100)
    make_tag(tmp_path, 200, manifest=False)  # crash mid-save
    assert ck.list_tags(tmp_path) == ["step-00000100", "step-00000200"]
    assert ck.list_valid_tags(tmp_path) == ["step-00000100"]
    assert ck.latest_valid_tag(tmp_path) == "step-00000100"


# ------------------------------------------------------------------------- fallback / quarantine
def test_latest_valid_tag_falls_back_newest_to_oldest_and_reports_each_skip(tmp_path):
    for s in (10, 20, 30, 40):
        make_tag(tmp_path, s)
    (tmp_path / "step-00000040" / "manifest.json").unlink()
    _flip_bit(tmp_path / "step-00000030" / OPT1, 0)
    (tmp_path / "step-00000020.corrupt-1700000000").mkdir()  # quarantined dirs are ignored
    (tmp_path / "latest").write_text("step-00000040")
    (tmp_path / "zero_to_fp32.py").write_text("# DeepSpeed drops this at the root")
    skipped = []
    tag = ck.latest_valid_tag(tmp_path, on_invalid=lambda t, r: skipped.append((t, r)))
    assert tag == "step-00000020"
    assert [t for t, _ in skipped] == ["step-00000040", "step-00000030"]
    assert "no manifest" in skipped[0][1] and "sha256" in skipped[1][1]
    # Fast path does not see the bit flip in step 30 (documented trade-off).
    assert ck.latest_valid_tag(tmp_path, verify_checksums=False) == "step-00000030"


def test_no_valid_tag_returns_none(tmp_path):
    assert ck.latest_valid_tag(tmp_path / "missing") is None
    make_tag(tmp_path, 1, manifest=False)
    assert ck.latest_valid_tag(tmp_path) is None


def test_quarantine_renames_never_deletes_and_is_ignored_afterwards(tmp_path):
    make_tag(tmp_path, 10)
    bad = make_tag(tmp_path, 20)
    _flip_bit(bad / OPT1, 0)
    q1 = ck.quarantine(bad)
    assert not bad.exists() and q1.name.startswith("step-00000020.corrupt-")
    assert (q1 / OPT1).stat().st_size == 5000  # evidence kept intact
    assert ck.list_tags(tmp_path) == ["step-00000010"]
    assert ck.list_quarantined(tmp_path) == [q1.name]
    # Same tag quarantined twice within one second: no clobbering.
    make_tag(tmp_path, 20)
    q2 = ck.quarantine(tmp_path / "step-00000020")
    assert q2 != q1 and q1.exists() and q2.exists()
    with pytest.raises(FileNotFoundError):
        ck.quarantine(tmp_path / "step-00000099")


def test_point_latest_to_rewrites_deepspeeds_pointer(tmp_path):
    make_tag(tmp_path, 10)
    make_tag(tmp_path, 20)
    (tmp_path / "latest").write_text("step-00000020")
    ck.point_latest_to(tmp_path, "step-00000010")
    assert (tmp_path / "latest").read_text() == "step-00000010"
    assert ck.read_latest(tmp_path) == "step-00000010"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".latest")]
    with pytest.raises(FileNotFoundError, match="step-00000099"):
        ck.point_latest_to(tmp_path, "step-00000099")
    assert ck.read_latest(tmp_path / "nowhere") is None
