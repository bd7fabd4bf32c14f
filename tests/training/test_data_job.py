"""The real job (torchrun, 2 ranks, Ulysses SP=2, DeepSpeed ZeRO-3) on a preprocessed indexed dataset:
a rank killed mid-run resumes to the uninterrupted run's exact losses, the checkpoint carries the data
counters, a rollback's skipped range is never read, and a dataset that does not fit the model stops the
job at start with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from train_job_helpers import launch, tiny_spec

from ulyssesd.training.data.preprocess import preprocess
from ulyssesd.training.data.tokenizer import train_bpe

pytestmark = pytest.mark.slow

TEXTS = [f"Record {i}: ranks {i % 7} and {i % 5} agree on step {i}; the loss is {i % 11}.\n" * (1 + i % 4)
         for i in range(300)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    train_bpe(TEXTS, vocab_size=300).save(d / "tokenizer.json")
    preprocess([d / "in.jsonl"], d / "tokenizer.json", d / "ds")
    return d


def _spec(dataset, **sections):
    data = {"kind": "indexed", "path": str(dataset / "ds"), "tokenizer": str(dataset / "tokenizer.json"),
            **sections.pop("data", {})}
    return tiny_spec(model={"preset": "tiny", "vocab_size": 384}, data=data, **sections)


def test_kill_and_resume_on_indexed_data_is_exact_and_keeps_the_data_counters(dataset, tmp_path):
    base = launch(_spec(dataset), tmp_path / "base")
    assert base.returncode == 0, base.output[-4000:]
    ref = base.steps()
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and ref[6]["loss"] < ref[1]["loss"]
    faults = [{"kind": "sigkill", "at_step": 5, "rank": 1}]
    first = launch(_spec(dataset, faults=faults), tmp_path / "killed")
    assert first.returncode != 0 and sorted(first.steps(1)) == [1, 2, 3, 4]
    second = launch(_spec(dataset, faults=faults), tmp_path / "killed", attempt=2)
    assert second.returncode == 0, second.output[-4000:]
    resumed = second.steps(2)
    assert sorted(resumed) == [5, 6]
    for step in resumed:
        assert resumed[step]["samples"] == ref[step]["samples"]
        assert resumed[step]["loss"] == ref[step]["loss"], step  # same batches, same weights: exact in fp32
    assert not second.events("data_changed")
    tag_dir = tmp_path / "killed" / "checkpoints" / "step-00000004"
    [states] = sorted(tag_dir.glob("zero_pp_rank_0_*model_states.pt"))
    client = torch.load(states, map_location="cpu", weights_only=False)
    assert client["data_cursor"]["next_sample"] == 4
    assert client["data_position"]["samples_consumed"] == 4 and client["data_position"]["epoch"] == 0
    assert client["data_fingerprint"]["kind"] == "indexed" and client["data_fingerprint"]["seq_len"] == 64

    # Rollback to step 2 with [3, 5) skipped (what the daemon writes into the next config version).
    rolled = launch(_spec(dataset, data={"skip_ranges": [[3, 5]]}, checkpoint={"load": "step-00000002"}),
                    tmp_path / "killed", attempt=3)
    assert rolled.returncode == 0, rolled.output[-4000:]
    after = rolled.steps(3)
    # A step's `samples` is the [start, end) it consumed: step 4 passes over 3 and 4 and trains on 5 only.
    assert [after[s]["samples"] for s in sorted(after)] == [[2, 3], [3, 6], [6, 7], [7, 8]]
    assert after[3]["loss"] == ref[3]["loss"]  # sample 2 is read as before the rollback
    assert all(rec.get("data_wait_s") is not None for rec in after.values())


def test_a_dataset_made_for_another_vocabulary_stops_the_job_at_start(dataset, tmp_path):
    spec = tiny_spec(parallel={"sequence_parallel_size": 1}, model={"preset": "tiny", "vocab_size": 256},
                     data={"kind": "indexed", "path": str(dataset / "ds")})
    run = launch(spec, tmp_path, nproc=1)
    assert run.returncode not in (0, None)
    assert "DataError" in run.output and "model.vocab_size=256" in run.output
    assert not run.steps()
