"""After a warm standby's gate opens, rank 0 hashes only the files of the resume tag that the standby's ranks
did not already check (training/train_checkpoints.py `_newest_checked_in_standby`, training/standby.py
`verified_files`): a preload the gate cut short is not thrown away, and no file goes unchecked."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_standby_gate import _tag

from ulyssesd.training import standby
from ulyssesd.training.checkpoint import files as ck_files
from ulyssesd.training.spec import job_spec_from_dict
from ulyssesd.training.standby import Preload
from ulyssesd.training.telemetry import TelemetryWriter
from ulyssesd.training.train import Trainer

RANK1_OPTIM = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
RANK1_MODEL = "zero_pp_rank_1_mp_rank_00_model_states.pt"


@pytest.fixture
def hashed(monkeypatch):
    """Names of the files rank 0 hashes (every verification goes through files._check_job)."""
    names: list[str] = []
    real = ck_files._check_job

    def check(job):
        names.append(Path(job[0]).name)
        return real(job)

    monkeypatch.setattr(ck_files, "_check_job", check)
    return names


def _ready(run_dir: Path, root: Path, rank: int, files_before_the_gate: int | None = None) -> Preload:
    """Rank `rank`'s standby preload and ready file; `files_before_the_gate`: the gate opened after that many
    files (the preload stops before the next one)."""
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return files_before_the_gate is not None and calls[0] > files_before_the_gate

    pre = Preload.read(root, rank, stop=stop)
    assert pre is not None
    standby._write_ready(run_dir, 2, rank, {"verified": {"tag": pre.tag, "files": pre.verified}})
    return pre


def _trainer(run_dir: Path, preload: Preload | None) -> Trainer:
    t = Trainer(job_spec_from_dict({"checkpoint": {"verify_threads": 2}}), run_dir, attempt=2, config_version=1)
    t.rank, t.world = 0, 2
    t.tele = TelemetryWriter(run_dir / "telemetry.jsonl", 2, 1)
    t.preload = preload
    return t


def test_a_preload_cut_short_leaves_only_the_unchecked_files_to_hash(tmp_path, hashed):
    root = tmp_path / "checkpoints"
    d = _tag(root, 4, seed=1)
    pre0 = _ready(tmp_path, root, 0)  # rank 0's standby finished: its two shards checked
    pre1 = _ready(tmp_path, root, 1, files_before_the_gate=1)  # rank 1's stopped after its first file
    assert not pre1.complete and list(pre1.verified) == [RANK1_OPTIM]
    t = _trainer(tmp_path, pre0)
    assert t._choose_tag() == (d.name, None)
    assert hashed == [RANK1_MODEL]  # the one file no standby rank checked, and only it
    assert pre0.hashed_after_gate == 1 and pre0.verified_in_standby is None  # not the whole tag


def test_a_corrupt_file_the_standby_did_not_reach_is_caught_and_the_older_tag_checked_in_full(tmp_path, hashed):
    root = tmp_path / "checkpoints"
    old = _tag(root, 2, seed=2)
    d = _tag(root, 4, seed=1)
    pre0 = _ready(tmp_path, root, 0)
    _ready(tmp_path, root, 1, files_before_the_gate=1)
    f = d / RANK1_MODEL
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    f.write_bytes(bytes(raw))
    t = _trainer(tmp_path, pre0)
    assert t._choose_tag() == (old.name, None)
    assert any(p.name.startswith(f"{d.name}.corrupt-") for p in root.iterdir())
    # the new tag: only the file the standby had not reached; the older one: every file (no standby for it)
    assert sorted(hashed) == sorted([RANK1_MODEL, *ck_files.read_manifest(old)["files"]])


def test_a_file_rewritten_after_the_standby_checked_it_is_hashed_again(tmp_path, hashed):
    root = tmp_path / "checkpoints"
    d = _tag(root, 4, seed=1)
    pre0 = _ready(tmp_path, root, 0)
    _ready(tmp_path, root, 1)
    (d / RANK1_OPTIM).write_bytes((d / RANK1_OPTIM).read_bytes())  # same bytes, a new mtime
    t = _trainer(tmp_path, pre0)
    assert t._choose_tag() == (d.name, None)
    assert hashed == [RANK1_OPTIM]


def test_everything_checked_by_the_standby_means_sizes_only_and_no_standby_means_the_full_check(tmp_path, hashed):
    root = tmp_path / "checkpoints"
    d = _tag(root, 4, seed=1)
    pre0 = _ready(tmp_path, root, 0)
    _ready(tmp_path, root, 1)
    assert _trainer(tmp_path, pre0)._choose_tag() == (d.name, None)
    assert hashed == [] and pre0.verified_in_standby == d.name and pre0.hashed_after_gate == 0
    # A standby whose gate opened before it checked anything: the whole tag is hashed, as on a cold start.
    for r in (0, 1):
        (tmp_path / "standby" / f"attempt-2-rank-{r}.ready").unlink()
    assert _trainer(tmp_path, Preload(root, d.name))._choose_tag() == (d.name, None)
    assert sorted(hashed) == sorted(ck_files.read_manifest(d)["files"])
    hashed.clear()
    assert _trainer(tmp_path, None)._choose_tag() == (d.name, None)  # cold: the full check
    assert sorted(hashed) == sorted(ck_files.read_manifest(d)["files"])
