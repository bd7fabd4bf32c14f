"""The shipped example end to end: the standard library's docstrings (real text that ships with Python),
a BPE trained on them by `tokenizers`, `ulysses-preprocess`, and the real job (DeepSpeed ZeRO-3, one CPU
process): the training loss must fall well below the unigram entropy of the tokenized text."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ulyssesd.training.data.indexed_dataset import IndexedDataset
from ulyssesd.training.spec import job_spec_from_dict, read_toml

REPO = Path(__file__).resolve().parents[2]
STEPS = 300


def unigram_entropy_nats(tokens: np.ndarray) -> float:
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.mark.slow
def test_tiny_model_learns_real_text_below_its_unigram_entropy(tmp_path):
    run = dict(capture_output=True, text=True, timeout=300, cwd=REPO)
    corpus = tmp_path / "stdlib.jsonl"
    out = subprocess.run([sys.executable, "examples/stdlib_text/make_corpus.py", str(corpus)], **run)
    assert out.returncode == 0, out.stderr
    assert corpus.stat().st_size > 1_000_000  # >= ~1 MB of real text
    prefix, tok = tmp_path / "stdlib", tmp_path / "tokenizer.json"
    out = subprocess.run([sys.executable, "-m", "ulyssesd.training.data.preprocess", str(corpus), "--train-tokenizer",
                          str(tok), "--vocab-size", "1024", "--output-prefix", str(prefix), "--workers", "2",
                          "--chunk-mb", "0.5"], **run)
    assert out.returncode == 0, out.stderr
    entropy = unigram_entropy_nats(IndexedDataset(prefix).tokens)
    assert 5.0 < entropy < math.log(1024)

    # The shipped config, pointed at this test's data and shortened.
    data = read_toml(REPO / "configs" / "tiny-stdlib-text.toml")
    data["data"].update(path=str(prefix), tokenizer=str(tok))
    data["train"]["steps"] = STEPS
    spec = job_spec_from_dict(data, "tiny-stdlib-text.toml")
    cfg = tmp_path / "v1.json"
    cfg.write_text(spec.to_json())
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}
    job = subprocess.run([sys.executable, "-m", "ulyssesd.training", "--config", str(cfg), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=600, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    steps = [r for r in map(json.loads, (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    losses = [r["loss"] for r in steps]
    assert len(losses) == STEPS
    first, last = float(np.mean(losses[:5])), float(np.mean(losses[-25:]))
    print(f"unigram entropy {entropy:.3f} nats; loss first 5 steps {first:.3f}, last 25 steps {last:.3f}")
    assert first > entropy  # it starts above (a uniform guess is ln 1024 = 6.93): the bar can be missed
    assert last < entropy - 0.7, (entropy, last)
    # The prefetch thread kept up: waiting for data is a small fraction of the step.
    wait = float(np.median([r["data_wait_s"] for r in steps]))
    assert wait < 0.1 * float(np.median([r["step_time_s"] for r in steps]))
